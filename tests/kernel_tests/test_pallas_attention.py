"""The Pallas ragged-span attention kernel (GPU's), run in Pallas' interpret mode on CPU, on
the C++ kernel's cases against the float64 NumPy reference: what only it has (its bf16
rounding, the out-of-range rules through its tiles, the scan over layers). Spans of 1 to a
whole row, GQA, layers, unread data and empty steps: test_attention_contract.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import pallas_attention as pa
from kernel_tests.attention_cases import (
    CAP,
    KV_LEN,
    NB,
    Q_LEN,
    Q_START,
    close,
    i32,
    inputs,
    shuffled_table,
    want,
    xla,
)


@jax.jit
def kernel(q, k, v, table, q_start, q_len, kv_len, layer=0):
    """The kernel under jit in interpret mode: spans, table and layer are traced."""
    return pa.pallas_attention(q, k, v, table, q_start, q_len, kv_len, layer, interpret=True)


def run(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
    return np.asarray(kernel(q, k, v, *i32(table, q_start, q_len, kv_len), layer))


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
def test_bf16_pool_matches_numpy_and_the_xla_path(storage):
    q, k, v = inputs(storage, seed=1, head_dim=64)
    table = shuffled_table(seed=1)
    got = run(q, k, v, table)
    # q and probabilities rounded to bf16 as the XLA path does; the probabilities before
    # normalisation (online softmax), so agreement to bf16 rounding.
    np.testing.assert_allclose(got, xla(q, k, v, table), atol=1e-2)
    np.testing.assert_allclose(got, want(q, k, v, table), atol=3e-2)


def test_out_of_range_lengths_spans_and_table_entries():
    q, k, v = inputs(jnp.float32, seed=7)
    table = shuffled_table(seed=7)
    cases = [dict(kv_len=[23, -4, 4, 31, 35, CAP + 13, 11], q_len=[-1, 2, 7, 13, 29, CAP, 0]),
             dict(q_start=[73, 30, 94, 1000, -3, 33, 5])]
    zeros = [[73, 30, 31, 92, 93, 94], [*range(26, 30), *range(74, 87)]]
    for spans, zero in zip(cases, zeros, strict=True):
        got = run(q, k, v, table, **spans)
        close(got, want(q, k, v, table, **spans))
        assert not got[zero].any()
    bad = table.copy()
    bad[4, 3], bad[3, 0], bad[0, 5:] = NB, -1, [NB, -1, 2**31 - 1]
    out = run(q, k, v, bad)
    close(out, want(q, k, v, bad))
    assert not out[74:87].any()


def test_scan_over_layers_reads_the_stacked_pool():
    """The engine's use: the stage's whole pool inside a `lax.scan`, layer = the scan index."""
    q, k, v = inputs(jnp.uint16, seed=5, layers=3)
    spans = i32(shuffled_table(seed=5), Q_START, Q_LEN, KV_LEN)

    @jax.jit
    def all_layers(k, v):
        def body(carry, i):
            return carry, pa.pallas_attention(q, k, v, *spans, i, interpret=True)

        return jax.lax.scan(body, 0, jnp.arange(3))[1]

    got = np.asarray(all_layers(k, v))
    for i in range(3):
        np.testing.assert_allclose(got[i], xla(q, k, v, spans[0], layer=i), atol=1e-2)


@pytest.mark.parametrize("tiles", [pa.Tiles(tq=1), pa.Tiles(tq=4), pa.Tiles(tq=32, num_warps=8)])
def test_every_tile_size_gives_the_reference(tiles):
    """The tile cut (queries per tile; Triton's warps and stages, unused when interpreted) is a
    performance choice only: spans shorter and longer than a tile, over the float64 reference."""
    q, k, v = inputs(jnp.float32, seed=3)
    table = shuffled_table(seed=3)
    got = jax.jit(lambda *a: pa.pallas_attention(*a, interpret=True, tiles=tiles))(
        q, k, v, *i32(table, Q_START, Q_LEN, KV_LEN))
    close(np.asarray(got), want(q, k, v, table))


@pytest.mark.parametrize("bad", [dict(tq=3), dict(tq=0), dict(num_warps=0), dict(num_stages=-1)])
def test_tiles_refuse_what_the_kernel_cannot_cut(bad):
    with pytest.raises(ValueError, match="Tiles"):
        pa.Tiles(**bad)


def test_a_device_kind_without_measured_tiles_gets_the_default():
    assert pa.tiles_for("an unknown accelerator") == pa.DEFAULT_TILES
