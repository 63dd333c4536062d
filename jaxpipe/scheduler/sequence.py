"""One request's life in the engine: ids, tokens so far, its KV slot and why it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being served. `params` is its SamplingParams (opaque to the scheduler)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    seed: int
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    extra: dict = field(default_factory=dict)  # the engine's per-request host state

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the KV positions this sequence will occupy."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
