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
    finished = state.apply(action, finished_ids)     # the one place sequences move
    if isinstance(action, Run):
        policy.landed(action, finished, state)       # for policies that learn from outcomes
```

The policy only reads the state and returns an action; `SchedulerState.apply` does the
bookkeeping, so a real engine and a simulator cannot disagree about where a sequence is.
Finished sequences leave the state; a policy that learns from them gets them in `landed`.
The engine's executor (`jaxpipe/executor.py`) drives the same policies over its `Sequence`
records, which are `SeqInfo`s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

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

    def landed(self, run: Run, finished: list[SeqInfo], state: SchedulerState) -> None:
        """`run` was applied to `state` (its micro-batch returned); `finished` are exactly
        the sequences of `run` that ended when it landed (they have left `state`: this is
        the one place a policy sees them). Policies that learn from outcomes or regroup
        returning batches override this."""

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
        batch: list[tuple[SeqInfo, int]] = []
        budget = self.max_prefill_tokens
        for seq in state.idle():
            if seq.in_prefill and budget > 0:
                batch.append((seq, min(seq.to_prefill, budget)))
                budget -= batch[-1][1]
                room -= reserve(seq)
        slots = state.free_slots
        for seq in state.waiting:
            need = reserve(seq)
            if budget <= 0 or slots <= 0 or need > room:
                break
            batch.append((seq, min(seq.to_prefill, budget)))
            budget -= batch[-1][1]
            room -= need
            slots -= 1
        return batch

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
    idle = state.idle()
    return Run(decode=idle) if idle else None


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
            raise _stalled(policy, state)
        finished = state.apply(action, dict.fromkeys(execute(action, state)))
        if isinstance(action, Run):
            policy.landed(action, finished, state)
    raise RuntimeError(f"policy {policy.name!r} did not finish within {max_actions} actions")


class PipelineExecutor(Protocol):
    """What `drive_pipelined` needs of an executor."""

    def launch(self, run: Run, state: SchedulerState) -> object:
        """Start `run`'s micro-batch; returns a handle for `land`."""

    def land(self, run: Run, handle: object, state: SchedulerState) -> Iterable[Hashable]:
        """Wait for `run`'s micro-batch to leave the last stage; the ids that finished."""

    def execute(self, action: Action, state: SchedulerState) -> Iterable[Hashable]:
        """Do a Switch / SwapIn / Preempt (nothing is in flight then)."""


def drive_pipelined(policy: Policy, state: SchedulerState, executor: PipelineExecutor,
                    depth: int, max_actions: int = 10_000_000) -> int:
    """`drive` with up to `depth` micro-batches in flight (host-driven pipeline ticks, as in
    TD-Pipe and gLLM): while fewer are in flight the policy forms the next micro-batch from
    the idle sequences (`state.launch`); when the pipeline is full, or the policy has nothing
    to start, or asks for anything but a `Run` (done only once the pipeline is drained), the
    oldest micro-batch lands and is applied. Returns the number of actions."""
    if depth < 1:
        raise ValueError(f"pipeline depth must be >= 1, got {depth}")
    in_flight: deque[tuple[Run, object]] = deque()
    for count in range(max_actions):
        if not state.has_work():
            return count
        action = policy.schedule(state) if len(in_flight) < depth else None
        if isinstance(action, Run):
            state.launch(action)
            in_flight.append((action, executor.launch(action, state)))
        elif in_flight:
            run, handle = in_flight.popleft()
            finished = state.apply(run, dict.fromkeys(executor.land(run, handle, state)))
            policy.landed(run, finished, state)
        elif action is None:
            raise _stalled(policy, state)
        else:
            state.apply(action, executor.execute(action, state))
    raise RuntimeError(f"policy {policy.name!r} did not finish within {max_actions} actions")


def launch_step(policy: Policy, state: SchedulerState, max_tokens: int
                ) -> tuple[list[Run], Action | None]:
    """One engine step of a pipelined policy: up to `policy.depth` micro-batches, formed and
    launched (`state.launch`) one after another, to run as one step of at most `max_tokens`
    tokens. Stops at the first action that is not a `Run`, or at a micro-batch that would take
    the step past `max_tokens` (left unlaunched: the policy forms it again next step).
    Returns (the launched runs, the last action the policy returned)."""
    runs: list[Run] = []
    action = None
    while len(runs) < policy.depth:
        action = policy.schedule(state)
        if not isinstance(action, Run):
            break
        if runs and sum(r.prefill_tokens + len(r.decode) for r in runs + [action]) > max_tokens:
            break
        state.launch(action)
        runs.append(action)
    return runs, action


def _stalled(policy: Policy, state: SchedulerState) -> RuntimeError:
    return RuntimeError(f"policy {policy.name!r} returned no action with "
                        f"{len(state.waiting)} waiting, {len(state.device)} on device, "
                        f"{len(state.host)} in the host tier")
