"""`prefill_first`: vLLM-like continuous batching on one layout.

Every step prefers new work: swapped-out sequences come back first, then waiting prompts are
prefilled whenever the device KV store has room (less a small watermark and one token of growth
per running sequence); otherwise every running sequence decodes one token. When the running
sequences outgrow the store the newest are preempted (recomputed, or swapped to the host tier).

`chunked=True` (the default) is continuous batching with chunked prefill, as in vLLM V1 and
Sarathi-Serve: each step decodes every running sequence and fills the rest of the
`max_prefill_tokens` budget with prompt chunks (a mixed batch). With two layouts its mixed
steps run on the decode layout (most of their tokens are decode tokens); `chunked=False`
alternates whole-prefill steps (prefill layout) and decode steps (decode layout).
"""

from __future__ import annotations

from jaxpipe.scheduler.actions import Action, Preempt, Run, SwapIn
from jaxpipe.scheduler.policy import Policy, growth_victims, preempt_or_decode, swap_in_batch
from jaxpipe.scheduler.seq_info import SeqInfo
from jaxpipe.scheduler.state import Phase, SchedulerState

PREEMPT_MODES = ("recompute", "swap")


class PrefillFirst(Policy):
    """Eager prefill whenever device KV allows; optional chunked prefill (mixed batches)."""

    name = "prefill_first"

    def __init__(self, chunked: bool = True, preempt_mode: str = "recompute", **kwargs):
        super().__init__(**kwargs)
        if preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_mode {preempt_mode!r}; accepted: {PREEMPT_MODES}")
        self.chunked = chunked
        self.preempt_mode = preempt_mode

    def schedule(self, state: SchedulerState) -> Action | None:
        swap = swap_in_batch(state, self._device_room(state))
        if swap:
            return SwapIn(swap)
        if self.chunked:
            action = self._mixed_step(state)
            return self._in_phase(state, Phase.DECODE, action) if isinstance(action, Run) \
                else action
        batch = self._admit(state, self._device_room(state), lambda seq: state.device_kv.need(
            seq, seq.context_len + 1, self.max_prefill_tokens))
        if batch:
            return self._in_phase(state, Phase.PREFILL, Run(prefill=batch))
        action = preempt_or_decode(state, swap=self.preempt_mode == "swap")
        if isinstance(action, Run):
            return self._in_phase(state, Phase.DECODE, action)
        return action

    def _mixed_step(self, state: SchedulerState) -> Action | None:
        """Decode all running sequences and prefill chunks within the token budget."""
        victims = growth_victims(state)
        if victims:
            host = sum(state.host_kv.size(s.computed) for s in victims)
            fits = self.preempt_mode == "swap" and host <= state.host_kv.free
            return Preempt(victims, "swap" if fits else "recompute")
        idle = state.idle()
        decode = [s for s in idle if not s.in_prefill]
        budget = self.max_prefill_tokens - len(decode)
        free = state.device_kv.free - sum(state.device_kv.growth(s) for s in decode)
        chunks: list[tuple[SeqInfo, int]] = []
        for seq in [s for s in idle if s.in_prefill]:
            budget, free = self._add_chunk(state, chunks, seq, budget, free)
        room = min(free, self._device_room(state))
        slots = state.device_kv.free_slots
        for seq in state.waiting:
            need = state.device_kv.need(seq, seq.context_len + 1, self.max_prefill_tokens)
            if budget <= 0 or slots <= 0 or need > room:
                break  # vLLM admits a prompt only if all of its KV fits (its peak: a window)
            budget, room = self._add_chunk(state, chunks, seq, budget, room)
            slots -= 1
        if chunks or decode:
            return Run(prefill=chunks, decode=decode)
        if state.busy:  # the micro-batches in flight return first
            return None
        if state.device:  # half-prefilled prompts filled the store: restart the newest later
            return Preempt([list(state.device.values())[-1]], "recompute")
        return None

    @staticmethod
    def _add_chunk(state: SchedulerState, chunks: list, seq: SeqInfo, budget: int,
                   room: int) -> tuple[int, int]:
        """Add the longest chunk of `seq` within `budget` tokens whose whole blocks fit
        `room` device tokens; returns what is left of both."""
        kv, unit = state.device_kv, state.device_kv.blocks.unit
        tail = kv.blocks.size(seq.computed) - seq.computed  # what its last block has left
        n = min(seq.to_prefill, budget, tail + max(room, 0) // unit * unit)
        if n <= 0:
            return budget, room
        chunks.append((seq, n))
        return budget - n, room - kv.new_blocks(seq, seq.computed + n) * unit
