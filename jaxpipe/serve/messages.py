"""Control messages between the front end and the engine process (over ZeroMQ).

Small, typed and versioned: each message is one frozen dataclass, sent as UTF-8 JSON
`{"v": PROTOCOL_VERSION, "type": <class name>, "body": {...}}`. Only ids, token ids, numbers and
strings travel; never pickled objects. A message of another version or an unknown type is
refused with `ProtocolError`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from jaxpipe.request.outputs import TokenDelta  # defined beside the Completion that folds it

PROTOCOL_VERSION = 2  # 2: Ready says how the engine got its programs


def sample_key(request_id: str, index: int) -> str:
    """The id a request's sample `index` travels under in `TokenDelta`s (n > 1): the
    request's own id for sample 0, "<request id>/<index>" for the others."""
    return request_id if index == 0 else f"{request_id}/{index}"


def sample_keys(request_id: str, n: int) -> list[str]:
    return [sample_key(request_id, i) for i in range(n)]


class ProtocolError(ValueError):
    """A control message that this side cannot decode."""


# ---- front end -> engine ---------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Queue one validated request. `params` holds `SamplingParams` fields (JSON values);
    with n > 1 its samples' deltas come under `sample_keys(request_id, n)`."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict


@dataclass(frozen=True)
class Abort:
    """Stop a request (client cancelled; `request_id` may be any of its sample keys); the
    engine answers with a finished `TokenDelta` for each sample still running."""

    request_id: str


@dataclass(frozen=True)
class QueryStats:
    """Ask the engine process for a `Stats` message."""


@dataclass(frozen=True)
class Shutdown:
    """Finish the engine loop and exit (sent after the front end has drained)."""


# ---- engine -> front end ---------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine is loaded; what the front end needs to validate requests, and how the
    engine got its programs (`jaxpipe.serve.programs`: compiled, or loaded from the persistent
    compilation cache; the loaded ones take more memory)."""

    pid: int
    model: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    programs_compiled: int = 0
    programs_loaded: int = 0


@dataclass(frozen=True)
class Outputs:
    """Every delta produced by one engine step (one message per step, not per request)."""

    deltas: list[TokenDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Rejected:
    """The engine refused a request (it validates again); nothing was queued."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Stats:
    """Engine-process load, answered to `QueryStats`."""

    unfinished_requests: int
    engine_has_unfinished: bool
    finished_requests: int
    aborted_requests: int
    generated_tokens: int
    engine: dict = field(default_factory=dict)  # Engine.stats() less host_timeline


MESSAGE_TYPES = {cls.__name__: cls for cls in (
    AddRequest, Abort, QueryStats, Shutdown, Ready, TokenDelta, Outputs, Rejected, Stats)}


def encode(message) -> bytes:
    """One message -> bytes for the socket."""
    name = type(message).__name__
    if MESSAGE_TYPES.get(name) is not type(message):
        raise ProtocolError(f"not a control message: {type(message).__name__}")
    body = dataclasses.asdict(message)
    return json.dumps({"v": PROTOCOL_VERSION, "type": name, "body": body},
                      separators=(",", ":")).encode()


def decode(data: bytes):
    """Bytes from the socket -> one message, or ProtocolError saying what was wrong."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control message is not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("v") != PROTOCOL_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise ProtocolError(f"control message version {version!r}; this side speaks "
                            f"{PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(raw.get("type"))
    if cls is None or not isinstance(raw.get("body"), dict):
        raise ProtocolError(f"unknown control message type {raw.get('type')!r}; "
                            f"known: {sorted(MESSAGE_TYPES)}")
    return _build(cls, raw["body"])


def _build(cls, body: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    if set(body) - names:
        raise ProtocolError(f"{cls.__name__} has no fields {sorted(set(body) - names)}")
    if cls is Outputs:
        body = {"deltas": [_build(TokenDelta, d) for d in body.get("deltas", [])]}
    try:
        return cls(**body)
    except TypeError as e:
        raise ProtocolError(f"bad {cls.__name__} message: {e}") from None
