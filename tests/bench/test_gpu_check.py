"""scripts/gpu_check.py's arithmetic: token agreement and the bytes a decode step must read."""

from __future__ import annotations

from types import SimpleNamespace

from jaxpipe_bench.gpu_check import agreement, decode_bytes


def test_agreement_counts_tokens_before_the_first_difference():
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8], [9]]
    got = agreement(a, b)
    assert got["identical"] == 1 and got["of"] == 3
    assert got["token_agreement"] == (4 + 2 + 1) / (4 + 4 + 2)  # a later match does not count


def test_decode_bytes_are_the_weights_and_each_rows_kv():
    cfg = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, every layer and kv head, bf16
    assert decode_bytes(cfg, 270_000_000, batch=64, context=1024, kv_itemsize=2) == (
        270_000_000 + 64 * 1024 * per_token)
