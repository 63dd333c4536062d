"""Between protobuf messages (jaxpipe.v1) and plain Python values.

`prompt_of` / `sampling_of` read a GenerateRequest or BatchItem; the `*_proto` functions build
responses. Fields the server does not know (a client built from a newer proto) are refused,
never silently ignored.
"""

from __future__ import annotations

from google.protobuf.unknown_fields import UnknownFieldSet

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.request.errors import RequestError

_SCALARS = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields
            if not f.is_repeated and f.message_type is None]
_LISTS = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")  # empty: not set


def check_known_fields(msg, path: str = "") -> None:
    """Raise RequestError naming the first field number this server's proto does not define."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        number = unknown[0].field_number
        raise RequestError(f"{path or msg.DESCRIPTOR.name}.#{number}",
                           f"unknown field number {number} in {msg.DESCRIPTOR.full_name}; "
                           "is the client's jaxpipe.proto newer than the server's?")
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.is_repeated:
            for i, element in enumerate(value):
                check_known_fields(element, f"{name}[{i}]")
        else:
            check_known_fields(value, name)


def prompt_of(msg) -> tuple[str | None, object]:
    """(kind, value) of a request's prompt oneof: text / chat messages / token ids."""
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        return kind, msg.text
    if kind == "chat":
        return kind, [{"role": c.role, "content": c.content} for c in msg.chat.messages]
    if kind == "token_ids":
        return kind, list(msg.token_ids.ids)
    return None, None


def sampling_of(msg) -> dict:
    """The SamplingParams fields a request sets (unset ones keep SamplingParams' defaults)."""
    s = msg.sampling
    fields = {name: getattr(s, name) for name in _SCALARS if s.HasField(name)}
    fields.update({name: list(getattr(s, name)) for name in _LISTS if getattr(s, name)})
    if s.logit_bias:
        fields["logit_bias"] = dict(s.logit_bias)
    if s.HasField("structured_outputs"):
        fields["structured_outputs"] = structured_of(s.structured_outputs)
    return fields


def structured_of(so: pb.StructuredOutputs) -> dict:
    """A StructuredOutputs message -> StructuredOutputsParams fields (whether the constraint
    compiles is `validate.prepare`'s question)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError("sampling.structured_outputs", "set one of json, regex, choice, "
                           "grammar, json_object (or leave structured_outputs unset)")
    if kind == "choice":
        return {"choice": list(so.choice.options)}
    return {kind: getattr(so, kind)}


def logprobs_proto(entries) -> list[pb.TokenLogprobs]:
    """[[[id, logprob], ...] per token] -> TokenLogprobs messages."""
    return [pb.TokenLogprobs(entries=[pb.TopLogprob(token_id=int(t), logprob=lp)
                                      for t, lp in per_token]) for per_token in entries]


def prompt_logprobs_proto(entries) -> list[pb.TokenLogprobs]:
    """Per prompt token None (the first) or [[id, logprob], ...] -> TokenLogprobs messages
    (None: an empty one)."""
    return logprobs_proto([per_token or [] for per_token in entries or []])


def usage_proto(prompt_tokens: int, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens)


def set_stop_reason(msg, stop_reason: int | str | None) -> None:
    """Fill a message's stop_reason oneof (token id or stop string)."""
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif stop_reason is not None:
        msg.stop_token_id = int(stop_reason)


def error_result(custom_id: str, code: str, field: str, message: str) -> pb.BatchResult:
    return pb.BatchResult(custom_id=custom_id,
                          error=pb.Error(code=code, field=field, message=message))
