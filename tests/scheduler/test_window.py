"""Sliding windows in the ledger: when every layer reads only its last `window` keys, a
sequence gives back the blocks its next query's window has moved past (their entries FREED,
out of every pool's range), so it holds at most ceil(window / block) + 1 blocks as it
decodes; admission reserves that peak, not the length; swaps bring back only the blocks past
the window; a recompute starts over. The prefix cache's random traffic with a window is in
test_prefix_cache.py; the engine's tokens against HF in tests/engine/test_sliding_window.py."""

from __future__ import annotations

import pytest

from jaxpipe.kernels.paged import OUT_OF_RANGE
from jaxpipe.scheduler import Location, Preempt, Run, SchedulerState, SeqInfo, SwapIn, make_policy
from jaxpipe.scheduler.prefix_cache import FREED
from scheduler.helpers import run_policy

BLOCK = 16
WINDOW = 20  # past one block: windows start inside blocks


def test_freed_entries_are_the_pools_out_of_range():
    """A block table carries FREED as it is: attention reads no entry outside the pool
    before a query's window, and a write there is dropped (kernels/ragged_attention.py)."""
    assert FREED == OUT_OF_RANGE


def windowed_state(blocks: int = 16, slots: int = 4, host: int = 0) -> SchedulerState:
    return SchedulerState(blocks * BLOCK, slots, host, host_unit=BLOCK, device_unit=BLOCK,
                          window=WINDOW)


def test_blocks_behind_the_window_are_given_back_as_the_sequence_goes():
    """A 50-token prompt: its next query (position 50) reads from position 31, in block 1, so
    block 0 is given back; after 14 decode steps (position 64: from 45, block 2) block 1
    too. The entries stay in position order, the freed ones FREED."""
    state = windowed_state()
    seq = SeqInfo("a", 50, 30)
    state.add(seq)
    state.apply(Run(prefill=[(seq, 50)]))
    kept = seq.blocks[1:]
    assert seq.blocks == [FREED, *kept] and seq.behind == 1
    assert state.device_kv.used == 3 * BLOCK == state.device_kv.held(seq)
    for _ in range(14):
        state.apply(Run(decode=[seq]))
    assert seq.computed == 64 and seq.blocks[:2] == [FREED, FREED] and seq.behind == 2
    assert state.device_kv.used == 2 * BLOCK  # blocks 2 and 3: positions 32..63
    state.finish(["a"])
    assert state.device_kv.used == 0 and state.device_kv.pool.num_free == state.device_kv.num_blocks


def test_without_a_window_every_block_is_kept():
    """window=0 (some layer reads everything: Gemma's global layers) keeps them all."""
    state = SchedulerState(16 * BLOCK, 4, device_unit=BLOCK)
    seq = SeqInfo("a", 50, 30)
    state.add(seq)
    state.apply(Run(prefill=[(seq, 50)]))
    assert FREED not in seq.blocks and state.device_kv.used == 4 * BLOCK


def test_the_peak_is_the_window_not_the_length():
    """Decoding, a sequence reads its window: 20 positions fall on at most 3 blocks of 16. A
    900-token prompt in chunks of 32: its first chunk 2 blocks, each later one reads 51
    positions, at most 5 blocks; a 40-token prompt in one chunk 3 blocks. Never more than
    the whole length; without a window, the whole length."""
    state = windowed_state()
    assert state.device_kv.peak(SeqInfo("a", 900, 100), 1000, chunk=32) == 5 * BLOCK
    assert state.device_kv.peak(SeqInfo("b", 40, 100), 140, chunk=64) == 3 * BLOCK
    assert state.device_kv.peak(SeqInfo("c", 10, 20), 30, chunk=64) == 2 * BLOCK
    decoding = SeqInfo("d", 900, 100)
    decoding.computed, decoding.generated = 900, 1
    assert state.device_kv.peak(decoding, 1000) == 3 * BLOCK
    plain = SchedulerState(16 * BLOCK, 4, device_unit=BLOCK)
    kv = plain.device_kv
    assert kv.peak(SeqInfo("a", 900, 100), 1000, 32) == kv.blocks.size(1000)


@pytest.mark.parametrize("policy", ["prefill_first", "decode_first", "tdpipe", "throttle"])
def test_a_pool_too_small_for_the_sequences_runs_them_at_once(policy):
    """Four requests of 40 + 100 tokens (9 blocks each: 36) in a 12-block pool: without a
    window one or two run at a time; with one each holds at most 3 blocks as it decodes, so
    all four decode together, none preempted, and the ledger holds (`check_ledger`: at most
    ceil(window / block) + 1 blocks each after every action)."""
    options = {"tdpipe": dict(predictor="oracle", finish_ratio=0.5)}.get(policy, {})
    seqs = [SeqInfo(i, 40, 100) for i in range(4)]
    make = lambda: make_policy(policy, max_prefill_tokens=64, **options)  # noqa: E731
    state, trace = run_policy(make(), seqs, device_kv=12 * BLOCK, slots=4, unit=BLOCK,
                              window=WINDOW)
    assert all(s.location is Location.FINISHED and s.generated == 100 for s in seqs)
    assert trace.preempted == 0 and max(len(d) for d, _ in trace.launched) == 4
    assert state.device_kv.peak_blocks <= 12
    seqs = [SeqInfo(i, 40, 100) for i in range(4)]
    _, trace = run_policy(make(), seqs, device_kv=12 * BLOCK, slots=4, unit=BLOCK)
    assert trace.preempted > 0 or max(len(d) for d, _ in trace.launched) < 4


def test_a_swap_brings_back_only_the_blocks_past_the_window():
    """Swapped out, a windowed sequence holds nothing on the device (the host tier keeps its
    whole length); swapped in at position 70 (window from 51, block 3) it takes blocks 3
    and 4 only, entries 0-2 FREED (a swap-in's writes there are dropped)."""
    state = windowed_state(host=8 * BLOCK)
    seq = SeqInfo("a", 60, 30)
    state.add(seq)
    state.apply(Run(prefill=[(seq, 60)]))
    for _ in range(10):
        state.apply(Run(decode=[seq]))
    state.apply(Preempt([seq], "swap"))
    assert state.device_kv.used == 0 and state.host_kv.used == state.host_kv.size(70)
    assert state.device_kv.resume(seq) == 2 * BLOCK
    state.apply(SwapIn([seq]))
    assert seq.blocks[:3] == [FREED] * 3 and FREED not in seq.blocks[3:]
    assert len(seq.blocks) == 5 and seq.behind == 3 and state.device_kv.used == 2 * BLOCK
    state.apply(Run(decode=[seq]))
    assert seq.computed == 71 and state.device_kv.used == 2 * BLOCK


def test_a_recompute_starts_over_from_the_first_block():
    state = windowed_state()
    seq = SeqInfo("a", 60, 30)
    state.add(seq)
    state.apply(Run(prefill=[(seq, 60)]))
    state.apply(Preempt([seq], "recompute"))
    assert (seq.blocks, seq.behind, state.device_kv.used) == ([], 0, 0)
    state.apply(Run(prefill=[(seq, 16)]))  # chunk by chunk from position 0
    assert FREED not in seq.blocks and len(seq.blocks) == 1


def test_seesaw_through_the_host_tier_with_a_window():
    """Prefills parked in the host tier and swapped back in past their windows: every
    request finishes and the ledger holds after every action."""
    seqs = [SeqInfo(i, 30 + 7 * i, 40) for i in range(6)]
    state, trace = run_policy(make_policy("seesaw", max_prefill_tokens=64), seqs,
                              device_kv=10 * BLOCK, slots=4, host_kv=32 * BLOCK, unit=BLOCK,
                              window=WINDOW)
    assert all(s.location is Location.FINISHED for s in seqs)
    assert trace.swapped_in >= 6 and state.host_kv.used == 0


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="window >= 0"):
        SchedulerState(16, 1, window=-1)
