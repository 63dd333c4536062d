"""The synthetic step's inputs (pure host arrays on a stand-in runner) and median_seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.synthetic_step import median_seconds, padding_inputs, uniform_inputs


def _runner(num_blocks: int = 64):
    return SimpleNamespace(buckets=Buckets.for_engine(8, 256, 512), num_blocks=num_blocks,
                           max_blocks=16)


def test_padding_step_has_the_bucket_and_no_row():
    runner = _runner()
    tokens = runner.buckets.step_tokens[-1]
    step = padding_inputs(runner, tokens)
    rows = runner.buckets.rows(tokens)
    assert step.tokens.size == tokens
    assert (step.rows == rows).all()  # every token is padding: it writes no KV
    assert (step.q_len == 0).all()


def test_uniform_decode_rows_sit_at_the_contexts_end_in_their_own_blocks():
    step = uniform_inputs(_runner(), 3, 1, start=2 * BLOCK + 4)
    assert step.q_len[:3].tolist() == [1, 1, 1]
    assert step.kv_len[:3].tolist() == [2 * BLOCK + 5] * 3
    assert step.table[1, :3].tolist() == [3, 4, 5]  # three blocks per row, row 1's next


def test_too_many_blocks_names_the_numbers():
    with pytest.raises(ValueError, match=r"4 sequences of 64 positions need 16 KV blocks; "
                                         r"the runner has 8"):
        uniform_inputs(_runner(num_blocks=8), 4, 64)


def test_median_seconds_compiles_once_then_times_each_repeat():
    calls = []
    seconds = median_seconds(lambda: calls.append(1), 5)
    assert len(calls) == 6 and seconds >= 0


def test_uniform_steps_feed_many_token_ids_each_in_every_vocabulary():
    """One id for every token would send every token of an MoE model to the same experts."""
    step = uniform_inputs(_runner(), 4, 32)
    fed = step.tokens[step.rows < 4]
    assert len(set(fed.tolist())) > 50 and fed.min() >= 1 and fed.max() < 200
