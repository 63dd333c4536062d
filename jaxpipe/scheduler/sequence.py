"""One request's record: the scheduler's token counts (`SeqInfo`) plus what the engine needs
to serve it (its tokens, sampling parameters, stop checker, outcome and timings); its device
slot and blocks are `SeqInfo`'s, given by the `SchedulerState`'s device ledger.

The engine puts its `Sequence` objects straight into the `SchedulerState`, so the policies,
the executor and the KV manager all read the same record; the simulator uses plain
`SeqInfo`s, which carry only lengths (and the blocks and slot the state gives them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxpipe.scheduler.seq_info import SeqInfo


@dataclass(eq=False)
class Sequence(SeqInfo):
    """A request being served. `seq_id` is its request id; `max_output_len` its resolved
    max_tokens (params.max_tokens, or what fits in max_model_len)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    params: Any = None  # SamplingParams (opaque to the scheduler)
    seed: int = 0
    prompt: str | None = None  # the prompt's text, when it was given as text
    stop: Any = None  # its StopChecker: stop ids / strings, min and max tokens, detokenizer
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs: per prompt position, its token's {id: logprob} then the top k
    # (None for the first token, and until scored), and its token's rank
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    index: int = 0  # which of its request's n samples it is
    samples: list[Sequence] | None = None  # the first sample's: all n (None when n = 1)
    grammar: Any = None  # its output constraint's matcher (structured outputs; opaque here)

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: Any, seed: int,
               max_tokens: int, **fields) -> Sequence:
        return cls(request_id, len(prompt_token_ids), max_tokens,
                   prompt_token_ids=list(prompt_token_ids), params=params, seed=seed, **fields)

    @property
    def request_id(self) -> str:
        """Its id in the scheduler (a sample past the first: ("sample", request id, i))."""
        return self.seq_id

    @property
    def group_id(self) -> str:
        """Its request's id (the caller's)."""
        return self.seq_id if self.index == 0 else self.seq_id[1]

    def fork_samples(self, n: int, make) -> None:
        """Make this first sample of a request the parent of `n - 1` more: `make(i)` is
        sample i, which forks from it when its prompt is prefilled (`SchedulerState`)."""
        if n > 1:
            self.forks = [make(i) for i in range(1, n)]
            self.samples = [self, *self.forks]

    @property
    def group(self) -> list[Sequence]:
        """Its request's samples, in index order (the first sample's; itself when n = 1)."""
        return self.samples or [self]

    @property
    def request_finished(self) -> bool:
        """Whether every sample of its request has finished (the first sample's)."""
        return all(s.is_finished for s in self.group)

    @property
    def max_tokens(self) -> int:
        return self.max_output_len

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the KV positions this sequence will occupy."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def at_length(self, outputs: int, max_model_len: int) -> bool:
        """Whether `outputs` output tokens end the request by length (max_tokens reached, or
        the context fills max_model_len)."""
        return outputs >= self.max_output_len or self.prompt_len + outputs >= max_model_len

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Its context's token ids in [start, stop): prompt, then the outputs received so
        far (fewer than asked while an output is still in flight)."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        outputs = self.output_token_ids[max(start - len(prompt), 0):stop - len(prompt)]
        return prompt[start:stop] + outputs

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
