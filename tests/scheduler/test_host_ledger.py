"""The host tier's ledger: sequences charged in rounded tokens from swap-out to swap-in, the
prefix cache's groups in what they leave (evicted oldest first when a sequence needs the
room), and the overfill check."""

from __future__ import annotations

import pytest

from jaxpipe.scheduler import SeqInfo
from jaxpipe.scheduler.host_ledger import HostLedger
from jaxpipe.scheduler.host_prefix import Forget, Spill


def swapped(seq_id: str, computed: int) -> SeqInfo:
    seq = SeqInfo(seq_id, computed, 4)
    seq.computed = computed
    return seq


def test_a_sequence_is_charged_its_tokens_rounded_up_while_it_is_held():
    host = HostLedger(64, unit=16)
    a, b = swapped("a", 17), swapped("b", 5)
    host.hold(a)
    host.hold(b)
    assert (host.used, host.free, host.peak) == (48, 16, 48)  # 32 + 16
    host.release(a)
    assert (host.used, host.peak) == (16, 48)
    host.reset_peak()
    assert host.peak == 16


def test_the_cache_gives_way_to_swapped_out_sequences():
    """Groups of 2 blocks of 4 (one 8-token swap chunk): two groups fill a 16-token tier; a
    sequence swapped out takes the room of the oldest (its Forget recorded in order)."""
    host = HostLedger(16, unit=8, cache_block=4)
    cache = host.cache
    assert (cache.group_blocks, cache.group_tokens, cache.limit) == (2, 8, 16)
    cache.store([(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")])
    assert cache.used == 16 and host.free == 16  # the cache does not count against `free`
    host.hold(swapped("s", 8))
    assert cache.used == 8 and host.take_moves() == [Spill(0, (0, 1)), Spill(1, (2, 3)),
                                                     Forget(0)]
    assert host.take_moves() == []
    host.check()


def test_no_cache_without_prefix_caching_or_a_tier():
    assert HostLedger(64, 16).cache is None and HostLedger(0, 16, cache_block=16).cache is None
    assert HostLedger(0, 16).take_moves() == []


def test_an_overfilled_tier_is_refused_naming_both_parts():
    host = HostLedger(16, unit=16)
    host.hold(swapped("a", 20))
    with pytest.raises(RuntimeError, match="host KV tier overfilled: 32 tokens of sequences"):
        host.check()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="host_kv_tokens >= 0"):
        HostLedger(-1)
    with pytest.raises(ValueError, match="host_unit >= 1"):
        HostLedger(16, unit=0)
