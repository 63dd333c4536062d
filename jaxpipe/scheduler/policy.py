"""The policy interface and the helpers policies share.

A policy reads the `SchedulerState` and returns the next action (`Run | Switch | SwapIn |
Preempt`, or None: nothing to do now). The loop that asks it and carries the actions out is
`jaxpipe.scheduler.loop.Driver`, the same for the engine (jaxpipe/engine/executor.py, over its
`Sequence` records, which are `SeqInfo`s) and the simulator (jaxpipe/planner/simulate.py). A
run is applied to the state when it is launched; its finished sequences leave the state when
it lands, and a policy that learns from them gets exactly each run's own in `landed`.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxpipe.scheduler.actions import Action, Preempt, Run, Switch
from jaxpipe.scheduler.seq_info import SeqInfo
from jaxpipe.scheduler.state import Phase, SchedulerState

DEFAULT_PREFILL_TOKENS = 8192  # prompt tokens in one prefill step (all pipeline micro-batches)
DEFAULT_WATERMARK = 0.01  # fraction of device KV kept free at admission (vLLM's default)


class Policy:
    """Base of every policy: `schedule(state)` returns the next action or None (nothing to do).

    `two_layouts=True` runs prefill and decode on different layouts: the policy emits a
    `Switch` before a step of the other kind. Policies keep no per-sequence state of their own.
    """

    name = "policy"
    depth = 1  # micro-batches one schedule call forms per step (pipelined policies: pp)

    def __init__(self, two_layouts: bool = False, max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 watermark: float = DEFAULT_WATERMARK):
        """`max_prefill_tokens`: the step's token budget for prompt chunks (a prompt longer
        than what is left of it is prefilled in chunks over several steps)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.two_layouts = two_layouts
        self.max_prefill_tokens = max_prefill_tokens
        self.watermark = watermark

    def schedule(self, state: SchedulerState) -> Action | None:
        raise NotImplementedError

    def left(self, run: Run, state: SchedulerState) -> None:
        """`run`'s micro-batch left the last stage: its sequences may be scheduled again (the
        engine's flowing pipeline says so before it lands, their tokens still on the device;
        elsewhere just before `landed`). Policies that regroup returning batches override
        this."""

    def landed(self, run: Run, finished: list[SeqInfo], state: SchedulerState) -> None:
        """`run` landed (its tokens are back; it was applied to `state` at launch);
        `finished` are exactly the sequences of `run` that ended when it landed (they have
        left `state`, or leave it when the micro-batch they are already in leaves the last
        stage: `Driver.end`; this is the one place a policy sees them). Policies that learn
        from outcomes override this."""

    def _in_phase(self, state: SchedulerState, phase: Phase, action: Action) -> Action:
        """`action` if the weights are in `phase`'s layout, else the switch to it first."""
        if self.two_layouts and state.phase is not phase:
            return Switch(phase.value)
        return action

    def _admit(self, state: SchedulerState, room: int, reserve: Callable[[SeqInfo], int]
               ) -> list[tuple[SeqInfo, int]]:
        """Prompt chunks for one step within the token budget: first the device sequences
        part-way through a prefill (their reservation is taken from `room`), then waiting
        ones (FIFO) while a device slot is free and their whole prefill's `reserve(seq)` fits
        what is left of `room`. A prompt longer than the budget left gets a chunk of it."""
        batch = self._continue_prefills(state)
        budget = self.max_prefill_tokens - sum(n for _, n in batch)
        room -= sum(reserve(seq) for seq, _ in batch)
        slots = state.device_kv.free_slots
        for seq in state.waiting:
            need = reserve(seq)
            if budget <= 0 or slots <= 0 or need > room:
                break
            batch.append((seq, min(seq.to_prefill, budget)))
            budget -= batch[-1][1]
            room -= need
            slots -= 1
        return batch

    def _continue_prefills(self, state: SchedulerState) -> list[tuple[SeqInfo, int]]:
        """The next chunks of the idle device sequences part-way through a prefill, within
        the token budget (over pipeline stages a prompt's chunks may land apart from the
        rest of its batch)."""
        batch: list[tuple[SeqInfo, int]] = []
        budget = self.max_prefill_tokens
        for seq in state.idle():
            if seq.in_prefill and budget > 0:
                batch.append((seq, min(seq.to_prefill, budget)))
                budget -= batch[-1][1]
        return batch

    def _device_room(self, state: SchedulerState) -> int:
        """Device KV tokens new admissions may take: what is free, less a watermark and the
        next token's growth of every running sequence (an empty store is all room)."""
        kv = state.device_kv
        if not state.device:
            return kv.free
        return kv.free - int(self.watermark * kv.capacity) - next_growth(state)


def next_growth(state: SchedulerState) -> int:
    """Device tokens the device sequences take on at their next decode step."""
    return sum(state.device_kv.growth(s) for s in state.device.values())


def growth_victims(state: SchedulerState) -> list[SeqInfo]:
    """Newest device sequences to evict so every remaining one can write one more KV token."""
    need = next_growth(state) - state.device_kv.free
    victims: list[SeqInfo] = []
    for seq in reversed(list(state.device.values())):
        if need <= 0:
            break
        victims.append(seq)
        need -= state.device_kv.held(seq) + state.device_kv.growth(seq)
    return victims


def prefill_rest(state: SchedulerState, chunk: int) -> int:
    """Device tokens the device sequences still in their prefill take to finish it (and hold
    their first sampled token), `chunk` tokens at a time: kept for them, not free for new
    prompts."""
    kv = state.device_kv
    return sum(min(kv.new_blocks(s, s.context_len + 1) * kv.blocks.unit,
                   kv.need(s, s.context_len + 1, chunk))
               for s in state.device.values() if s.in_prefill)


def swap_in_batch(state: SchedulerState, room: int) -> list[SeqInfo]:
    """Host-tier sequences (FIFO) that fit free device slots and `room` tokens (KV + 1),
    with the samples that fork from them as they come back (`DeviceLedger.comebacks`)."""
    batch: list[SeqInfo] = []
    slots = state.device_kv.free_slots
    for seq in state.host.values():
        need, seats = state.device_kv.resume(seq), state.device_kv.comebacks(seq)
        if seats > slots or need > room:
            break
        batch.append(seq)
        room -= need
        slots -= seats
    return batch


def preempt_or_decode(state: SchedulerState, swap: bool) -> Action | None:
    """Decode every device sequence, preempting the newest first if the KV cannot grow.
    A prompt with one token left (a sample forked from its parent's prompt: its last token,
    for its own logits) rides along as a one-token chunk, a decode's cost; other prompts
    part-way sample no token yet and sit out.

    `swap` evicts to the host tier when it has room, else victims are recomputed later."""
    victims = growth_victims(state)
    if victims:
        fits_host = sum(state.host_kv.size(s.computed) for s in victims) <= state.host_kv.free
        return Preempt(victims, "swap" if swap and fits_host else "recompute")
    idle = state.idle()
    last = [(s, 1) for s in idle if s.in_prefill and s.to_prefill == 1]
    decode = [s for s in idle if not s.in_prefill]
    return Run(prefill=last, decode=decode) if last or decode else None
