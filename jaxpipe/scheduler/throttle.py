"""`throttle`: gLLM's token throttling (Guo et al., "gLLM", §3.1-3.2) for pipelined micro-batches.

Every micro-batch mixes prompt chunks and decode tokens, and throttles both so that the pp
micro-batches in flight carry even loads:

    #P = max(min(#WP / #T, #MaxP * (KV_free - KV_thresh) / (1 - KV_thresh)), #MinP)   (eq. 3)
    #D = #RD / pp                                                                     (eq. 4)

#WP is the prompt tokens still to prefill, #T the iterations over which to spread them, KV_free
the idle fraction of the device KV store, #RD the sequences in their decode phase (running,
whether in flight or not). Prefill is suspended while KV_free < KV_thresh, leaving headroom for
the running sequences to grow. Defaults are the paper's (§4.1): #T = 8, #MaxP = 2048,
#MinP = 32, KV_thresh = 0.05. Each `schedule` call forms one micro-batch from the idle
sequences (`SchedulerState.idle`); the pipelined simulator keeps up to pp of them in flight,
the engine runs pp of them as one step (`jaxpipe.scheduler.loop`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpipe.scheduler.actions import Action, Preempt, Run
from jaxpipe.scheduler.policy import Policy, growth_victims, next_growth, prefill_rest
from jaxpipe.scheduler.prefill_first import PrefillFirst
from jaxpipe.scheduler.seq_info import SeqInfo
from jaxpipe.scheduler.state import Phase, SchedulerState


@dataclass(frozen=True)
class ThrottleKnobs:
    """gLLM's hyperparameters (paper §4.1 defaults)."""

    iterations: int = 8  # #T
    max_prefill: int = 2048  # #MaxP
    min_prefill: int = 32  # #MinP
    kv_thresh: float = 0.05  # KV_thresh
    by_kv: bool = True  # False: eq. 1, no KV-utilisation term (the paper's "w/o UT" ablation)

    def __post_init__(self):
        if self.iterations < 1 or self.min_prefill < 0 or self.max_prefill < self.min_prefill:
            raise ValueError(f"throttle knobs need iterations >= 1 (got {self.iterations}) and "
                             f"0 <= min_prefill ({self.min_prefill}) <= max_prefill "
                             f"({self.max_prefill})")
        if not 0.0 <= self.kv_thresh < 1.0:
            raise ValueError(f"kv_thresh must be in [0, 1), got {self.kv_thresh}")


def prefill_budget(waiting_tokens: int, kv_free: float, knobs: ThrottleKnobs) -> int:
    """#P (eq. 3; eq. 1 without `by_kv`): prompt tokens for the next micro-batch; 0 below the
    KV threshold or with nothing to prefill, and never more than what waits."""
    if waiting_tokens <= 0 or (knobs.by_kv and kv_free < knobs.kv_thresh):
        return 0
    if knobs.by_kv:
        by_kv = knobs.max_prefill * (kv_free - knobs.kv_thresh) / (1 - knobs.kv_thresh)
        p = max(min(waiting_tokens / knobs.iterations, by_kv), knobs.min_prefill)
    else:
        p = min(max(waiting_tokens / knobs.iterations, knobs.min_prefill), knobs.max_prefill)
    return min(math.ceil(p), waiting_tokens)


def decode_budget(running: int, depth: int) -> int:
    """#D (eq. 4): decode tokens per micro-batch, the running ones spread over pp batches."""
    return math.ceil(running / depth) if running else 0


class Throttle(Policy):
    """One throttled mixed micro-batch per call: #D decode tokens, then #P prompt tokens, #P
    capped so that the micro-batch keeps within `max_prefill_tokens` (the engine's step budget
    over pp: #MaxP alone let one micro-batch outgrow the step it runs in).

    A waiting prompt is admitted only if all of its KV fits what the device sequences leave
    (vLLM's rule, as `prefill_first`'s): the rest of every part-way prompt's KV and the next
    token of every device sequence are kept for them. So KV_free counts the part-way prompts'
    KV as taken, and the KV threshold suspends admissions only: a part-way prompt goes on
    at #MinP tokens or more (stopping it frees nothing; with nothing decoding it held its
    blocks for ever, and the newest was preempted and admitted again in a loop)."""

    name = "throttle"

    def __init__(self, pipeline_depth: int = 1, knobs: ThrottleKnobs | None = None, **kwargs):
        """`pipeline_depth`: micro-batches in flight at most (the layout's pp)."""
        super().__init__(**kwargs)
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        self.depth = pipeline_depth
        self.knobs = knobs or ThrottleKnobs()

    def budgets(self, state: SchedulerState) -> tuple[int, int]:
        """(#P, #D) for the next micro-batch in `state`."""
        idle = state.idle()
        waiting = sum(s.to_prefill for s in state.waiting)
        waiting += sum(s.to_prefill for s in idle if s.in_prefill)
        running = sum(not s.in_prefill for s in state.device.values())
        kv_free = (state.device_kv.free - prefill_rest(state, self.max_prefill_tokens)
                   ) / state.device_kv.capacity
        return prefill_budget(waiting, kv_free, self.knobs), decode_budget(running, self.depth)

    def schedule(self, state: SchedulerState) -> Action | None:
        victims = growth_victims(state)
        if victims:
            return Preempt(victims, "recompute")
        p, d = self.budgets(state)
        idle = state.idle()
        decode = [s for s in idle if not s.in_prefill][:d]
        cap = self.max_prefill_tokens - len(decode)  # the micro-batch's token budget
        chunks = self._chunks(state, idle, decode, min(p, cap),
                              min(max(p, self.knobs.min_prefill, 1), cap))
        if chunks or decode:
            return self._in_phase(state, Phase.DECODE, Run(prefill=chunks, decode=decode))
        if state.busy or not state.device:
            return None  # wait for the micro-batches in flight (or for nothing: done)
        return Preempt([list(state.device.values())[-1]], "recompute")

    def _chunks(self, state: SchedulerState, idle: list[SeqInfo], decode: list[SeqInfo],
                budget: int, partway_budget: int) -> list[tuple[SeqInfo, int]]:
        """Prompt chunks: part-way prompts first, within `partway_budget` tokens (never
        suspended), then waiting ones (FIFO) within what is left of `budget` (#P) while
        device slots are free and all of each one's KV fits what the device sequences leave
        (`prefill_rest`, and the next token of each)."""
        chunks: list[tuple[SeqInfo, int]] = []
        kv, most = state.device_kv, self.max_prefill_tokens
        room = kv.free - sum(kv.growth(s) for s in decode)
        for seq in [s for s in idle if s.in_prefill]:
            partway_budget, room = PrefillFirst._add_chunk(state, chunks, seq, partway_budget,
                                                           room)
        budget -= sum(n for _, n in chunks)
        room = kv.free - prefill_rest(state, most) - next_growth(state)
        slots = kv.free_slots
        for seq in state.waiting:
            need = kv.need(seq, seq.context_len + 1, most)
            if budget <= 0 or slots <= 0 or need > room:
                break
            budget, _ = PrefillFirst._add_chunk(state, chunks, seq, budget, room)
            room -= need
            slots -= 1
        return chunks

