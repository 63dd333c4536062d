"""What a caller gets back: vLLM-shaped request outputs and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated completion (jaxpipe generates n=1 per request)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}


@dataclass
class RequestOutput:
    """A request's result, as returned by `Engine.generate` / `Engine.chat`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)


@dataclass
class StreamDelta:
    """What `Engine.stream` yields: the tokens and text added since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
