"""`decode_first`: static batching — fill a batch, then decode it until every sequence ends.

Admission reserves each sequence's whole expected length (prompt + predicted output, else the
maximum), so the batch never outgrows the device store when predictions hold; a sequence that
outlives its prediction may still force a (recompute) preemption.
"""

from __future__ import annotations

from jaxpipe.scheduler.actions import Action, Run, SwapIn
from jaxpipe.scheduler.policy import Policy, preempt_or_decode, swap_in_batch
from jaxpipe.scheduler.state import Phase, SchedulerState


class DecodeFirst(Policy):
    """Admit while the batch is open; once decoding starts, admit nothing until it drains."""

    name = "decode_first"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._closed = False  # True from the batch's first decode step until it drains

    def schedule(self, state: SchedulerState) -> Action | None:
        if not state.device and not state.host:
            self._closed = False
        if not self._closed:
            chunk = self.max_prefill_tokens
            reserved = sum(state.device_kv.peak(s, s.expected_total, chunk)
                           for s in state.device.values())
            batch = self._admit(state, state.device_kv.capacity - reserved,
                                lambda seq: state.device_kv.peak(seq, seq.expected_total, chunk))
            if batch:
                return self._in_phase(state, Phase.PREFILL, Run(prefill=batch))
        elif partial := self._continue_prefills(state):  # admitted before it closed
            return self._in_phase(state, Phase.PREFILL, Run(prefill=partial))
        swap = swap_in_batch(state, self._device_room(state))
        if swap:
            return SwapIn(swap)
        action = preempt_or_decode(state, swap=False)
        if isinstance(action, Run):
            self._closed = True
            return self._in_phase(state, Phase.DECODE, action)
        return action
