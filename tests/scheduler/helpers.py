"""Pure-Python executors for policy tests, driven by the scheduler's one loop (`Driver`):
every sequence wants exactly its `max_output_len` tokens unless a test says otherwise."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from jaxpipe.scheduler import Driver, Kind, Policy, SchedulerState, SeqInfo, StepExecutor
from jaxpipe.scheduler.prefix_cache import FREED


@dataclass
class Trace:
    """What happened, recorded by `run_policy`."""

    actions: list[str] = field(default_factory=list)
    switches: list[str] = field(default_factory=list)
    preempted: int = 0
    swapped_in: int = 0
    max_host_used: int = 0
    max_device_used: int = 0
    finished: list = field(default_factory=list)
    max_in_flight: int = 0
    launched: list = field(default_factory=list)  # (decode ids, prefill ids) per micro-batch


class LinearTiming:
    """decode: 1 + 0.01 b seconds per micro-batch of b; prefill: 0.01 s per token."""

    peak_batch = 256

    def decode_seconds(self, batch):
        return 1.0 + 0.01 * batch

    def prefill_seconds(self, tokens):
        return 0.01 * tokens


def make_seqs(n: int, seed: int, prompt=(4, 60), output=(1, 40)) -> list[SeqInfo]:
    rng = random.Random(seed)
    return [SeqInfo(i, rng.randint(*prompt), rng.randint(*output)) for i in range(n)]


class TraceExecutor(StepExecutor):
    """Records what the driver asks of it in a `Trace`; a run ends the sequences whose last
    token it samples, or those `finishes(run, state)` names (called at launch). With
    `depth` > 1, up to `depth` micro-batches are in flight with host-driven ticks."""

    def __init__(self, trace: Trace, depth: int = 1, finishes=None):
        self.trace, self.finishes = trace, finishes
        self.in_flight, self.chained, self.flow_depth = depth - 1, depth == 1, depth
        self.flying: list = []

    def launch(self, runs, state):
        (run,) = runs
        assert not any(s.in_prefill for s in run.decode), "a decode before its first token"
        trace = self.trace
        trace.actions.append(run.kind.value)
        self.flying.append(run)
        trace.max_in_flight = max(trace.max_in_flight, len(self.flying))
        trace.max_device_used = max(trace.max_device_used, state.device_kv.used)
        trace.launched.append(([s.seq_id for s in run.decode],
                               [s.seq_id for s, _ in run.prefill]))
        if self.finishes is not None:
            return run, list(self.finishes(run, state))
        return run, [s.seq_id for s in run.sampling() if s.generated + 1 >= s.max_output_len]

    def land(self, handle, state):
        run, ended = handle
        self.flying.remove(run)
        self.trace.finished += ended
        return ended

    def execute(self, action, state):
        assert not self.flying, "a non-run action while micro-batches are in flight"
        trace = self.trace
        trace.actions.append(action.kind.value)
        if action.kind is Kind.SWITCH:
            trace.switches.append(action.phase)
        elif action.kind is Kind.PREEMPT:
            trace.preempted += len(action.seqs)
        elif action.kind is Kind.SWAP_IN:
            trace.swapped_in += len(action.seqs)


def check_ledger(state: SchedulerState, trace: Trace) -> None:
    """Peaks into `trace`, and the ledger's invariants: each device sequence has an entry
    per block of its KV rounded up to whole blocks, no more, and holds them from the one its
    next query's window starts in (the entries before are FREED; with a window, at most
    ceil(window / block) + 1 blocks); the blocks are distinct: held by one sequence each, or
    free; likewise slots, one per device sequence within max_device_seqs."""
    trace.max_host_used = max(trace.max_host_used, state.host_kv.used)
    trace.max_device_used = max(trace.max_device_used, state.device_kv.used)
    assert state.device_kv.used == sum(state.device_kv.held(s) for s in state.device.values())
    held = [b for s in state.device.values() for b in s.blocks if b != FREED]
    unit = state.device_kv.blocks.unit
    for s in state.device.values():  # (a piece launched, not yet applied, holds more)
        held_tokens, need = len(s.blocks) * unit, state.device_kv.blocks.size(s.computed)
        assert held_tokens == need or (s.seq_id in state.busy and held_tokens > need)
        first = min(state.device_kv.blocks.first_live(s.computed), len(s.blocks))
        assert s.behind == first and set(s.blocks[:first]) <= {FREED}
        assert FREED not in s.blocks[first:]
        if state.device_kv.blocks.window:
            assert len(s.blocks) - first <= -(-state.device_kv.blocks.window // unit) + 1
    assert len(set(held)) == len(held) == state.device_kv.num_blocks - state.device_kv.pool.num_free
    assert not any(s.blocks for s in [*state.waiting, *state.host.values()])
    slots = [s.slot for s in state.device.values()]
    assert len(set(slots)) == len(slots) == state.device_kv.max_seqs - state.device_kv.free_slots
    assert all(0 <= s < state.device_kv.max_seqs for s in slots)
    assert all(s.slot is None for s in [*state.waiting, *state.host.values()])


def run_policy(policy: Policy, seqs: list[SeqInfo], device_kv: int, slots: int,
               host_kv: int = 0, unit: int = 1, window: int = 0, stages: int = 1
               ) -> tuple[SchedulerState, Trace]:
    """Drive `policy` until every sequence ran to its `max_output_len`, one step landing
    before the next (over `stages` > 1: that many micro-batches in flight, host ticks, the
    driver splitting a one-micro-batch policy's runs); both tiers charge whole `unit`s of
    tokens (the engine's KV blocks), every layer reads through a sliding `window` (0: none).
    The ledger is checked after every action."""
    state = SchedulerState(device_kv, slots, host_kv, host_unit=unit, device_unit=unit,
                           window=window)
    state.add(*seqs)
    trace = Trace()
    original_apply = state.apply

    def apply(action, finished=(), busy=False):
        done = original_apply(action, finished, busy)
        check_ledger(state, trace)
        return done

    state.apply = apply
    Driver(policy, state, TraceExecutor(trace, stages)).run()
    check_ledger(state, trace)
    return state, trace


def prefill_to_decode(trace: Trace) -> int:
    return trace.switches.count("decode")


def run_pipelined(policy: Policy, seqs: list[SeqInfo], device_kv: int, slots: int,
                  depth: int, unit: int = 1, finishes=None) -> tuple[SchedulerState, Trace]:
    """Up to `depth` micro-batches in flight (host-driven ticks); every sequence runs to its
    `max_output_len` unless `finishes(run, state)` names the ids that end in it."""
    state = SchedulerState(device_kv, slots, 0, host_unit=unit, device_unit=unit)
    state.add(*seqs)
    trace = Trace()
    Driver(policy, state, TraceExecutor(trace, depth, finishes)).run()
    return state, trace
