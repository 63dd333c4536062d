"""KVManager's queued swap-outs: read out of the pool only when flushed, before anything that
writes the pool (a swap-in's insert) or needs the host entry (its swap-in), and never for a
sequence dropped meanwhile. A fake runner records the order of pool reads and writes."""

from __future__ import annotations

import time

import jax.numpy as jnp

from jaxpipe.kv.manager import KVManager
from jaxpipe.scheduler import Sequence


class FakeRunner:
    kv_chunk = 16

    def __init__(self):
        self.log: list[tuple] = []
        self.inserted: list[float] = []  # the value of each insert's arrays

    def kv_extract(self, blocks, tokens):
        """Arrays of one value per extract: 1.0, 2.0, ... (so an insert says whose KV)."""
        self.log.append(("extract", tuple(blocks), tokens))
        value = sum(e[0] == "extract" for e in self.log)
        return [jnp.full((1, 1, 16, 2), value, jnp.float32)] * 2 * -(-tokens // 16)

    def kv_staging(self):
        return None

    def kv_insert(self, blocks, arrays):
        self.log.append(("insert", tuple(blocks)))
        self.inserted.append(float(arrays[0][0, 0, 0, 0]))


def manager():
    runner = FakeRunner()
    return runner, KVManager(runner, host_tier=True)


def seq(request_id: str, blocks: list[int], slot: int = 0) -> Sequence:
    """A device sequence holding `blocks` and `slot` (the scheduler state's to give)."""
    s = Sequence.create(request_id, [1] * 20, None, 0, 8)
    s.blocks, s.slot = list(blocks), slot
    return s


def test_swap_out_is_read_at_flush_with_the_blocks_it_had():
    runner, kv = manager()
    a = seq("a", [3, 5])
    kv.swap_out(a, 20)
    a.blocks, a.slot = [], None  # the state frees them when it records the move
    assert runner.log == [] and kv.outgoing == 1
    kv.flush()
    assert runner.log == [("extract", (3, 5), 20)] and kv.outgoing == 0
    assert kv.host.entries["a"].tokens == 20
    kv.close()


def test_a_dropped_sequence_is_never_read_out():
    runner, kv = manager()
    a = seq("a", [1])
    kv.swap_out(a, 5)
    kv.drop(a)
    kv.flush()
    assert runner.log == [] and "a" not in kv.host.entries
    kv.close()


def test_a_swap_in_reads_queued_swap_outs_before_it_writes_blocks():
    """A sequence swapped in right after its own (queued) swap-out: its host entry is there
    (flushed first), and every queued read comes before the insert into the blocks."""
    runner, kv = manager()
    a, b = seq("a", [0, 1], slot=0), seq("b", [2], slot=1)
    for s in (a, b):
        kv.swap_out(s, 20 if s is a else 10)
        s.blocks, s.slot = [], None
    a.blocks, a.slot = [1, 4], 1  # the state's, given when it recorded the swap-in
    kv.swap_in(a)  # the prefetcher asked for a's KV
    assert kv.outgoing == 0 and [e[0] for e in runner.log] == ["extract", "extract"]
    assert kv.deliver(block=True) == [a]
    assert runner.log[-1] == ("insert", (1, 4)) and kv.decodable(a)
    kv.close()


def wait_until(condition) -> None:
    """Poll `condition` (the prefetcher thread's progress) for up to 10 s."""
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_a_swap_in_aborted_once_staged_leaves_no_staged_copy():
    """`a` is dropped (aborted) after the prefetcher staged its KV: the staged arrays are
    freed at once (they stayed in the prefetcher's queue, holding device memory, until some
    later delivery), the request is no longer pending, and nothing is inserted."""
    runner, kv = manager()
    a = seq("a", [0, 1])
    kv.swap_out(a, 20)
    kv.flush()
    kv.swap_in(a)
    wait_until(lambda: kv.prefetcher.staged == 1)
    kv.drop(a)
    assert kv.prefetcher.staged == 0 and kv.prefetcher.pending == 0 and kv.pending == 0
    assert kv.deliver() == [] and not any(e[0] == "insert" for e in runner.log)
    kv.close()


def test_a_request_id_reused_after_an_abort_gets_its_own_kv():
    """`a` is aborted while its swap-in is staged; its id is freed and a new request takes it
    (`Engine.forget`, then a caller's own request_id), is swapped out and in: it gets its
    own KV. The aborted one's staged copy, left in the queue, was handed to the new one."""
    runner, kv = manager()
    old = seq("a", [0, 1])
    kv.swap_out(old, 20)
    kv.flush()  # extract 1: the old request's KV
    kv.swap_in(old)
    wait_until(lambda: any(e[1:] == ("in", "a") for e in kv.host.events))
    kv.drop(old)
    new = seq("a", [2, 3])
    kv.swap_out(new, 20)
    kv.flush()  # extract 2: the new request's KV
    new.blocks, new.slot = [5, 6], 1
    kv.swap_in(new)
    assert kv.deliver(block=True) == [new]
    assert runner.inserted == [2.0] and runner.log[-1] == ("insert", (5, 6))
    kv.close()


def test_prefix_cache_moves_run_in_order_and_are_mirrored():
    """The ledger's host-tier moves: a spill reads its blocks into a group entry, a fetch
    writes one block of the group (its other places out of range) and keeps the entry, a
    forget frees it; a follower is sent each move first, as the swaps' own messages."""
    from jaxpipe.kernels.paged import OUT_OF_RANGE
    from jaxpipe.scheduler.host_prefix import Fetch, Forget, Spill

    runner, sent = FakeRunner(), []
    kv = KVManager(runner, host_tier=True, mirror=lambda *m: sent.append(m))
    kv.move_blocks([Spill(0, (4, 9)), Fetch(0, 1, 7)])
    assert runner.log == [("extract", (4, 9), 32), ("insert", (OUT_OF_RANGE, 7))]
    assert ("prefix", 0) in kv.host.entries and kv.host.bytes_out == 0  # not a swap-out
    assert kv.prefix_bytes_out > 0 and kv.prefix_bytes_in > 0
    kv.move_blocks([Forget(0)])
    assert kv.host.entries == {}
    assert sent == [("swap_out", ("prefix", 0), [4, 9], 32),
                    ("prefix_fetch", ("prefix", 0), [OUT_OF_RANGE, 7]), ("drop", ("prefix", 0))]
    kv.close()
