"""What happens to a step's tokens on the host, and how sequences end.

    landed, ended = output.process(sampled, out)   # a step's tokens are on the host

Each sampled sequence still running gets its row's token (and logprobs), then its stop checks
(`stopping.py`); the detokenizer worker's stop strings end others, cut back to the token that
completed them (they leave the scheduler state here, as aborts do). A sequence that ends is
*finished*: its finish reason and time set, its KV dropped; the scheduler's loop
(`jaxpipe.scheduler.loop`) finishes the step's own in the state, unless it was *freed* there
at dispatch already (its token in flight was certainly its last), a step before it finishes.
"""

from __future__ import annotations

import time

from jaxpipe.engine.stats import EngineStats
from jaxpipe.engine.structured import Constraints
from jaxpipe.kv.manager import KVManager
from jaxpipe.request.stopping import DetokWorker
from jaxpipe.runtime.runner import StepOutput
from jaxpipe.scheduler import SchedulerState, Sequence


class OutputProcessor:
    """Tokens appended, stops checked, sequences finished and freed, for one engine."""

    def __init__(self, state: SchedulerState, kv: KVManager, detok: DetokWorker,
                 stats: EngineStats, max_model_len: int, end=None):
        """`end(seq_id)`: how a sequence a stop string ended leaves the scheduler state (the
        driver's `Driver.end`: at once, or when its micro-batch in flight leaves)."""
        self.state, self.kv, self.detok, self.stats = state, kv, detok, stats
        self.max_model_len = max_model_len
        self.end = end if end is not None else state.abort

    def process(self, sampled: list[Sequence], out: StepOutput
                ) -> tuple[list[Sequence], set[str]]:
        """A step's results `out` (row i: `sampled[i]`'s token) are on the host: append them,
        check stops, finish what ended (the caller finishes the sampled ones in the
        scheduler state). A sequence that finished or was aborted meanwhile gets no token.
        Returns (the sequences that got a token or were ended by a stop string, the ids of
        those that ended now)."""
        live = [(i, s) for i, s in enumerate(sampled) if not s.is_finished]
        self._append(live, out)
        self.detok.commit()
        ended = {s.request_id for _, s in live if s.is_finished}
        matched = self._stop_string_matches()
        rows = set(sampled)
        return ([s for _, s in live] + [s for s in matched if s not in rows],
                ended | {s.request_id for s in matched})

    def finish(self, seq: Sequence, reason: str | None) -> None:
        """End `seq` (the scheduler state is told by the caller) and drop its KV. A stop
        string the worker found on an earlier token ends it there instead (`settle`)."""
        had = len(seq.output_token_ids)
        reason = seq.stop.settle(seq, reason)
        self.stats.generated(len(seq.output_token_ids) - had)
        self.kv.drop(seq)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.stats.finished(reason)

    def _append(self, rows: list[tuple[int, Sequence]], out: StepOutput) -> None:
        """Append row i's token to its sequence for each (i, seq); logprobs, stop checks."""
        now = time.perf_counter()
        for i, seq in rows:
            if seq.params.max_tokens == 0:  # scored its prompt: it ends with no output
                self.finish(seq, "length")
                continue
            token = int(out.tokens[i])
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                _record_logprobs(seq, out, i, token)
            reason = seq.stop.check(seq, self.max_model_len)
            if seq.grammar is not None:  # its grammar complete: it ends here
                reason = Constraints.advance(seq, token) if reason is None else reason
            if reason is not None:
                self.finish(seq, reason)
        self.stats.generated(sum(seq.params.max_tokens != 0 for _, seq in rows))

    def record_prompt(self, scored: list[tuple[Sequence, int]], out: StepOutput) -> None:
        """Record a step's prompt scores (row i: the prompt token scored[i][1] of
        scored[i][0]) by position: a position scored twice (recomputed) is written again."""
        for i, (seq, t) in enumerate(scored):
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs, seq.prompt_ranks = ([None] * seq.prompt_len,
                                                         [None] * seq.prompt_len)
            token, num = seq.prompt_token_ids[t], seq.params.prompt_logprobs
            entry = {token: float(out.prompt.logprob[i])}
            for tid, lp in zip(out.prompt.top_ids[i][:num], out.prompt.top_logprobs[i][:num],
                               strict=True):
                entry.setdefault(int(tid), float(lp))
            seq.prompt_logprobs[t], seq.prompt_ranks[t] = entry, int(out.prompt.rank[i])

    def _stop_string_matches(self) -> list[Sequence]:
        """End the running requests whose stop string the detokenizer worker found (cut back
        to the token that completed it), wherever the scheduler has them; returns them."""
        ended = [seq for seq in self.detok.drain() if not seq.is_finished]
        for seq in ended:
            self.finish(seq, None)
            self.end(seq.request_id)
        return ended


def _record_logprobs(seq: Sequence, out: StepOutput, i: int, token: int) -> None:
    entry = {token: float(out.logprob[i])}
    n = seq.params.logprobs
    for tid, lp in zip(out.top_ids[i][:n], out.top_logprobs[i][:n], strict=True):
        entry.setdefault(int(tid), float(lp))
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry)
