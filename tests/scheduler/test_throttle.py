"""gLLM's token throttling: #P and #D against hand-computed values (paper eqs. 3-4), and the
policy over a pipelined executor (every request once, KV never overfilled)."""

from __future__ import annotations

import math

import pytest

from jaxpipe.scheduler import Driver, Location, Run, SchedulerState, SeqInfo, make_policy
from jaxpipe.scheduler.throttle import ThrottleKnobs, decode_budget, prefill_budget
from scheduler.helpers import Trace, TraceExecutor, make_seqs, run_pipelined

KNOBS = ThrottleKnobs()  # #T 8, #MaxP 2048, #MinP 32, KV_thresh 0.05


@pytest.mark.parametrize("waiting,kv_free,expected", [
    (1000, 0.5, 125),  # #WP/#T = 125 < 2048 * 0.45/0.95 = 970.1
    (100_000, 0.5, 971),  # the KV term binds: ceil(970.1)
    (100_000, 1.0, 2048),  # all KV free: #MaxP
    (100, 0.5, 32),  # 12.5 < #MinP: 32
    (10, 0.5, 10),  # #MinP, but no more than what waits
    (100_000, 0.04, 0),  # below KV_thresh: suspended
    (0, 0.9, 0),  # nothing waits
])
def test_prefill_budget_is_equation_3(waiting, kv_free, expected):
    assert prefill_budget(waiting, kv_free, KNOBS) == expected


def test_prefill_budget_with_other_knobs():
    knobs = ThrottleKnobs(iterations=4, max_prefill=512, min_prefill=0, kv_thresh=0.2)
    # min(800 / 4, 512 * (0.6 - 0.2) / 0.8) = min(200, 256) = 200
    assert prefill_budget(800, 0.6, knobs) == 200
    # min(4000 / 4, 256) = 256
    assert prefill_budget(4000, 0.6, knobs) == 256


def test_prefill_budget_without_the_kv_term_is_equation_1():
    knobs = ThrottleKnobs(by_kv=False)
    assert prefill_budget(100_000, 0.01, knobs) == 2048  # min(max(12500, 32), 2048)
    assert prefill_budget(1000, 0.01, knobs) == 125  # never suspended


@pytest.mark.parametrize("running,depth,expected", [(10, 4, 3), (8, 4, 2), (0, 4, 0),
                                                     (5, 1, 5), (1, 8, 1)])
def test_decode_budget_is_equation_4(running, depth, expected):
    assert decode_budget(running, depth) == expected


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="iterations"):
        ThrottleKnobs(iterations=0)
    with pytest.raises(ValueError, match="kv_thresh"):
        ThrottleKnobs(kv_thresh=1.0)
    with pytest.raises(ValueError, match="pipeline_depth"):
        make_policy("throttle", pipeline_depth=0)


def test_one_micro_batch_carries_the_throttled_tokens():
    """10 decoding sequences over depth 4: 3 decode tokens; 2000 waiting prompt tokens with
    KV 80% free: #P = min(2000/8, 2048*0.75/0.95) = 250 prompt tokens."""
    state = SchedulerState(device_kv_tokens=10_000, max_device_seqs=64)
    running = [SeqInfo(f"r{i}", 100, 50) for i in range(10)]
    state.add(*running)
    state.apply(Run(prefill=[(s, 100) for s in running]))  # now decoding, 1010 tokens held
    state.add(*(SeqInfo(f"w{i}", 200, 10) for i in range(10)))
    policy = make_policy("throttle", pipeline_depth=4)
    kv_free = state.device_kv.free / state.device_kv.capacity
    assert kv_free == pytest.approx(0.9)
    p = math.ceil(min(2000 / 8, 2048 * (kv_free - 0.05) / 0.95))
    assert policy.budgets(state) == (p, 3)
    run = policy.schedule(state)
    assert [s.seq_id for s in run.decode] == ["r0", "r1", "r2"]
    assert run.prefill_tokens == p and [s.seq_id for s, _ in run.prefill] == ["w0", "w1"]
    state.launch(run)
    run2 = policy.schedule(state)  # the next micro-batch takes the next idle ones
    assert [s.seq_id for s in run2.decode] == ["r3", "r4", "r5"]
    assert run2.prefill[0][0].seq_id == "w2"  # w1 is in flight with its first chunk


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_every_request_finishes_once_under_pipelining(depth, seed):
    seqs = make_seqs(40, seed)
    policy = make_policy("throttle", pipeline_depth=depth,
                         knobs=ThrottleKnobs(iterations=2, max_prefill=64, min_prefill=8))
    state, trace = run_pipelined(policy, seqs, device_kv=240, slots=16, depth=depth, unit=4)
    assert sorted(trace.finished) == list(range(40))
    assert all(s.location is Location.FINISHED and s.generated == s.max_output_len
               for s in seqs)
    assert trace.max_device_used <= 240 and state.device_kv.used == 0
    assert trace.max_in_flight == depth or depth == 1


def drive(policy, seqs, device_kv: int, slots: int, depth: int, unit: int) -> SchedulerState:
    """`run_pipelined` with a bound on the steps: a livelock fails instead of running on."""
    state = SchedulerState(device_kv, slots, device_unit=unit)
    state.add(*seqs)
    Driver(policy, state, TraceExecutor(Trace(), depth)).run(max_steps=5_000)
    return state


def test_a_prompt_alone_in_a_small_store_is_never_suspended():
    """A 54-token prompt in a 4-block store (blocks of 16), prefilled in chunks of 16: after
    49 tokens it holds every block, KV_free is 0 < KV_thresh and prefill was suspended; with
    nothing decoding the policy preempted it (the newest) and admitted it again, for ever.
    Its KV was counted when it was admitted: it goes on, and finishes."""
    seq = SeqInfo(0, 54, 8)
    policy = make_policy("throttle", pipeline_depth=1, max_prefill_tokens=16,
                         knobs=ThrottleKnobs(min_prefill=0))
    state = drive(policy, [seq], device_kv=64, slots=8, depth=1, unit=16)
    assert seq.location is Location.FINISHED and state.num_finished == 1


@pytest.mark.parametrize("depth", [1, 2])
def test_every_request_finishes_in_a_store_too_small_for_its_slots(depth):
    """32 slots over a 4-block store: prompts were admitted a block at a time while a slot
    and a block were free, so part-way prompts filled the store, prefill was suspended below
    KV_thresh and the newest was preempted and admitted again in a loop. A prompt is now
    admitted only if all of its KV fits."""
    sizes = [(29, 30), (15, 25), (8, 38), (15, 39), (8, 1), (3, 28), (29, 31), (8, 15),
             (54, 8), (11, 1), (10, 33)]
    seqs = [SeqInfo(i, p, o) for i, (p, o) in enumerate(sizes)]
    policy = make_policy("throttle", pipeline_depth=depth, max_prefill_tokens=16,
                         knobs=ThrottleKnobs(min_prefill=0))
    state = drive(policy, seqs, device_kv=64, slots=32, depth=depth, unit=16)
    assert all(s.location is Location.FINISHED and s.generated == s.max_output_len
               for s in seqs)
    assert state.device_kv.used == 0
