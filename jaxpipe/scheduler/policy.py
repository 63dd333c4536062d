"""The policy interface, the helpers policies share, and the loop every executor runs.

An executor — the simulated one in `jaxpipe.planner.simulate` or the real engine — drives a
policy like this (`drive` below is exactly this loop):

```python
state = SchedulerState(device_kv_tokens, max_device_seqs, host_kv_tokens)
state.add(SeqInfo(seq_id, prompt_len, max_output_len))       # for every request
policy = make_policy("seesaw")
while state.has_work():
    action = policy.schedule(state)         # Run | Switch | SwapIn | Preempt (reads state only)
    finished_ids = executor.execute(action, state)   # do it; report which sequences ended
    state.apply(action, finished_ids)       # the one place sequences move between queues/tiers
```

The policy only reads the state and returns an action; `SchedulerState.apply` does the
bookkeeping, so a real engine and a simulator cannot disagree about where a sequence is. To move
the engine onto this interface: keep a `SeqInfo` per `Sequence` (same id), call `schedule`
where the engine calls `Scheduler.schedule` today, map `Run.prefill`/`Run.decode` onto the
runner's prefill and decode steps, `Switch` onto re-sharding, `SwapIn`/`Preempt(mode="swap")`
onto the host KV tier, and pass the ids that hit EOS/stop/length to `apply`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable

from jaxpipe.scheduler.actions import Action, Preempt, Run, Switch
from jaxpipe.scheduler.state import Phase, SchedulerState, SeqInfo

DEFAULT_PREFILL_TOKENS = 8192  # prompt tokens in one prefill step (all pipeline micro-batches)
DEFAULT_WATERMARK = 0.01  # fraction of device KV kept free at admission (vLLM's default)


class Policy:
    """Base of every policy: `schedule(state)` returns the next action or None (nothing to do).

    `two_layouts=True` runs prefill and decode on different layouts: the policy emits a
    `Switch` before a step of the other kind. Policies keep no per-sequence state of their own.
    """

    name = "policy"

    def __init__(self, two_layouts: bool = False, max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 watermark: float = DEFAULT_WATERMARK,
                 batch_fits: Callable[[int, int], bool] | None = None,
                 length_bucket: Callable[[int], int] | None = None, window: int = 256):
        """`batch_fits(count, longest)`: whether a prefill batch of `count` prompts, the
        longest `longest` tokens, fits the executor's compiled shapes (None: any does).
        `length_bucket(tokens)`: the padded length a prompt is prefilled at; with it a prefill
        batch is the oldest waiting prompt plus the next ones *of its bucket* among the first
        `window` waiting (FIFO mixing padded 2.1x the real tokens on the ShareGPT-like
        benchmark). The oldest prompt always goes first, so nothing starves."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.two_layouts = two_layouts
        self.max_prefill_tokens = max_prefill_tokens
        self.watermark = watermark
        self.batch_fits = batch_fits
        self.length_bucket = length_bucket
        self.window = window

    def schedule(self, state: SchedulerState) -> Action | None:
        raise NotImplementedError

    def _in_phase(self, state: SchedulerState, phase: Phase, action: Action) -> Action:
        """`action` if the weights are in `phase`'s layout, else the switch to it first."""
        if self.two_layouts and state.phase is not phase:
            return Switch(phase.value)
        return action

    def _admit(self, state: SchedulerState, room: int, reserve: Callable[[SeqInfo], int]
               ) -> list[tuple[SeqInfo, int]]:
        """Waiting sequences (see `_candidates`) whose whole prefill fits the token budget, a
        free device slot and `room` tokens, each charged `reserve(seq)` tokens of room."""
        batch: list[tuple[SeqInfo, int]] = []
        tokens = longest = 0
        slots = state.free_slots
        for seq in self._candidates(state):
            need = reserve(seq)
            over_budget = batch and tokens + seq.to_prefill > self.max_prefill_tokens
            if over_budget or len(batch) >= slots or need > room:
                break
            longest = max(longest, seq.to_prefill)
            if batch and self.batch_fits and not self.batch_fits(len(batch) + 1, longest):
                break
            batch.append((seq, seq.to_prefill))
            tokens += seq.to_prefill
            room -= need
        return batch

    def _candidates(self, state: SchedulerState) -> list[SeqInfo]:
        """Waiting sequences in the order a prefill batch takes them (see __init__)."""
        if self.length_bucket is None or not state.waiting:
            return list(state.waiting)
        head = state.waiting[0]
        bucket = self.length_bucket(head.to_prefill)
        window = itertools.islice(state.waiting, 1, self.window)
        return [head] + [s for s in window if self.length_bucket(s.to_prefill) == bucket]

    def _device_room(self, state: SchedulerState) -> int:
        """Device KV tokens new admissions may take: what is free, less a watermark and the
        next token's growth of every running sequence (an empty store is all room)."""
        if not state.device:
            return state.device_free
        growth = sum(state.growth(s) for s in state.device.values())
        return state.device_free - int(self.watermark * state.device_kv_tokens) - growth


def growth_victims(state: SchedulerState) -> list[SeqInfo]:
    """Newest device sequences to evict so every remaining one can write one more KV token."""
    need = sum(state.growth(s) for s in state.device.values()) - state.device_free
    victims: list[SeqInfo] = []
    for seq in reversed(list(state.device.values())):
        if need <= 0:
            break
        victims.append(seq)
        need -= state.device_size(seq.computed) + state.growth(seq)
    return victims


def swap_in_batch(state: SchedulerState, room: int) -> list[SeqInfo]:
    """Host-tier sequences (FIFO) that fit free device slots and `room` tokens (KV + 1)."""
    batch: list[SeqInfo] = []
    slots = state.free_slots
    for seq in state.host.values():
        need = state.device_size(seq.computed + 1)
        if len(batch) >= slots or need > room:
            break
        batch.append(seq)
        room -= need
    return batch


def preempt_or_decode(state: SchedulerState, swap: bool) -> Action | None:
    """Decode every device sequence, preempting the newest first if the KV cannot grow.

    `swap` evicts to the host tier when it has room, else victims are recomputed later."""
    victims = growth_victims(state)
    if victims:
        fits_host = sum(state.host_size(s.computed) for s in victims) <= state.host_free
        return Preempt(victims, "swap" if swap and fits_host else "recompute")
    if state.device:
        return Run(decode=list(state.device.values()))
    return None


def drive(policy: Policy, state: SchedulerState,
          execute: Callable[[Action, SchedulerState], Iterable[Hashable]],
          max_actions: int = 10_000_000) -> int:
    """Run `policy` until every sequence finished; `execute` performs an action and returns the
    ids that finished in it. Returns the number of actions. Raises if the policy stalls."""
    for count in range(max_actions):
        if not state.has_work():
            return count
        action = policy.schedule(state)
        if action is None:
            raise RuntimeError(f"policy {policy.name!r} returned no action with "
                               f"{len(state.waiting)} waiting, {len(state.device)} on device, "
                               f"{len(state.host)} in the host tier")
        state.apply(action, execute(action, state))
    raise RuntimeError(f"policy {policy.name!r} did not finish within {max_actions} actions")
