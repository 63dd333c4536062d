"""`seesaw`: transition-minimizing scheduling over a host KV tier (the Seesaw paper, §4).

Prefill phase (prefill layout): prefill waiting prompts and stream each one's KV to the host
tier while the tier has room. When it is full, or nothing waits, switch to decode.
Decode phase (decode layout): swap sequences in from the host tier whenever device slots and KV
free up, decode everything on the device, preempt (to the host tier) if the batch outgrows the
store. When the host tier is drained and prompts wait, park the still-running sequences in the
host tier (if it and the next prompt take at most `park_fraction` of the tier; else keep
decoding) and switch back to prefill. Each switch therefore happens only when a tier is full or
empty, so the number of prefill->decode switches is about total prompt KV / host capacity.
"""

from __future__ import annotations

from jaxpipe.scheduler.actions import Action, Preempt, Run, SwapIn, Switch
from jaxpipe.scheduler.policy import Policy, preempt_or_decode, swap_in_batch
from jaxpipe.scheduler.state import Phase, SchedulerState


class Seesaw(Policy):
    """Prefill into the host tier until it is full; decode out of it until it is empty."""

    name = "seesaw"

    def __init__(self, two_layouts: bool = True, park_fraction: float = 0.5, **kwargs):
        """`park_fraction`: the running batch is parked in the host tier (to switch back to
        prefill) only if it and the next prompt take at most this fraction of the tier, so a
        refill is mostly new prompts; 0 never parks (decode drains the device first)."""
        super().__init__(two_layouts=True, **kwargs)  # its phases are layouts by definition
        if not 0.0 <= park_fraction <= 1.0:
            raise ValueError(f"park_fraction must be in [0, 1], got {park_fraction}")
        self.park_fraction = park_fraction
        self._parked = False  # the running batch was just parked in the host tier

    def schedule(self, state: SchedulerState) -> Action | None:
        if state.host_kv.capacity < 1:
            raise ValueError("the seesaw policy needs a host KV tier: host_kv_tokens is 0")
        if state.phase is Phase.PREFILL:
            return self._prefill_phase(state)
        return self._decode_phase(state)

    def _prefill_phase(self, state: SchedulerState) -> Action | None:
        room = min(state.host_kv.free, state.device_kv.free)
        batch = self._admit(state, room, lambda seq: max(
            state.host_kv.size(seq.context_len),
            state.device_kv.need(seq, seq.context_len, self.max_prefill_tokens)))
        if batch:
            return Run(prefill=batch, prefill_to_host=True)
        if state.busy:  # prefills still in the pipeline reach the host tier when they land
            return None
        if state.host or state.device:
            return Switch(Phase.DECODE.value)
        if state.waiting:
            seq = state.waiting[0]
            raise ValueError(f"host KV tier of {state.host_kv.capacity} tokens cannot hold the "
                             f"{seq.to_prefill}-token prompt of {seq.seq_id!r}; enlarge it")
        return None

    def _decode_phase(self, state: SchedulerState) -> Action | None:
        if self._parked or (state.waiting and not state.host and not state.device):
            self._parked = False
            return Switch(Phase.PREFILL.value)
        limit = min(state.host_kv.free, self.park_fraction * state.host_kv.capacity)
        parked = sum(state.host_kv.size(s.computed) for s in state.device.values())
        if state.waiting and not state.host and \
                parked + state.host_kv.size(state.waiting[0].to_prefill) <= limit:
            self._parked = True  # park the running batch (leaving room for a prompt), switch
            return Preempt(list(state.device.values()), "swap")
        swap = swap_in_batch(state, self._device_room(state))
        if swap:
            return SwapIn(swap)
        return preempt_or_decode(state, swap=True)
