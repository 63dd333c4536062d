"""The ragged-span attention contract, on every implementation the step can use: the C++ CPU
kernel ("cpu"), the Pallas kernel in interpret mode ("pallas-interpret") and the XLA path
("xla"), each against the float64 NumPy reference on the shared cases (attention_cases.py).
What only one implementation has (tolerances of its bf16 path, its shape checks, its helpers)
is tested in that implementation's module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import ragged_attention as ra
from kernel_tests.attention_cases import (
    BS,
    CAP,
    HKV,
    IMPLS,
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
)


@pytest.fixture(params=list(IMPLS))
def run(request):
    """run(q, k, v, table, q_start, q_len, kv_len, layer) with one implementation, under jit
    (spans, table and layer traced)."""
    if request.param == "cpu" and not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    kernel = jax.jit(IMPLS[request.param])

    def call(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
        return np.asarray(kernel(q, k, v, *i32(table, q_start, q_len, kv_len),
                                 jnp.int32(layer)))

    return call


@pytest.mark.parametrize("head_dim", [D, 64, 128])  # 64, 128: the C++ kernel specialises
@pytest.mark.parametrize("heads,kv_heads", [(H, HKV), (5, 5), (9, 3)])  # GQA, none, SmolLM2's
def test_f32_matches_numpy(run, head_dim, heads, kv_heads):
    q, k, v = inputs(jnp.float32, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    table = shuffled_table()
    got = run(q, k, v, table)
    close(got, want(q, k, v, table))
    assert not got[UNCOVERED].any() and np.delete(got, UNCOVERED, 0).all()


def test_decode_is_a_span_of_one(run):
    """One query per row at position kv_len - 1 (decode), rows in reverse token order."""
    q, k, v = inputs(jnp.float32, seed=2, tokens=R)
    table = shuffled_table(seed=2)
    spans = dict(q_start=list(range(R))[::-1], q_len=[1, 1, 1, 0, 1, 1, 1],
                 kv_len=[1, CAP, 6, 9, 10, 23, 37])
    got = run(q, k, v, table, **spans)
    close(got, want(q, k, v, table, **spans))
    assert not got[R - 1 - 3].any()


def test_long_spans_and_short_ones_beside_them(run):
    """A span of 37 queries (a prime; three of the Pallas kernel's tiles), one of exactly 16
    (one tile) and short ones beside them."""
    q, k, v = inputs(jnp.float32, seed=12, tokens=40 + 17)
    table = shuffled_table(seed=12)
    spans = dict(q_start=[0, 37, 56, 40, 56, 56, 56], q_len=[37, 3, 1, 16, 0, 0, 0],
                 kv_len=[39, 3, 40, 17, 1, 1, 1])
    close(run(q, k, v, table, **spans), want(q, k, v, table, **spans))


def test_each_layer_by_traced_index_and_clamped(run):
    q, k, v = inputs(jnp.float32, seed=4, layers=3)
    table = shuffled_table(seed=4)
    wants = [want(q, k, v, table, layer=i) for i in range(3)]
    assert not np.allclose(wants[0], wants[1])  # the layers' data differ
    for i in range(3):
        close(run(q, k, v, table, layer=i), wants[i])
    # Out-of-range layer indices are clamped to [0, L).
    close(run(q, k, v, table, layer=7), wants[2])
    close(run(q, k, v, table, layer=-1), wants[0])


def test_unread_data_changes_nothing(run):
    """Unused blocks, another layer, and positions past each row's kv_len are never read."""
    q, k, v = inputs(jnp.float32, seed=6, layers=2)
    table = shuffled_table(seed=6)
    got = run(q, k, v, table, layer=1)
    k2, v2 = np.array(k), np.array(v)
    unused = np.setdiff1d(np.arange(NB), table)
    k2[1, unused], v2[1, unused] = 100.0, -7.0
    k2[0], v2[0] = 50.0, 50.0  # the layer not read
    for r, n in enumerate(KV_LEN):
        for t in range(n if Q_LEN[r] else 0, CAP):  # the idle row reads nothing at all
            k2[1, table[r, t // BS], :, t % BS] = v2[1, table[r, t // BS], :, t % BS] = 1e4
    np.testing.assert_array_equal(run(q, jnp.asarray(k2), jnp.asarray(v2), table, layer=1), got)


@pytest.mark.parametrize("tokens,rows,max_blocks", [(0, R, 8), (T, 0, 8), (T, R, 0)])
def test_empty_steps(run, tokens, rows, max_blocks):
    """No tokens, no rows, or tables with no blocks: zeros of the right shape, no crash."""
    q, k, v = inputs(jnp.float32, seed=11, tokens=tokens)
    table = shuffled_table(seed=11)[:rows, :max_blocks]
    spans = [x[:rows] for x in (Q_START, Q_LEN, KV_LEN)]
    got = run(q, k, v, table, *spans)
    assert got.shape == (tokens, H, D) and not got.any()
