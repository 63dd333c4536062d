"""What the engine asks of every policy beyond token counts: prefill batches that fit compiled
shapes and group by padded length, the host tier charged in rounded tokens, and cancellation
from any queue. Also: the package stays pure Python."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxpipe.scheduler import Location, Preempt, Run, SchedulerState, SeqInfo, make_policy

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


def waiting(state: SchedulerState, lengths: list[int]) -> list[SeqInfo]:
    seqs = [SeqInfo(f"r{i}", n, 4) for i, n in enumerate(lengths)]
    state.add_all(seqs)
    return seqs


@pytest.mark.parametrize("name", ["seesaw", "prefill_first", "decode_first"])
def test_length_buckets_group_prompts_behind_the_oldest(name):
    bucket = {3: 4, 4: 4, 5: 8, 8: 8}.__getitem__
    state = SchedulerState(1000, 8, 1000)
    waiting(state, [5, 3, 8, 4, 5])
    action = make_policy(name, length_bucket=bucket).schedule(state)
    assert [s.seq_id for s, _ in action.prefill] == ["r0", "r2", "r4"]  # r0's bucket (8) only


def test_length_buckets_never_skip_the_oldest_prompt():
    state = SchedulerState(1000, 2, 1000)
    waiting(state, [100, 3, 3, 3])
    policy = make_policy("prefill_first", length_bucket=lambda n: 1 << (n - 1).bit_length())
    assert [s.seq_id for s, _ in policy.schedule(state).prefill] == ["r0"]


def test_prefill_batches_fit_the_executors_shapes():
    state = SchedulerState(1000, 8, 1000)
    waiting(state, [10, 10, 10, 10, 10])
    fits = lambda count, longest: count * longest <= 30  # noqa: E731
    action = make_policy("prefill_first", batch_fits=fits).schedule(state)
    assert [s.seq_id for s, _ in action.prefill] == ["r0", "r1", "r2"]


def test_host_tier_is_charged_in_rounded_tokens():
    state = SchedulerState(1000, 8, host_kv_tokens=64, host_unit=16)
    a, b, c = waiting(state, [17, 15, 20])
    state.apply(Run(prefill=[(a, 17), (b, 15)], prefill_to_host=True))
    assert state.host_used == 32 + 16  # 17 -> 32, 15 -> 16
    action = make_policy("seesaw").schedule(state)  # 20 -> 32 > 16 free: switch, not admit
    assert action.kind.value == "switch"
    state.apply(action)
    state.apply(Preempt([], "swap"))
    state.apply(Run(), finished=["r0"])
    assert state.host_used == 16


def test_abort_from_every_queue_returns_the_budget():
    state = SchedulerState(1000, 8, 100, host_unit=8)
    a, b, c = waiting(state, [5, 6, 7])
    state.apply(Run(prefill=[(a, 5)], prefill_to_host=True))
    state.apply(Run(prefill=[(b, 6)]))
    assert (state.host_used, state.device_used) == (8, 6)
    for seq in (a, b, c):
        assert state.abort(seq.seq_id) is seq and seq.location is Location.FINISHED
    assert (state.host_used, state.device_used, state.has_work()) == (0, 0, False)
    assert state.abort("r0") is None
