"""What the engine asks of every policy beyond token counts: prompt chunks within the step's
token budget (a long prompt split over steps, part-way prompts continued first), the host tier
charged in rounded tokens, and cancellation from any queue; the prefix admission's deferral
(`admission.py`; its prefix arithmetic: test_prefix_cache.py). Also: the package stays pure
Python, and the policies read the state through its narrow interface only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxpipe.scheduler import (
    Location,
    Preempt,
    Run,
    SchedulerState,
    SeqInfo,
    Sequence,
    SwapIn,
    make_policy,
)
from jaxpipe.scheduler.admission import Admission
from jaxpipe.scheduler.blocks import Blocks
from jaxpipe.scheduler.device_ledger import DeviceLedger
from jaxpipe.scheduler.prefix_cache import BlockPool

SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "jaxpipe" / "scheduler"


def test_scheduler_imports_neither_jax_nor_numpy():
    for path in SCHEDULER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & {"jax", "jaxlib", "numpy", "flax"}, path.name


POLICIES = ["policy.py", "prefill_first.py", "decode_first.py", "seesaw.py", "tdpipe.py",
            "throttle.py"]
# What a policy may read of the state: the places, and the two ledgers (read-only).
STATE_READS = {"waiting", "device", "host", "busy", "idle", "phase", "device_kv", "host_kv"}
LEDGER_WRITES = {"enter", "extend", "slide", "leave", "settle", "hold", "release",
                 "take_moves", "reset_peak", "store_evicted", "take_prefix", "cache_full"}


def test_policies_read_the_state_through_its_narrow_interface():
    """Policies read the queues and the ledgers; only the state moves sequences and only
    the ledgers give out blocks, slots and host room."""
    for name in POLICIES:
        for node in ast.walk(ast.parse((SCHEDULER_DIR / name).read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id == "state":
                assert node.attr in STATE_READS, f"{name}: state.{node.attr}"
            assert node.attr not in LEDGER_WRITES, f"{name}: .{node.attr}"


def test_a_sequence_whose_next_block_a_launched_run_writes_is_deferred():
    """Two prompts with the same first block in one run: the second's next block is being
    written by the first, so it leaves the run (still waiting); the first enters. Once the
    run is applied nothing is being written, and it is admitted."""
    kv = DeviceLedger(16 * 4, 4, Blocks(4), BlockPool(16, 4, caching=True))
    admission = Admission(kv)
    a, b = (Sequence.create(i, list(range(9)), None, 0, 4) for i in "ab")
    run = Run(prefill=[(a, 9), (b, 9)])
    assert admission.admit(run) == [a] and run.prefill == [(a, 9)]
    admission.applied()
    again = Run(prefill=[(b, 9)])
    assert admission.admit(again) == [b] and again.prefill == [(b, 9)]


def waiting(state: SchedulerState, lengths: list[int]) -> list[SeqInfo]:
    seqs = [SeqInfo(f"r{i}", n, 4) for i, n in enumerate(lengths)]
    state.add(*seqs)
    return seqs


@pytest.mark.parametrize("name", ["seesaw", "decode_first"])
def test_prompts_are_chunked_to_the_token_budget(name):
    """A 25-token budget over prompts of 10, 30 and 8 tokens: step 1 takes r0 whole and 15
    of r1; step 2 continues r1 first (its last 15), then r2 whole."""
    state = SchedulerState(1000, 8, 1000)
    r0, r1, r2 = waiting(state, [10, 30, 8])
    policy = make_policy(name, max_prefill_tokens=25)
    action = policy.schedule(state)
    assert [(s.seq_id, n) for s, n in action.prefill] == [("r0", 10), ("r1", 15)]
    state.apply(action)
    assert r1.in_prefill and r1.computed == 15
    action = policy.schedule(state)
    assert [(s.seq_id, n) for s, n in action.prefill] == [("r1", 15), ("r2", 8)]


def test_chunked_prefill_first_fills_the_budget_after_decode_tokens():
    state = SchedulerState(1000, 8, 0)
    a, b = waiting(state, [6, 40])
    policy = make_policy("prefill_first", max_prefill_tokens=16)
    action = policy.schedule(state)
    assert [(s.seq_id, n) for s, n in action.prefill] == [("r0", 6), ("r1", 10)]
    state.apply(action)
    action = policy.schedule(state)  # r0 decodes one token, r1 gets the other 15
    assert action.decode == [a] and [(s.seq_id, n) for s, n in action.prefill] == [("r1", 15)]


def test_host_tier_is_charged_in_rounded_tokens():
    state = SchedulerState(1000, 8, host_kv_tokens=64, host_unit=16)
    a, b, c = waiting(state, [17, 15, 20])
    state.apply(Run(prefill=[(a, 17), (b, 15)], prefill_to_host=True))
    assert state.host_kv.used == 32 + 16  # 17 -> 32, 15 -> 16
    action = make_policy("seesaw").schedule(state)  # 20 -> 32 > 16 free: switch, not admit
    assert action.kind.value == "switch"
    state.apply(action)
    state.apply(Preempt([], "swap"))
    state.apply(Run(), finished=["r0"])
    assert state.host_kv.used == 16 and state.host_kv.peak == 48


def test_reset_peaks_restarts_both_peaks_from_what_is_held_now():
    state = SchedulerState(1000, 8, host_kv_tokens=64, host_unit=16, device_unit=4)
    a, b = waiting(state, [17, 6])
    state.apply(Run(prefill=[(a, 17)], prefill_to_host=True))  # 32 host tokens
    state.apply(Run(prefill=[(b, 6)]))  # 2 blocks of 4
    state.apply(Run(), finished=["r0"])
    # a's 5 blocks before the host
    assert (state.device_kv.peak_blocks, state.host_kv.peak) == (5, 32)
    state.device_kv.reset_peak()
    state.host_kv.reset_peak()
    assert (state.device_kv.peak_blocks, state.host_kv.peak) == (2, 0)


def test_abort_from_every_queue_returns_the_budget():
    state = SchedulerState(1000, 8, 100, host_unit=8)
    a, b, c = waiting(state, [5, 6, 7])
    state.apply(Run(prefill=[(a, 5)], prefill_to_host=True))
    state.apply(Run(prefill=[(b, 6)]))
    assert (state.host_kv.used, state.device_kv.used) == (8, 6)
    for seq in (a, b, c):
        assert state.abort(seq.seq_id) is seq and seq.location is Location.FINISHED
    assert (state.host_kv.used, state.device_kv.used, state.has_work()) == (0, 0, False)
    assert state.abort("r0") is None


def test_slots_are_given_on_entering_the_device_and_returned_on_leaving():
    """The lowest free slot to a prompt's first chunk and to a swap-in; a swap-out, a
    recompute preemption and a finish give it back; a full device refuses one more."""
    state = SchedulerState(1000, 3, 100)
    a, b, c, d = waiting(state, [5, 6, 7, 8])
    state.apply(Run(prefill=[(a, 2), (b, 6), (c, 7)]))
    assert [s.slot for s in (a, b, c)] == [0, 1, 2] and state.device_kv.free_slots == 0
    state.apply(Preempt([b], "swap"))
    assert b.slot is None and state.device_kv.free_slots == 1
    state.apply(Preempt([a], "recompute"))
    assert a.slot is None and state.device_kv.free_slots == 2
    state.apply(SwapIn([b]))
    assert b.slot == 0
    state.apply(Run(prefill=[(a, 5)]), finished=["r2"])
    assert (a.slot, c.slot, state.device_kv.free_slots) == (1, None, 1)
    state.launch(Run(prefill=[(d, 8)]))
    assert d.slot == 2 and state.device_kv.free_slots == 0
    e = SeqInfo("e", 3, 1)
    state.add(e)
    with pytest.raises(RuntimeError, match="no free slot"):
        state.launch(Run(prefill=[(e, 3)]))
