"""When a request ends, and its text: EOS, stop token ids, stop strings, min/max tokens.

One `StopChecker` per request, host side. Text is detokenized incrementally only for requests
that need it (stop strings or streaming); everyone else is decoded once, at the end.
"""

from __future__ import annotations

from jaxpipe.sampling import SamplingParams
from jaxpipe.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    """Stop conditions and text of one request."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int],
                 params: SamplingParams, eos_ids: frozenset[int]):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none "
                             "(use stop_token_ids)")
        self.params = params
        self.tokenizer = tokenizer
        self._prompt_ids = prompt_ids
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_ids)
        self._detok = self._new_detok() if params.stop else None
        self._fed = 0  # output tokens pushed into the detokenizer
        self._cut: str | None = None  # the text, truncated where a stop string matched
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._emitted = 0  # characters already streamed

    def banned(self, generated: int) -> list[int]:
        """Token ids the sampler must not pick next: stop ids until min_tokens is reached."""
        return sorted(self.stop_ids) if generated < self.params.min_tokens else []

    def check(self, seq, max_model_len: int) -> str | None:
        """Reason the sequence ends after its newest token ("stop" / "length"), or None."""
        n, token = len(seq.output_token_ids), seq.output_token_ids[-1]
        self._feed(seq)
        if n >= self.params.min_tokens:
            if token in self.stop_ids:
                seq.stop_reason = token if token in self.params.stop_token_ids else None
                return "stop"
            if self._match_stop_string(seq):
                return "stop"
        if n >= seq.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    def final_text(self, seq) -> str:
        """The completion's text: decoded output, cut before a matched stop string."""
        if self._cut is not None:
            return self._cut
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, self.params.skip_special_tokens)

    def enable_streaming(self) -> None:
        if self._detok is None and self.tokenizer is not None:
            self._detok = self._new_detok()

    def stream_delta(self, seq) -> str:
        """Text added since the last call. While running, the tail that could still turn out
        to be the start of a stop string is held back."""
        if self._detok is None:
            return ""
        self._feed(seq)
        if seq.is_finished:
            text = self.final_text(seq)
            end = len(text)
        else:
            text = self._detok.text
            end = max(self._emitted, len(text) - self._hold)
        delta = text[self._emitted:end]
        self._emitted = end
        return delta

    def _new_detok(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, self._prompt_ids,
                                      self.params.skip_special_tokens)

    def _feed(self, seq) -> None:
        if self._detok is not None and self._fed < len(seq.output_token_ids):
            self._detok.push(seq.output_token_ids[self._fed:])
            self._fed = len(seq.output_token_ids)

    def _match_stop_string(self, seq) -> bool:
        if not self.params.stop or self._cut is not None:
            return False
        text = self._detok.text
        for stop in self.params.stop:
            # A new match can only start within the last len(stop) + new characters; searching
            # the whole text is cheap enough at these lengths and avoids an off-by-one window.
            idx = text.find(stop)
            if idx >= 0:
                self._cut = text[:idx]
                seq.stop_reason = stop
                return True
        return False
