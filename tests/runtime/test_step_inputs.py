"""The ragged step's host inputs (`runtime/step_inputs.py`) against what the kernel contract
says by hand: pieces end to end, each row's span, padding that points past the rows; a tick's
stack pads each slot to the tick's buckets and fills an empty slot with an idle step."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpipe.kernels.paged import OUT_OF_RANGE
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.step_inputs import Piece


def two_pieces():
    """A 3-token chunk at positions 5..7 and a decode token at position 9, fed from row 1."""
    return [Piece([11, 12, 13], 5, [4, 2]), Piece([0], 9, [7], feed=1)]


def test_pieces_lie_end_to_end_with_their_spans():
    x = step_inputs.build(two_pieces(), num_tokens=6, num_rows=3, max_blocks=4)
    np.testing.assert_array_equal(x.tokens, [11, 12, 13, 0, 0, 0])
    np.testing.assert_array_equal(x.positions, [5, 6, 7, 9, 0, 0])
    np.testing.assert_array_equal(x.rows, [0, 0, 0, 1, 3, 3])  # padding: row R
    np.testing.assert_array_equal(x.feed, [-1, -1, -1, 1, -1, -1])
    np.testing.assert_array_equal(x.q_start, [0, 3, 0])
    np.testing.assert_array_equal(x.q_len, [3, 1, 0])
    np.testing.assert_array_equal(x.kv_len, [8, 10, 0])
    np.testing.assert_array_equal(x.last, [2, 3, 0])
    o = OUT_OF_RANGE
    np.testing.assert_array_equal(x.table, [[4, 2, o, o], [7, o, o, o], [o, o, o, o]])
    assert (x.num_tokens, x.num_rows) == (6, 3)


def test_a_step_that_does_not_fit_is_refused_by_its_sizes():
    with pytest.raises(ValueError, match="2 pieces of 4 tokens do not fit a step of 3 tokens"):
        step_inputs.build(two_pieces(), num_tokens=3, num_rows=2, max_blocks=4)
    x = step_inputs.build(two_pieces(), 6, 3, 4)
    with pytest.raises(ValueError, match="a step of 6 tokens and 3 rows does not fit"):
        step_inputs.pad(x, 4, 3)


def test_padding_keeps_every_row_and_token_and_points_padding_at_the_new_last_row():
    small = step_inputs.build(two_pieces(), 4, 2, 4)
    big = step_inputs.pad(small, 6, 3)
    direct = step_inputs.build(two_pieces(), 6, 3, 4)
    for got, want in zip(big, direct, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_tick_stacks_one_slot_per_stage_with_idle_slots():
    x = step_inputs.build(two_pieces(), 4, 2, 4)
    tick = step_inputs.stack([None, x, None], num_tokens=8, num_rows=4)
    assert tick.tokens.shape == (3, 8) and tick.table.shape == (3, 4, 4)
    np.testing.assert_array_equal(tick.q_len[1], [3, 1, 0, 0])
    for idle in (0, 2):  # no token, every row empty, every token padding
        assert not tick.q_len[idle].any() and (tick.rows[idle] == 4).all()
        assert (tick.table[idle] == OUT_OF_RANGE).all() and (tick.feed[idle] == -1).all()
