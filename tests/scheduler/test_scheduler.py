"""The scheduler in pure Python (no jax, no model): slots, FIFO admission, prefill budgets and a
simulated serving loop in which every sequence finishes exactly once."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from jaxpipe.scheduler import Scheduler, Sequence, SequenceStatus

SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "jaxpipe" / "scheduler"


def seq(name: str, prompt_len: int = 4, max_tokens: int = 3) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), params=None, seed=0,
                    max_tokens=max_tokens)


def always(count: int, longest: int) -> bool:
    return True


def admit_all(scheduler: Scheduler) -> list[Sequence]:
    batch = scheduler.schedule()
    assert batch is not None and batch.kind == "prefill"
    return batch.seqs


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


def test_empty_scheduler_has_nothing_to_do():
    s = Scheduler(4, always)
    assert not s.has_work() and s.schedule() is None and s.decode_rows() == 0


def test_lowest_free_slots_first():
    s = Scheduler(4, always)
    seqs = [seq(f"r{i}") for i in range(4)]
    for q in seqs:
        s.add(q)
    assert [q.slot for q in admit_all(s)] == [0, 1, 2, 3]
    s.finish(seqs[3], "stop")
    s.finish(seqs[1], "stop")
    late = [seq("a"), seq("b")]
    for q in late:
        s.add(q)
    assert [q.slot for q in admit_all(s)] == [1, 3]


def test_admission_is_fifo_and_limited_by_free_slots():
    s = Scheduler(2, always)
    seqs = [seq(f"r{i}") for i in range(5)]
    for q in seqs:
        s.add(q)
    assert admit_all(s) == seqs[:2]
    assert list(s.waiting) == seqs[2:]
    assert s.schedule().kind == "decode"  # no free slot: decode, the queue waits
    s.finish(seqs[0], "length")
    assert admit_all(s) == [seqs[2]]


def test_prefill_batch_respects_the_budget():
    calls = []

    def budget(count: int, longest: int) -> bool:
        calls.append((count, longest))
        return count * longest <= 20

    s = Scheduler(8, budget)
    lengths = [4, 5, 3, 9, 2]
    seqs = [seq(f"r{i}", n) for i, n in enumerate(lengths)]
    for q in seqs:
        s.add(q)
    assert admit_all(s) == seqs[:3]  # a 4th would make 4 x 9 = 36 > 20
    assert admit_all(s) == [seqs[3], seqs[4]]  # 2 x 9 = 18
    assert all(count >= 2 for count, _ in calls)  # a single prompt is always admitted


def test_single_prompt_over_budget_is_still_admitted():
    s = Scheduler(2, lambda count, longest: False)
    big = seq("big", prompt_len=100)
    s.add(big)
    assert admit_all(s) == [big]


def test_decode_batch_is_every_running_sequence_by_slot():
    s = Scheduler(4, always)
    seqs = [seq(f"r{i}") for i in range(3)]
    for q in seqs:
        s.add(q)
    admit_all(s)
    s.finish(seqs[1], "stop")
    batch = s.schedule()
    assert batch.kind == "decode" and batch.seqs == [seqs[0], seqs[2]]
    assert s.decode_rows() == 3


def test_finishing_a_waiting_sequence_removes_it():
    s = Scheduler(1, always)
    first, second = seq("first"), seq("second")
    s.add(first)
    s.add(second)
    admit_all(s)
    s.finish(second, "abort")
    assert second.is_finished and second.finish_reason == "abort" and second.slot is None
    assert list(s.waiting) == []
    assert s.schedule().seqs == [first]


@pytest.mark.parametrize("seed", range(5))
def test_simulated_loop_finishes_every_sequence_once(seed):
    rng = random.Random(seed)
    num_slots, budget = 4, 24
    s = Scheduler(num_slots, lambda count, longest: count * longest <= budget)
    seqs = [seq(f"r{i}", rng.randint(1, 12), rng.randint(1, 6)) for i in range(30)]
    pending, admitted, finished = list(seqs), [], []
    while pending or s.has_work():
        for _ in range(rng.randint(0, 3)):  # requests arrive while others run
            if pending:
                s.add(pending.pop(0))
        batch = s.schedule()
        if batch is None:
            continue
        _check_slots(s, num_slots)
        if batch.kind == "prefill":
            _check_prefill(batch.seqs, budget)
            admitted += batch.seqs
        for q in batch.seqs:
            assert q.status is SequenceStatus.RUNNING
            q.output_token_ids.append(7)
            if len(q.output_token_ids) >= q.max_tokens:
                s.finish(q, "length")
                finished.append(q)
    assert admitted == seqs  # FIFO over the whole run
    assert sorted(finished, key=seqs.index) == seqs and len(finished) == len(seqs)
    assert all(len(q.output_token_ids) == q.max_tokens for q in seqs)
    assert s.running == {} and list(s.waiting) == []


def _check_slots(s: Scheduler, num_slots: int) -> None:
    slots = [q.slot for q in s.running.values()]
    assert len(set(slots)) == len(slots), "slot assigned twice"
    assert all(0 <= slot < num_slots for slot in slots)
    assert all(q.slot == slot for slot, q in s.running.items())


def _check_prefill(seqs: list[Sequence], budget: int) -> None:
    longest = max(q.prompt_len for q in seqs)
    assert len(seqs) == 1 or len(seqs) * longest <= budget
    assert all(not q.output_token_ids for q in seqs)


def test_length_buckets_group_prompts_behind_the_oldest():
    bucket = {3: 4, 4: 4, 5: 8, 8: 8}.__getitem__
    s = Scheduler(8, always, length_bucket=bucket)
    seqs = [seq(f"r{i}", n) for i, n in enumerate([5, 3, 8, 4, 5])]
    for q in seqs:
        s.add(q)
    first = s.schedule()
    assert [q.request_id for q in first.seqs] == ["r0", "r2", "r4"]  # r0's bucket (8) only
    second = s.schedule()
    assert [q.request_id for q in second.seqs] == ["r1", "r3"]
    assert not s.waiting


def test_length_buckets_never_skip_the_oldest_prompt():
    bucket = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    s = Scheduler(2, always, length_bucket=bucket)
    for i, n in enumerate([100, 3, 3, 3]):
        s.add(seq(f"r{i}", n))
    assert [q.request_id for q in s.schedule().seqs] == ["r0"]
