"""`tdpipe`: TD-Pipe's temporally disaggregated pipeline (Zhang et al., "TD-Pipe", §3.3-3.5).

One pp-heavy layout alternates long phases. Each `schedule` call forms one micro-batch from
the idle sequences; the pipelined simulator keeps up to pp of them in flight, the engine runs
pp of them as one step (`jaxpipe.scheduler.loop`).

- **Prefill phase**: micro-batches of whole waiting prompts (up to `max_prefill_tokens` each).
  *AI-based greedy prefill* (Algorithm 1): every running sequence and every prompt admitted so
  far adds `context + p` tokens of KV at each future decode step p in `future_points` (the
  paper's 32, 64, ..., 1024, plus 1-16) while p <= its predicted output length; a prompt is
  admitted only while the largest of those future usages stays within the device KV store, so
  prefill runs ahead of decode as far as the predicted completions allow. The phase ends when the
  next prompt would not fit (or none waits). Ablation: `predictor=None` stops at a fixed KV
  occupancy ratio instead (§4.4.1).
- **Decode phase**: the decodable sequences go out as pp batches. *Inter-batch work stealing*:
  when a batch returns, its finished sequences leave; the target size is the average batch:
  the sliding window of the last pp batches' sizes less the ones that finished, plus the
  withheld ones, over pp (= the live decode sequences over pp, rounded up); a batch above it
  leaves its excess withheld, a batch below it is topped up from the withheld ones. The
  paper's window counts only submitted batches; counted that way the withheld ones are never
  in the average and batches shrink while they pile up, so we count them.
- **Decode -> prefill** (*spatial-temporal intensity*, §3.5): with prompts waiting, switch when
  spatial intensity, achieved/peak decode throughput at the current batch size, falls below
  temporal intensity, 1 - bubble/total of the next cycle (bubble: the longest pending prefill
  micro-batch minus the current decode micro-batch; total: the pending prefills, one decode
  step per batch and the bubble). Times come from a `PhaseTiming` (the cost model in the
  simulator, a table measured once per model and layout on the engine). Ablation:
  `finish_ratio` switches once that fraction of the phase's requests finished (§4.4.3).

Running sequences that outgrow the KV store (a prediction too short) are preempted and
recomputed, as in the paper's setup.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from jaxpipe.scheduler.actions import Action, Preempt, Run
from jaxpipe.scheduler.policy import Policy, growth_victims, next_growth, prefill_rest
from jaxpipe.scheduler.predictor import make_predictor
from jaxpipe.scheduler.seq_info import SeqInfo
from jaxpipe.scheduler.state import SchedulerState

# Decision points (decode steps ahead): the paper's 32, 64, ..., 1024, and 1, 2, 4, 8, 16 before
# them: usage peaks early (every sequence grows, few finish), and a sequence finishing within 32
# steps is counted at no paper point although it holds its KV until then.
FUTURE_POINTS = (1, 2, 4, 8, 16) + tuple(range(32, 1025, 32))
DEFAULT_OCCUPANCY = 0.9  # prefill-stop KV ratio without a predictor (ablation)
KEEP_PREDICTIONS = 100_000  # (prediction, actual) pairs kept for the error metric


class PhaseTiming(Protocol):
    """Step times of one micro-batch (seconds) on the policy's layout."""

    peak_batch: int  # a decode batch large enough to be at peak efficiency

    def decode_seconds(self, batch: int) -> float:
        """One decode micro-batch of `batch` sequences."""

    def prefill_seconds(self, tokens: int) -> float:
        """One prefill micro-batch of `tokens` prompt tokens."""


def future_usage(state: SchedulerState, seqs: Sequence[tuple[SeqInfo, int]],
                 points: Sequence[int]) -> list[int]:
    """Algorithm 1's UpdateUsage over `seqs` = [(seq, predicted output length)]: device KV
    tokens at each future decode step p, each sequence holding context + p while p <= the
    tokens it is predicted still to generate."""
    usage = [0] * len(points)
    for seq, predicted in seqs:
        add_usage(state, usage, seq, predicted, points)
    return usage


def add_usage(state: SchedulerState, usage: list[int], seq: SeqInfo, predicted: int,
              points: Sequence[int]) -> None:
    left = predicted - seq.generated
    for i, p in enumerate(points):
        if p > left:
            break
        usage[i] += state.device_kv.peak(seq, seq.context_len + p)


class TDPipe(Policy):
    """Temporally disaggregated prefill and decode phases over pp micro-batches."""

    name = "tdpipe"

    def __init__(self, pipeline_depth: int = 1, predictor="learned",
                 occupancy: float = DEFAULT_OCCUPANCY, work_stealing: bool = True,
                 finish_ratio: float | None = None, timing: PhaseTiming | None = None,
                 future_points: Sequence[int] = FUTURE_POINTS, **kwargs):
        """`predictor`: "learned" | "oracle" | an object with predict/observe | None (stop
        prefill at `occupancy` of the KV store). `finish_ratio`: None switches back to
        prefill by intensity comparison (needs `timing`), else once this fraction of the
        decode phase's requests finished."""
        super().__init__(**kwargs)
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        if not 0.0 < occupancy <= 1.0:
            raise ValueError(f"occupancy must be in (0, 1], got {occupancy}")
        if finish_ratio is None and timing is None:
            raise ValueError("tdpipe's intensity switch needs a PhaseTiming (timing=...); "
                             "or give finish_ratio for the fixed-ratio switch")
        if finish_ratio is not None and not 0.0 < finish_ratio <= 1.0:
            raise ValueError(f"finish_ratio must be in (0, 1], got {finish_ratio}")
        self.depth = pipeline_depth
        self.predictor = make_predictor(predictor) if isinstance(predictor, str) else predictor
        self.occupancy, self.work_stealing = occupancy, work_stealing
        self.finish_ratio, self.timing = finish_ratio, timing
        self.points = tuple(future_points)
        self.phase = "prefill"
        self.switches = 0  # phase changes, both ways
        # (first prediction, actual) of the newest finished sequences (TD-Pipe's Fig. 14)
        self.predictions: deque[tuple[int, int]] = deque(maxlen=KEEP_PREDICTIONS)
        self._returned: deque[list[SeqInfo]] = deque()  # returned batches' survivors
        self._phase_start = 0  # decode requests when the decode phase began
        self._phase_done = 0  # of them, finished since

    # ---- the two phases -----------------------------------------------------------------------
    def schedule(self, state: SchedulerState) -> Action | None:
        if self.phase == "prefill":
            run, over = self._prefill(state)
            if not over:
                return run
            self._enter("decode", state)
        elif self._should_prefill(state):
            self._enter("prefill", state)
            return self.schedule(state)
        victims = growth_victims(state)  # decoding outgrew the store (a prediction too short)
        if victims:
            return Preempt(victims, "recompute")
        return self._decode(state)

    def _enter(self, phase: str, state: SchedulerState) -> None:
        self.phase, self.switches = phase, self.switches + 1
        self._returned.clear()
        self._phase_start = sum(not s.in_prefill for s in state.device.values())
        self._phase_done = 0

    def _prefill(self, state: SchedulerState) -> tuple[Run | None, bool]:
        """(the next prefill micro-batch, whether the phase is over). A prompt part-way
        through its prefill (on the device, idle: whoever cut its chunk, this policy or the
        prefix cache's admission) goes on first, alone; else whole waiting prompts, a prompt
        longer than the budget in chunks. The rest of every part-way prompt's KV is kept
        free for it (`prefill_rest`), so its next chunk always fits."""
        partway = [s for s in state.idle() if s.in_prefill]
        if partway:
            return self._chunk(partway[0], self.max_prefill_tokens), False
        usage = self._usage(state)
        budget, slots = self.max_prefill_tokens, state.device_kv.free_slots
        room = state.device_kv.free - prefill_rest(state, budget)
        chunks: list[tuple[SeqInfo, int]] = []
        for seq in state.waiting:
            need = state.device_kv.need(seq, seq.context_len + 1, self.max_prefill_tokens)
            if (slots <= 0 or need > room or (chunks and seq.to_prefill > budget)
                    or not self._fits(state, seq, room, usage)):
                break
            if seq.to_prefill > budget:  # a long prompt: alone, in chunks
                return self._chunk(seq, budget), False
            chunks.append((seq, seq.to_prefill))
            budget, room, slots = budget - seq.to_prefill, room - need, slots - 1
        return (Run(prefill=chunks), False) if chunks else (None, True)

    @staticmethod
    def _chunk(seq: SeqInfo, budget: int) -> Run:
        return Run(prefill=[(seq, min(seq.to_prefill, budget))])

    def _usage(self, state: SchedulerState) -> list[int] | None:
        """Algorithm 1's kvUsage of the device sequences (running ones, and the prompts
        admitted so far this phase), read afresh from the state: a sequence that finished
        since counts no more (None without a predictor)."""
        if self.predictor is None:
            return None
        return future_usage(state, [(s, self._predict(s)) for s in state.device.values()],
                            self.points)

    def _fits(self, state: SchedulerState, seq: SeqInfo, room: int,
              usage: list[int] | None) -> bool:
        """Algorithm 1's check for one more prompt (adding it to `usage` if so), or the
        occupancy ratio without a predictor; `room`: what the micro-batch leaves new prompts
        so far. The ratio counts every block held, kept or charged, and the next
        decode step's growth of every device sequence (else a prompt admitted into the
        growth's room is preempted at once and admitted again: a livelock). A prompt is
        admitted whatever the ratio says into a store that holds nothing: alone it can only
        wait for itself."""
        kv = state.device_kv
        if usage is None:
            used = kv.num_blocks * kv.blocks.unit - room + next_growth(state)  # whole blocks
            need = kv.need(seq, seq.context_len + 1, self.max_prefill_tokens)
            return used == 0 or used + need <= self.occupancy * kv.capacity
        grown = list(usage)
        add_usage(state, grown, seq, self._predict(seq), self.points)
        if max(grown, default=0) > kv.capacity:
            return False
        usage[:] = grown
        return True

    def _predict(self, seq: SeqInfo) -> int:
        """The predictor's length, made once per sequence; one that outlived it is taken to
        go on as long again (else it would count for nothing in Algorithm 1 and be admitted
        straight back after each preemption)."""
        if seq.predicted_output_len is None:
            seq.predicted_output_len = self.predictor.predict(seq)
            seq.first_prediction = seq.predicted_output_len
        if seq.generated >= seq.predicted_output_len:
            seq.predicted_output_len = min(2 * seq.generated, seq.max_output_len)
        return seq.predicted_output_len

    def _decode(self, state: SchedulerState) -> Run | None:
        """The next decode micro-batch: the oldest returned batch rebalanced (an emptied one
        is skipped), or a new one from the withheld sequences."""
        live = [s for s in state.device.values() if not s.in_prefill]
        target = max(1, math.ceil(len(live) / self.depth))
        while True:
            sent = {s.seq_id for batch in self._returned for s in batch} | state.busy
            pool = [s for s in state.idle() if not s.in_prefill and s.seq_id not in sent]
            if not self._returned:
                return Run(decode=pool[:target]) if pool else None
            batch = self._returned.popleft()
            batch = [s for s in batch if s.seq_id in state.device]
            if self.work_stealing:
                batch = batch[:target] + pool[:max(0, target - len(batch))]
            else:
                batch = batch + pool
            if batch:
                return Run(decode=batch)

    def left(self, run: Run, state: SchedulerState) -> None:
        """In the decode phase the batch returns for work stealing as it leaves the last
        stage (its sequences that end meanwhile are dropped when it is taken, `_decode`)."""
        if run.decode and self.phase == "decode":
            self._returned.append([s for s in run.decode if s.seq_id in state.device])

    def landed(self, run: Run, finished: list[SeqInfo], state: SchedulerState) -> None:
        """The predictor learns from `run`'s finished sequences."""
        if self.predictor is not None:
            for seq in finished:
                if seq.first_prediction is not None:
                    self.predictions.append((seq.first_prediction, seq.generated))
                self.predictor.observe(seq)
        if run.decode and self.phase == "decode":
            self._phase_done += len(finished)

    # ---- decode -> prefill ----------------------------------------------------------------
    def _should_prefill(self, state: SchedulerState) -> bool:
        if not state.waiting and not any(s.in_prefill for s in state.device.values()):
            return False
        live = [s for s in state.device.values() if not s.in_prefill]
        if not live:
            return True
        if self.finish_ratio is not None:
            return self._phase_done >= self.finish_ratio * max(self._phase_start, 1)
        return self.spatial_intensity(len(live)) < self.temporal_intensity(state, len(live))

    def spatial_intensity(self, live: int) -> float:
        """Achieved / peak decode throughput (sequences per second) at live/pp per batch."""
        t = self.timing
        batch = max(1, math.ceil(live / self.depth))
        achieved = batch / t.decode_seconds(batch)
        return achieved / (t.peak_batch / t.decode_seconds(t.peak_batch))

    def temporal_intensity(self, state: SchedulerState, live: int) -> float:
        """1 - bubble / total of switching now (§3.5): the pending prefills are the waiting
        prompts in micro-batches of `max_prefill_tokens`, as many as the free KV holds."""
        t = self.timing
        batches, tokens, room = [], 0, state.device_kv.free
        for seq in state.waiting:
            need = state.device_kv.peak(seq, seq.prompt_len + 1, self.max_prefill_tokens)
            if need > room:
                break
            room -= need
            if tokens and tokens + seq.prompt_len > self.max_prefill_tokens:
                batches.append(tokens)
                tokens = 0
            tokens += seq.prompt_len
        batches += [tokens] if tokens else []
        if not batches:
            return 0.0  # nothing would fit: switching gains nothing
        decode = t.decode_seconds(max(1, math.ceil(live / self.depth)))
        prefills = [t.prefill_seconds(n) for n in batches]
        bubble = max(0.0, max(prefills) - decode)
        total = sum(prefills) + self.depth * decode + bubble
        return 1.0 - bubble / total
