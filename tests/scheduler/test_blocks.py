"""The block arithmetic every count of the device store is made of, on a block of 7 (prime,
so that an off-by-one in a division shows) and a window that starts inside blocks."""

from __future__ import annotations

import pytest

from jaxpipe.scheduler.blocks import Blocks


def test_positions_take_whole_blocks():
    blocks = Blocks(7)
    assert [blocks.count(n) for n in (0, 1, 7, 8, 14, 15)] == [0, 1, 1, 2, 2, 3]
    assert [blocks.size(n) for n in (0, 1, 7, 8)] == [0, 7, 7, 14]


def test_a_window_starts_in_the_block_of_its_first_key():
    """Window 10: a query at p reads p - 9 .. p; at 9 still block 0, at 16 from 7 (block 1),
    at 23 from 14 (block 2). Without a window every query reads from block 0."""
    blocks = Blocks(7, window=10)
    assert [blocks.first_live(p) for p in (0, 9, 15, 16, 23, 100)] == [0, 0, 0, 1, 2, 13]
    assert Blocks(7).first_live(100) == 0


def test_consecutive_positions_span_one_block_more_than_they_fill():
    """10 positions fill 2 blocks of 7 and fall on at most 3 (starting at offset 6); 8 on
    at most 2; 1 on 1."""
    blocks = Blocks(7)
    assert [blocks.span(n) for n in (1, 7, 8, 10)] == [7, 14, 14, 21]
    worst = max(len({p // 7 for p in range(s, s + 10)}) for s in range(7))
    assert blocks.span(10) == worst * 7


@pytest.mark.parametrize("unit, window", [(0, 0), (4, -1)])
def test_bad_sizes_are_refused(unit, window):
    with pytest.raises(ValueError, match="device_unit >= 1.*window >= 0"):
        Blocks(unit, window)
