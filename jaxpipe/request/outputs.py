"""What a caller gets back: vLLM-shaped request outputs and streaming deltas, and the one path
from a sequence to any output: `token_delta` (a `Sequence`'s new tokens) folded into a
`Completion` (ids, logprobs, text, finish), for `Engine.pop_output` / `generate` / `stream`, the
serving front ends and batch jobs alike; `Completion.to_output` is the `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxpipe.request.stopping import TextStream, final_text

if TYPE_CHECKING:
    from jaxpipe.request.validate import Prepared
    from jaxpipe.scheduler import Sequence


@dataclass
class CompletionOutput:
    """One generated completion: sample `index` of its request's n."""

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
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {id: logprob}
    # with the prompt's token first and the top k after it; and each prompt token's rank
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


@dataclass
class StreamDelta:
    """What `Engine.stream` yields: the tokens and text added since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    index: int = 0  # which of the request's n samples


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request. `logprobs`: per new token, [[token id, logprob], ...] with the
    sampled token first (None unless requested). `finish_reason` is set on the last delta.
    What the engine process sends the front ends (a `serve.messages` control message), and what
    a `Completion` folds."""

    request_id: str
    token_ids: list[int]
    logprobs: list[list[list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # in the first delta, with prompt_logprobs: per prompt token None (the first) or
    # [[id, logprob], ...] with the prompt's token first; and each prompt token's rank
    prompt_logprobs: list[list[list[float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None


def token_delta(seq, start: int = 0) -> TokenDelta:
    """A `Sequence`'s output from its token `start` on; it carries the finish once the
    sequence has finished."""
    new = [int(t) for t in seq.output_token_ids[start:]]
    logprobs = None
    if seq.logprobs is not None:
        logprobs = [[[int(t), float(lp)] for t, lp in entry.items()]
                    for entry in seq.logprobs[start:]]
    prompt = prompt_delta(seq) if start == 0 else {}
    if not seq.is_finished:
        return TokenDelta(seq.request_id, new, logprobs, **prompt)
    return TokenDelta(seq.request_id, new, logprobs, seq.finish_reason, seq.stop_reason,
                      **prompt)


def prompt_delta(seq) -> dict:
    """A `Sequence`'s prompt logprobs as `TokenDelta` fields ({}: it asked for none)."""
    if seq.params.prompt_logprobs is None:
        return {}
    scored = seq.prompt_logprobs or [None] * seq.prompt_len  # (none: a one-token prompt)
    entries = [None if e is None else [[int(t), float(lp)] for t, lp in e.items()]
               for e in scored]
    return {"prompt_logprobs": entries,
            "prompt_ranks": list(seq.prompt_ranks or [None] * seq.prompt_len)}


class Completion:
    """One request's completion as its `TokenDelta`s arrive: token ids, logprobs, text, finish.

    The one place a delta becomes output, for the engine and every front end (HTTP, gRPC,
    batch jobs). `prep`: the request's prompt ids and sampling params (a `Prepared`, or the
    `Sequence` itself in the engine's process). `stream=True` detokenizes as it goes (`add`
    returns the text now safe to send, holding back what may become a stop string); otherwise
    the text is decoded once, at the finish. `echo` is text put before the completion's;
    `timer` (metrics.RequestTimer) hears of its tokens."""

    def __init__(self, prep: Prepared | Sequence, tokenizer, *, stream: bool = False,
                 echo: str = "", timer=None):
        self.prep, self.tokenizer, self.echo, self.timer = prep, tokenizer, echo, timer
        self.echo_text = echo  # the echo, kept after it went out
        self.stream = None if tokenizer is None or not stream else TextStream(
            tokenizer, prep.prompt_token_ids, prep.params.skip_special_tokens, prep.params.stop,
            prep.params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.logprobs: list = []  # per token [[id, logprob], ...], sampled token first
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list | None = None  # per prompt token (TokenDelta's)
        self.prompt_ranks: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def requested_logprobs(self) -> list | None:
        """The logprobs if the request asked for them, else None."""
        return self.logprobs if self.prep.params.logprobs is not None else None

    def add(self, delta: TokenDelta) -> str:
        """Fold in one delta; returns the new text (the echo first)."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = delta.prompt_logprobs, delta.prompt_ranks
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        new = self._new_text(delta)
        if self.timer is not None:
            self.timer.tokens(len(delta.token_ids))
            if self.finished:
                self.timer.finished()
        new, self.echo = self.echo + new, ""
        self.text += new
        return new

    def to_output(self, request_id: str, prompt: str | None, metrics: dict) -> RequestOutput:
        """The finished completion as the vLLM-shaped `RequestOutput` (its logprobs one
        {token id: logprob} dict per token, the sampled token first)."""
        return RequestOutput(request_id, prompt, list(self.prep.prompt_token_ids),
                             [self.completion_output(0)], self.finished, metrics,
                             *self.prompt_output())

    def prompt_output(self) -> tuple[list | None, list | None]:
        """(prompt_logprobs as `RequestOutput` has them: {id: logprob} per prompt token, None
        first; prompt_ranks), both None unless the request asked for them."""
        if self.prompt_logprobs is None:
            return None, None
        return [None if e is None else {int(t): lp for t, lp in e}
                for e in self.prompt_logprobs], self.prompt_ranks

    def completion_output(self, index: int) -> CompletionOutput:
        """The completion as sample `index`'s `CompletionOutput`."""
        logprobs = self.requested_logprobs
        if logprobs is not None:
            logprobs = [{int(t): lp for t, lp in entry} for entry in logprobs]
        return CompletionOutput(index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, logprobs)

    def _new_text(self, delta: TokenDelta) -> str:
        if self.tokenizer is None:
            return ""
        if self.stream is not None:
            if not self.finished:
                return self.stream.push(delta.token_ids)
            return self.stream.finish(delta.token_ids, delta.stop_reason)
        if not self.finished:
            return ""
        return final_text(self.tokenizer, self.token_ids, self.prep.params.skip_special_tokens,
                          delta.stop_reason, self.prep.params.include_stop_str_in_output)
