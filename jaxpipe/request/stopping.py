"""When a request ends, and its text: EOS, stop token ids, stop strings, min/max tokens; and
the ids a request may not sample next (stop ids before min_tokens, its bad words).

The one home of stop strings and incremental detokenization, for the engine, the server's
front end and batch jobs: `final_text` (a completion's text, cut before its stop string) and
`TextStream` (streamed text deltas that hold back a tail that may still become a stop string).
One `StopChecker` per request, host side, detokenizes incrementally only for requests with stop
strings; the text a caller gets is `outputs.Completion`'s (which uses `final_text` and, when
streaming, `TextStream`).

With a `DetokWorker` (`EngineConfig.detok_worker`, the default) that detokenization and the
stop-string search run on the worker's thread, off the engine loop: token-level stops (EOS,
stop ids, lengths) are decided at once, a stop string when the worker has seen its token. A
request that matched is then cut back to the token that completed the match (the engine
discards what it generated meanwhile), and a request ending for another reason first waits
for the worker to catch up with it, so every outcome is the one the inline check gives.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from jaxpipe.model.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxpipe.request.params import SamplingParams


def final_text(tokenizer: Tokenizer, token_ids: Sequence[int], skip_special_tokens: bool,
               stop_reason: int | str | None, include_stop: bool = False) -> str:
    """A completion's whole text: its ids decoded, cut before the stop string that ended it
    (`stop_reason` as a string), or just after it when `include_stop`
    (`include_stop_str_in_output`)."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens)
    if isinstance(stop_reason, str):
        idx = text.find(stop_reason)
        if idx >= 0:
            return text[:idx + len(stop_reason) if include_stop else idx]
    return text


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as it is written (leading spaces
    stripped) and with one leading space, the latter kept only when it is a different token
    sequence of the same length (a word-start token)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return [ids for ids in out if ids]


class TextStream:
    """The text of one request as it grows: ids in (`feed`), text deltas out (`take`), whose
    concatenation is the final text. While the request runs, the last len(longest stop) - 1
    characters are held back: they may still become the start of a stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool, stop: Sequence[str], include_stop: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.include_stop = include_stop
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._hold = max((len(x) for x in stop), default=1) - 1
        self.ids: list[int] = []
        self._emitted = 0  # characters already taken

    @property
    def text(self) -> str:
        """The text of every id fed so far (uncut)."""
        return self._detok.text

    def feed(self, token_ids: Sequence[int]) -> None:
        self.ids.extend(token_ids)
        self._detok.push(token_ids)

    def take(self, final: str | None = None) -> str:
        """The text not taken yet: up to the held-back tail, or, given the request's `final`
        text (it ended, or its stop string matched), all the rest of that."""
        text, end = (final, len(final)) if final is not None else (
            self.text, max(self._emitted, len(self.text) - self._hold))
        delta = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed the new ids of a running request; the text now safe to send."""
        self.feed(token_ids)
        return self.take()

    def finish(self, token_ids: Sequence[int], stop_reason: int | str | None) -> str:
        """Feed the last ids; the rest of the final text."""
        self.ids.extend(token_ids)
        return self.take(final_text(self.tokenizer, self.ids, self.skip_special_tokens,
                                    stop_reason, self.include_stop))


class DetokWorker:
    """One thread that detokenizes for the requests that need text while they run. The
    engine `add`s a job per new token and `commit`s them once per step, as one batch;
    requests whose stop string matched are queued in `matched`."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpipe-detok")
        self.matched: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: list = []
        self._open: Future = Future()  # done when the batch being collected has run

    def add(self, fn, *args) -> Future:
        """Queue `fn(*args)` in the next batch; the future of that batch."""
        self._jobs.append((fn, args))
        return self._open

    def commit(self) -> None:
        """Send the queued jobs to the thread, as one batch."""
        if not self._jobs:
            return
        jobs, done = self._jobs, self._open
        self._jobs, self._open = [], Future()
        self._pool.submit(_run_batch, jobs, done)

    def wait(self, batch: Future) -> None:
        """Until `batch` (an `add` result) has run (committing it if it is still open)."""
        if batch is self._open:
            self.commit()
        batch.result()

    def drain(self) -> list:
        """The sequences whose stop string matched since the last call."""
        out = []
        while True:
            try:
                out.append(self.matched.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.commit()
        self._pool.shutdown(wait=True)


def _run_batch(jobs: list, done: Future) -> None:
    try:
        for fn, args in jobs:
            fn(*args)
    except BaseException as err:  # surfaced to whoever waits on the batch
        done.set_exception(err)
    else:
        done.set_result(None)


class StopChecker:
    """Stop conditions and text of one request."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int],
                 params: SamplingParams, eos_ids: frozenset[int],
                 worker: DetokWorker | None = None):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none "
                             "(use stop_token_ids)")
        if params.bad_words and tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none "
                             "(use logit_bias with -100)")
        self.params = params
        self.tokenizer = tokenizer
        self._prompt_ids = prompt_ids
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_ids)
        self._text = self._new_text() if params.stop else None
        self._worker = worker
        self._last: Future | None = None  # the worker's newest job for this request
        self.match: int | None = None  # output index whose token completed a stop string
        self._stop_string: str | None = None  # the first stop string found
        words = bad_words_token_ids(tokenizer, params.bad_words) if params.bad_words else []
        self._bad_single = sorted({w[0] for w in words if len(w) == 1})
        self._bad_multi = [w for w in words if len(w) > 1]

    @property
    def needs_history(self) -> bool:
        """Whether `banned` reads the newest output tokens (a bad word of several tokens):
        the request's next step may be built only once its tokens in flight have landed."""
        return bool(self._bad_multi)

    def banned(self, generated: int, output: Sequence[int] = ()) -> list[int]:
        """Token ids the sampler must not pick next: stop ids until min_tokens is reached,
        single-token bad words, and the last token of each multi-token bad word whose other
        tokens end `output` (vLLM's rule; `output` must hold all `generated` tokens then)."""
        ids = set(self._bad_single)
        if generated < self.params.min_tokens:
            ids |= self.stop_ids
        if self._bad_multi:
            if len(output) != generated:
                raise RuntimeError(f"bad words need the {generated} output tokens on the host, "
                                   f"{len(output)} are there")
            ids |= {w[-1] for w in self._bad_multi
                    if len(w) - 1 <= len(output) and list(output[len(output) - len(w) + 1:])
                    == w[:-1]}
        return sorted(ids)

    def check(self, seq, max_model_len: int) -> str | None:
        """Reason the sequence ends after its newest token ("stop" / "length"), or None.
        With a worker, a stop string is found later (`settle`, `DetokWorker.matched`)."""
        n, token = len(seq.output_token_ids), seq.output_token_ids[-1]
        counts = n >= self.params.min_tokens
        if self._worker is not None and self._text is not None:
            self._last = self._worker.add(self._push_one, seq, n - 1, token)
        elif counts and token not in self.stop_ids and self._inline_match(seq):
            return "stop"
        if counts and token in self.stop_ids:  # before a stop string on the same token
            seq.stop_reason = token if token in self.params.stop_token_ids else None
            return "stop"
        if seq.at_length(n, max_model_len):
            return "length"
        return None

    def settle(self, seq, reason: str | None) -> str | None:
        """Wait for the worker's view of `seq`; if a stop string matched on an earlier token
        than the one `reason` ends it on (or on the same one, for a length stop), cut the
        outputs back to that token and return "stop". Returns the reason it ends with."""
        self.wait()
        k = self.match
        if k is None or k >= len(seq.output_token_ids):
            return reason
        last = len(seq.output_token_ids) - 1
        if k == last and reason == "stop" and seq.output_token_ids[k] in self.stop_ids:
            return reason  # the stop id on the same token wins, as inline
        if reason == "abort" and k == last:
            return reason
        del seq.output_token_ids[k + 1:]
        if seq.logprobs is not None:
            del seq.logprobs[k + 1:]
        seq.stop_reason = self._stop_string
        return "stop"

    def settled(self, seq) -> bool:
        """Whether every output token of `seq` is final: the worker has seen them all and
        found no stop string that the engine has yet to end the request at (its next step
        does, cutting the outputs back to the match)."""
        self.wait()
        return seq.is_finished or self.match is None

    def wait(self) -> None:
        """Until the worker has handled every token submitted for this request."""
        if self._last is not None:
            self._worker.wait(self._last)

    def _new_text(self) -> TextStream:
        return TextStream(self.tokenizer, self._prompt_ids, self.params.skip_special_tokens,
                          self.params.stop)

    def _feed(self, seq) -> None:
        fed = len(self._text.ids)
        if fed < len(seq.output_token_ids):
            self._text.feed(seq.output_token_ids[fed:])

    def _inline_match(self, seq) -> bool:
        """Feed the new tokens and look for a stop string (on the engine's thread)."""
        if self._text is None:  # no stop strings
            return False
        self._feed(seq)
        if self._find() is None:
            return False
        seq.stop_reason = self._stop_string
        return True

    def _push_one(self, seq, index: int, token: int) -> None:
        """The worker's job: output `index` is `token`; a first stop-string match is recorded
        and `seq` queued in the worker's `matched`."""
        self._text.feed([token])
        if self.match is None and index + 1 >= self.params.min_tokens and \
                self._find() is not None:
            self.match = index
            self._worker.matched.put(seq)

    def _find(self) -> str | None:
        """The first stop string in the text so far (kept in `_stop_string`)."""
        if not self.params.stop:
            return None
        if self._stop_string is not None:
            return self._stop_string
        text = self._text.text
        for stop in self.params.stop:
            # A new match can only start within the last len(stop) + new characters; searching
            # the whole text is cheap enough at these lengths and avoids an off-by-one window.
            if stop in text:
                self._stop_string = stop
                return stop
        return None
