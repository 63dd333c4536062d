"""The Pallas ragged-span attention kernel (GPU's), run in Pallas' interpret mode on CPU, on
the C++ kernel's cases against the float64 NumPy reference: spans of 1 to a whole row and
prime lengths across block boundaries, scattered blocks, GQA, bf16 pools, layers, the
contract's out-of-range rules and empty steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    BS,
    CAP,
    KV_LEN,
    NB,
    Q_LEN,
    Q_START,
    UNCOVERED,
    D,
    H,
    R,
    T,
    close,
    i32,
    inputs,
    shuffled_table,
    want,
    xla,
)

from jaxpipe.kernels import pallas_attention as pa


@jax.jit
def kernel(q, k, v, table, q_start, q_len, kv_len, layer=0):
    """The kernel under jit in interpret mode: spans, table and layer are traced."""
    return pa.pallas_attention(q, k, v, table, q_start, q_len, kv_len, layer, interpret=True)


def run(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
    return np.asarray(kernel(q, k, v, *i32(table, q_start, q_len, kv_len), layer))


@pytest.mark.parametrize("head_dim", [D, 64])
@pytest.mark.parametrize("heads,kv_heads", [(H, 2), (5, 5), (9, 3)])  # GQA 3, none, SmolLM2's
def test_f32_matches_numpy(head_dim, heads, kv_heads):
    q, k, v = inputs(jnp.float32, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    table = shuffled_table()
    got = run(q, k, v, table)
    close(got, want(q, k, v, table))
    assert not got[UNCOVERED].any() and np.delete(got, UNCOVERED, 0).all()


def test_decode_is_a_span_of_one():
    """One query per row at position kv_len - 1 (decode), rows in reverse token order."""
    q, k, v = inputs(jnp.float32, seed=2, tokens=R)
    table = shuffled_table(seed=2)
    spans = dict(q_start=list(range(R))[::-1], q_len=[1, 1, 1, 0, 1, 1, 1],
                 kv_len=[1, CAP, 6, 9, 10, 23, 37])
    got = run(q, k, v, table, **spans)
    close(got, want(q, k, v, table, **spans))
    assert not got[R - 1 - 3].any()


def test_tiles_split_long_spans_and_keep_the_rest():
    """A span of three tiles (37 queries, a prime), one of exactly one tile (16) and short
    ones beside them."""
    q, k, v = inputs(jnp.float32, seed=12, tokens=40 + 17)
    table = shuffled_table(seed=12)
    spans = dict(q_start=[0, 37, 56, 40, 56, 56, 56], q_len=[37, 3, 1, 16, 0, 0, 0],
                 kv_len=[39, 3, 40, 17, 1, 1, 1])
    close(run(q, k, v, table, **spans), want(q, k, v, table, **spans))


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
def test_bf16_pool_matches_numpy_and_the_xla_path(storage):
    q, k, v = inputs(storage, seed=1, head_dim=64)
    table = shuffled_table(seed=1)
    got = run(q, k, v, table)
    # q and probabilities rounded to bf16 as the XLA path does; the probabilities before
    # normalisation (online softmax), so agreement to bf16 rounding.
    np.testing.assert_allclose(got, xla(q, k, v, table), atol=1e-2)
    np.testing.assert_allclose(got, want(q, k, v, table), atol=3e-2)


def test_each_layer_by_traced_index_and_clamped():
    q, k, v = inputs(jnp.float32, seed=4, layers=3)
    table = shuffled_table(seed=4)
    wants = [want(q, k, v, table, layer=i) for i in range(3)]
    for i in range(3):
        close(run(q, k, v, table, layer=jnp.int32(i)), wants[i])
    close(run(q, k, v, table, layer=jnp.int32(7)), wants[2])
    close(run(q, k, v, table, layer=jnp.int32(-1)), wants[0])


def test_unread_data_changes_nothing():
    """Unused blocks, another layer, and positions past each row's kv_len are never read."""
    q, k, v = inputs(jnp.float32, seed=6, layers=2)
    table = shuffled_table(seed=6)
    got = run(q, k, v, table, layer=1)
    k2, v2 = np.array(k), np.array(v)
    unused = np.setdiff1d(np.arange(NB), table)
    k2[1, unused], v2[1, unused] = 100.0, -7.0
    k2[0], v2[0] = 50.0, 50.0
    for r, n in enumerate(KV_LEN):
        for t in range(n if Q_LEN[r] else 0, CAP):
            k2[1, table[r, t // BS], :, t % BS] = v2[1, table[r, t // BS], :, t % BS] = 1e4
    np.testing.assert_array_equal(run(q, jnp.asarray(k2), jnp.asarray(v2), table, layer=1), got)


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


@pytest.mark.parametrize("tokens,rows,max_blocks", [(0, R, 8), (T, 0, 8), (T, R, 0)])
def test_empty_steps(tokens, rows, max_blocks):
    q, k, v = inputs(jnp.float32, seed=11, tokens=tokens)
    table = shuffled_table(seed=11)[:rows, :max_blocks]
    spans = [x[:rows] for x in (Q_START, Q_LEN, KV_LEN)]
    got = run(q, k, v, table, *spans)
    assert got.shape == (tokens, H, D) and not got.any()


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
