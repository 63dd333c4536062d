"""Static shapes of the step: token buckets and the rows the LM head and sampler run on."""

from __future__ import annotations

from jaxpipe.runtime.buckets import Buckets, round_up


def test_sampled_rows_are_powers_of_two_then_multiples_of_32_capped_at_max_rows():
    b = Buckets.for_engine(max_num_seqs=224, max_model_len=1536, max_num_batched_tokens=4096)
    got = [b.sample_rows(n) for n in (1, 2, 3, 5, 16, 17, 32, 33, 88, 96, 97, 200, 224)]
    assert got == [1, 2, 4, 8, 16, 32, 32, 64, 96, 96, 128, 224, 224]
    rows = b.sample_row_buckets()
    assert rows == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224]
    assert all(b.sample_rows(n) >= n and b.sample_rows(n) in rows for n in range(1, 225))


def test_every_step_size_has_a_token_bucket_holding_it():
    b = Buckets.for_engine(max_num_seqs=224, max_model_len=1536, max_num_batched_tokens=4096)
    assert b.step_tokens[-1] == 4096
    assert all(round_up(n, b.step_tokens) >= n for n in range(1, 4097))
    assert all(b.rows(t) == min(t, 224) for t in b.step_tokens)
