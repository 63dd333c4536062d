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


def test_the_table_has_a_roofline_line_per_batch_and_no_parity_when_skipped():
    from jaxpipe_bench.gpu_check import format_table

    steps = [{"batch": b, "step_ms": 1.0, "bytes": 2**30, "fraction_of_measured": 0.5}
             for b in (1, 64)]
    record = {"device": "X", "jax": "0", "roofline": {"attention": "pallas", "context": 1024,
                                                      "measured_bandwidth_gbs": 100.0,
                                                      "steps": steps}}
    text = format_table(record)
    assert "decode 1x1024" in text and "decode 64x1024" in text and "parity" not in text


def test_a_decode_step_reads_the_embedding_table_only_as_its_lm_head():
    import numpy as np

    from jaxpipe_bench.gpu_check import read_weight_bytes

    layers = {"wq": np.zeros((2, 8, 8), np.float32)}
    table = np.zeros((100, 8), np.float32)
    assert read_weight_bytes({**layers, "embed": table}) == layers["wq"].nbytes + table.nbytes
    assert read_weight_bytes({**layers, "embed": table, "lm_head": table.T}) == (
        layers["wq"].nbytes + table.nbytes)
