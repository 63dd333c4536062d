"""Detokenization in the front end: a request's generated ids -> its text, as `Engine` gives it.

The engine process sends only token ids and why a request stopped; the text is made here, off
the device loop. A matched stop string (the engine's `stop_reason`) is cut from the text, and
while a request streams, the tail that could still become a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpipe.tokenizer import IncrementalDetokenizer, Tokenizer


def final_text(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool,
               stop_reason: int | str | None) -> str:
    """The completion's whole text: decoded ids, cut before a matched stop string."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens)
    if isinstance(stop_reason, str):
        idx = text.find(stop_reason)
        if idx >= 0:
            return text[:idx]
    return text


class TextStream:
    """Text deltas of one streaming request; their concatenation equals `final_text`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool, stop: Sequence[str]):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0  # characters already sent

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new ids of a running request; return the text that is now safe to send."""
        self._ids.extend(token_ids)
        self._detok.push(token_ids)
        text = self._detok.text
        end = max(self._emitted, len(text) - self._hold)
        delta = text[self._emitted:end]
        self._emitted = end
        return delta

    def finish(self, token_ids: Sequence[int], stop_reason: int | str | None) -> str:
        """Add the last ids; return the rest of the final text."""
        self._ids.extend(token_ids)
        text = final_text(self._tokenizer, self._ids, self._skip, stop_reason)
        delta = text[self._emitted:]
        self._emitted = max(self._emitted, len(text))
        return delta
