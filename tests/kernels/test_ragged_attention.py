"""The C++ ragged-span attention kernel over a paged KV pool, against a float64 NumPy textbook
reference and against the XLA path (`reference`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import ragged_attention as ra
from jaxpipe.kv.device_cache import from_storage, to_storage

pytestmark = pytest.mark.skipif(not ra.available(), reason="kernel cannot be built here")

# Prime-ish sizes so that a swapped axis fails loudly. A pool of NB blocks of BS tokens; each
# row's table has MB entries (MB * BS = 40 positions); R * MB = 56 < NB: some blocks unused.
H, HKV, D = 6, 2, 16
BS, MB, NB = 5, 8, 61
CAP = MB * BS
# Row r's span: Q_LEN[r] queries ending at position KV_LEN[r] - 1, tokens Q_START[r].. of q.
# Decode (1), spans of 2, 7 (no prefix), 13, 29 and a whole row (40), an idle row (0); tiles of
# 16 split the longer ones; spans cross block boundaries. In q the spans are out of row order,
# with tokens 0, 32, 87, 95, 96 in no span.
Q_LEN = [1, 2, 7, 13, 29, CAP, 0]
KV_LEN = [23, 11, 7, 31, 35, CAP, 11]
Q_START = [73, 30, 88, 74, 1, 33, 5]
R, T = len(Q_LEN), 97
UNCOVERED = [0, 32, 87, 95, 96]


def numpy_attention(q, k, v, table, q_start, q_len, kv_len, layer=0):
    """Textbook softmax(q·kᵀ/√D)·v in float64, query by query, each key found by walking the
    row's table: position t is k[layer, table[r, t // BS], :, t % BS]. Applies the contract's
    clamping rules itself."""
    num_tokens, heads, d = q.shape
    g, bs, nb = heads // k.shape[2], k.shape[3], k.shape[1]
    out = np.zeros((num_tokens, heads, d))
    for r in range(len(q_len)):
        kv = min(max(kv_len[r], 0), table.shape[1] * bs)
        ql = min(max(q_len[r], 0), kv)
        bad = [j for j in range(-(-kv // bs)) if not 0 <= table[r, j] < nb]
        usable = bad[0] * bs if bad else kv
        for i in range(ql):
            token, n = q_start[r] + i, min(kv - ql + i + 1, usable)
            if not 0 <= token < num_tokens or n <= 0:
                continue
            blocks = [table[r, t // bs] for t in range(n)]
            keys = np.stack([k[layer, b, :, t % bs] for t, b in enumerate(blocks)], 1)
            vals = np.stack([v[layer, b, :, t % bs] for t, b in enumerate(blocks)], 1)
            for head in range(heads):  # keys, vals [Hkv, n, D]
                s = keys[head // g] @ q[token, head] / np.sqrt(d)
                p = np.exp(s - s.max())
                out[token, head] = (p / p.sum()) @ vals[head // g]
    return out


def shuffled_table(seed=0):
    """[R, MB]: each row's blocks scattered over the pool; NB - R * MB blocks unused."""
    perm = np.random.default_rng(seed).permutation(NB)
    return perm[: R * MB].reshape(R, MB).astype(np.int32)


def inputs(storage, seed=0, head_dim=D, layers=1, heads=H, kv_heads=HKV, tokens=T):
    """q [T, H, D] f32; k, v [layers, NB, Hkv, BS, D] in `storage` (float32, uint16 = bf16
    bits, or bfloat16)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(tokens, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(layers, NB, kv_heads, BS, head_dim)).astype(np.float32)
    v = rng.normal(size=(layers, NB, kv_heads, BS, head_dim)).astype(np.float32)
    store = jnp.zeros((1,), storage)
    return jnp.asarray(q), to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)


def f64(*arrays):
    """float64 copies (a u16 pool holds bf16 bits)."""
    return [np.asarray(from_storage(jnp.asarray(a)), np.float64) for a in arrays]


def i32(*arrays):
    return [jnp.asarray(a, jnp.int32) for a in arrays]


@jax.jit
def kernel(q, k, v, table, q_start, q_len, kv_len, layer=0):
    """The kernel under jit: spans, table and layer are traced."""
    return ra.ragged_attention(q, k, v, table, q_start, q_len, kv_len, layer)


def run(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
    return np.asarray(kernel(q, k, v, *i32(table, q_start, q_len, kv_len), layer))


def want(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
    return numpy_attention(*f64(q, k, v), np.asarray(table), q_start, q_len, kv_len, layer)


def xla(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, max_kv=None):
    fn = jax.jit(functools.partial(ra.reference, max_kv=max_kv))
    return np.asarray(fn(q, k, v, *i32(table, q_start, q_len, kv_len), jnp.int32(layer)))


def close(got, expected, tol=2e-5):
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [D, 64, 128])  # 64, 128: compile-time specialised
@pytest.mark.parametrize("heads,kv_heads", [(H, HKV), (5, 5)])  # GQA and one head per kv head
def test_f32_matches_numpy(head_dim, heads, kv_heads):
    q, k, v = inputs(jnp.float32, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    table = shuffled_table()
    got = run(q, k, v, table)
    close(got, want(q, k, v, table))
    assert not got[UNCOVERED].any() and np.delete(got, UNCOVERED, 0).all()


def test_reference_matches_numpy():
    q, k, v = inputs(jnp.float32, seed=3)
    table = shuffled_table(seed=3)
    close(xla(q, k, v, table), want(q, k, v, table))
    # A static max_kv covering every row but the whole-row span (row 5, tokens 33..72).
    short = np.delete(xla(q, k, v, table, max_kv=35), np.s_[33:73], 0)
    close(short, np.delete(want(q, k, v, table), np.s_[33:73], 0))


def test_token_rows_places_each_token():
    rows, pos = (np.asarray(x) for x in ra.token_rows(*i32(Q_START, Q_LEN, KV_LEN), T, CAP))
    assert (rows[UNCOVERED] == -1).all() and (pos[UNCOVERED] == -1).all()
    for r, (start, n, kv) in enumerate(zip(Q_START, Q_LEN, KV_LEN, strict=True)):
        np.testing.assert_array_equal(rows[start:start + n], r)
        np.testing.assert_array_equal(pos[start:start + n], np.arange(kv - n, kv))
    assert (rows >= 0).sum() == sum(Q_LEN)


def test_decode_is_a_span_of_one():
    """One query per row at position kv_len - 1 (decode), rows in reverse token order."""
    q, k, v = inputs(jnp.float32, seed=2, tokens=R)
    table = shuffled_table(seed=2)
    spans = dict(q_start=list(range(R))[::-1], q_len=[1, 1, 1, 0, 1, 1, 1],
                 kv_len=[1, CAP, 6, 9, 10, 23, 37])
    got = run(q, k, v, table, **spans)
    close(got, want(q, k, v, table, **spans))
    assert not got[R - 1 - 3].any()


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
def test_bf16_pool_matches_the_xla_path(storage):
    q, k, v = inputs(storage, seed=1, head_dim=64)
    assert k.dtype == storage
    table = shuffled_table(seed=1)
    got = run(q, k, v, table)
    # Same roundings (q and probabilities to bf16), different summation order.
    close(got, xla(q, k, v, table), tol=1e-4)
    np.testing.assert_allclose(got, want(q, k, v, table), atol=3e-2)  # bf16 vs exact


def test_each_layer_is_read_by_python_int_and_by_traced_index():
    q, k, v = inputs(jnp.float32, seed=4, layers=3)
    table = shuffled_table(seed=4)
    wants = [want(q, k, v, table, layer=i) for i in range(3)]
    assert not np.allclose(wants[0], wants[1])  # the layers' data differ
    spans = i32(table, Q_START, Q_LEN, KV_LEN)
    for i in range(3):
        close(np.asarray(ra.ragged_attention(q, k, v, *spans, layer=i)), wants[i])
        close(run(q, k, v, table, layer=jnp.int32(i)), wants[i])
        close(xla(q, k, v, table, layer=i), wants[i])
    # Out-of-range layer indices are clamped to [0, L).
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
    k2[0], v2[0] = 50.0, 50.0  # the layer not read
    for r, n in enumerate(KV_LEN):
        for t in range(n if Q_LEN[r] else 0, CAP):  # the idle row reads nothing at all
            k2[1, table[r, t // BS], :, t % BS] = v2[1, table[r, t // BS], :, t % BS] = 1e4
    np.testing.assert_array_equal(run(q, jnp.asarray(k2), jnp.asarray(v2), table, layer=1), got)


def test_out_of_range_lengths_and_spans():
    q, k, v = inputs(jnp.float32, seed=7)
    table = shuffled_table(seed=7)
    # kv_len over capacity (row 5) clamps to CAP; q_len over kv_len (row 2: 7 -> 4, tokens
    # 92..94 in no span); negative q_len (row 0) or kv_len (row 1): idle.
    cases = [dict(kv_len=[23, -4, 4, 31, 35, CAP + 13, 11], q_len=[-1, 2, 7, 13, 29, CAP, 0]),
             # Span tokens outside [0, T): row 4 starts at -3, row 2 runs past T, row 3 at 1000.
             dict(q_start=[73, 30, 94, 1000, -3, 33, 5])]
    zeros = [[73, 30, 31, 92, 93, 94], [*range(26, 30), *range(74, 87)]]
    for spans, zero in zip(cases, zeros, strict=True):
        got = run(q, k, v, table, **spans)
        close(got, want(q, k, v, table, **spans))
        close(xla(q, k, v, table, **spans), got)
        assert not got[zero].any()
    np.testing.assert_array_equal(run(q, k, v, table, **cases[0])[33:73],
                                  run(q, k, v, table)[33:73])  # clamped kv_len: same output


def test_out_of_range_table_entries():
    q, k, v = inputs(jnp.float32, seed=8)
    table = shuffled_table(seed=8)
    got = run(q, k, v, table)
    # Beyond the blocks a row needs (row 0: 23 positions, blocks 0..4): never looked at.
    past = table.copy()
    past[0, 5:] = [NB, -1, 2**31 - 1]
    np.testing.assert_array_equal(run(q, k, v, past), got)
    # Row 4 (positions 6..34, tokens 1..29), block 3 bad: queries at positions < 15 unchanged,
    # later ones attend keys 0..14 only. Row 3, block 0 bad: zeros. Others unchanged.
    for bad in (NB, -3, 10**9):
        inside = table.copy()
        inside[4, 3], inside[3, 0] = bad, -1
        out = run(q, k, v, inside)
        close(out, want(q, k, v, inside))
        close(xla(q, k, v, inside), out)
        np.testing.assert_array_equal(out[1:10], got[1:10])  # positions 6..14
        assert not np.allclose(out[10:30], got[10:30])
        assert not out[74:87].any()
        np.testing.assert_array_equal(out[30:74], got[30:74])


def test_rank4_pool_equals_rank5_with_one_layer():
    q, k, v = inputs(jnp.uint16, seed=9)
    table = shuffled_table(seed=9)
    np.testing.assert_array_equal(run(q, k[0], v[0], table), run(q, k, v, table))


def test_scan_over_layers_reads_the_stacked_pool():
    """The engine's use: the stage's whole pool inside a `lax.scan`, layer = the scan index."""
    q, k, v = inputs(jnp.uint16, seed=5, layers=3)
    spans = i32(shuffled_table(seed=5), Q_START, Q_LEN, KV_LEN)

    @jax.jit
    def all_layers(k, v):
        def body(carry, i):
            return carry, ra.ragged_attention(q, k, v, *spans, i)

        return jax.lax.scan(body, 0, jnp.arange(3))[1]  # [L, T, H, D]

    got = np.asarray(all_layers(k, v))
    for i in range(3):
        close(got[i], np.asarray(ra.reference(q, k, v, *spans, i)), tol=1e-4)


@pytest.mark.parametrize("tokens,rows,max_blocks", [(0, R, MB), (T, 0, MB), (T, R, 0)])
def test_empty_steps(tokens, rows, max_blocks):
    """No tokens, no rows, or tables with no blocks: zeros of the right shape, no crash."""
    q, k, v = inputs(jnp.float32, seed=11, tokens=tokens)
    table = shuffled_table(seed=11)[:rows, :max_blocks]
    spans = [x[:rows] for x in (Q_START, Q_LEN, KV_LEN)]
    for got in (run(q, k, v, table, *spans), xla(q, k, v, table, *spans)):
        assert got.shape == (tokens, H, D) and not got.any()


def test_bad_shapes_are_named():
    q, k, v = inputs(jnp.float32)
    table, q_start, q_len, kv_len = i32(shuffled_table(), Q_START, Q_LEN, KV_LEN)
    with pytest.raises(ValueError, match=r"table \(3, 8\)"):
        ra.ragged_attention(q, k, v, table[:3], q_start, q_len, kv_len)
    with pytest.raises(ValueError, match=r"kv_len \(6,\)"):
        ra.ragged_attention(q, k, v, table, q_start, q_len, kv_len[:6])
    with pytest.raises(ValueError, match="kv heads"):
        ra.ragged_attention(q[:, :5], k, v, table, q_start, q_len, kv_len)
    with pytest.raises(ValueError, match="float32, bfloat16 or uint16"):
        ra.ragged_attention(q, k, v.astype(jnp.float16), table, q_start, q_len, kv_len)
