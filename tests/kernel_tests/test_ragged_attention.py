"""The C++ ragged-span attention kernel over a paged KV pool, against a float64 NumPy textbook
reference and against the XLA path (`reference`): what only it has. The contract every
implementation keeps is tested in test_attention_contract.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import ragged_attention as ra
from kernel_tests.attention_cases import (
    BS,
    CAP,
    KV_LEN,
    NB,
    Q_LEN,
    Q_START,
    UNCOVERED,
    T,
    close,
    f64,
    i32,
    inputs,
    numpy_attention,
    shuffled_table,
    want,
    xla,
)

pytestmark = pytest.mark.skipif(not ra.available(), reason="kernel cannot be built here")


@jax.jit
def kernel(q, k, v, table, q_start, q_len, kv_len, layer=0):
    """The kernel under jit: spans, table and layer are traced."""
    return ra.ragged_attention(q, k, v, table, q_start, q_len, kv_len, layer)


def run(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0):
    return np.asarray(kernel(q, k, v, *i32(table, q_start, q_len, kv_len), layer))


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


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 8, 1), (64, 6, 6),
                                                     (128, 8, 2), (128, 9, 3), (256, 8, 4),
                                                     (16, 6, 2)])
def test_bf16_pool_matches_the_xla_path(storage, head_dim, heads, kv_heads):
    """bf16 pools: the avx512_bf16 path (head dims 64, 128, 256; decode spans and tiles of up to
    16 queries, 48 query vectors at a time) and the generic one (16). Both round q and the
    probabilities to bf16 as the XLA path does, so they differ from it by summation order
    and by a probability that lands on the other side of a bf16 rounding boundary (2^-8 of
    it: up to ~1e-3 on these values); from the exact result by bf16 rounding itself."""
    q, k, v = inputs(storage, seed=1, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    assert k.dtype == storage
    table = shuffled_table(seed=1)
    got = run(q, k, v, table)
    close(got, xla(q, k, v, table), tol=2e-3)
    np.testing.assert_allclose(got, want(q, k, v, table), atol=3e-2)  # bf16 vs exact
    assert not got[UNCOVERED].any()


def test_each_layer_is_read_by_python_int():
    """A static layer index (traced ones and clamping: test_attention_contract.py)."""
    q, k, v = inputs(jnp.float32, seed=4, layers=3)
    table = shuffled_table(seed=4)
    spans = i32(table, Q_START, Q_LEN, KV_LEN)
    for i in range(3):
        close(np.asarray(ra.ragged_attention(q, k, v, *spans, layer=i)),
              want(q, k, v, table, layer=i))


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


def test_bad_shapes_are_named():
    q, k, v = inputs(jnp.float32)
    table, q_start, q_len, kv_len = i32(shuffled_table(), Q_START, Q_LEN, KV_LEN)
    with pytest.raises(ValueError, match=r"table \(3, 8\)"):
        ra.ragged_attention(q, k, v, table[:3], q_start, q_len, kv_len)
    with pytest.raises(ValueError, match=r"kv_len \(6,\)"):
        ra.ragged_attention(q, k, v, table, q_start, q_len, kv_len[:6])
    with pytest.raises(ValueError, match="kv heads"):
        ra.ragged_attention(q[:, :5], k, v, table, q_start, q_len, kv_len)
    with pytest.raises(ValueError, match="float32, bfloat16, uint16 .* or int8"):
        ra.ragged_attention(q, k, v.astype(jnp.float16), table, q_start, q_len, kv_len)


# ---- write_and_attend: the step's keys and values written, then the spans attend --------------


def fresh_tokens(seed, heads=6, kv_heads=2, head_dim=16, tokens=T):
    """The step's projections before RoPE (q [T, H, D], kv [T, 2, Hkv, D]) and cos, sin
    [T, D/2] of arbitrary angles."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(tokens, heads, head_dim)).astype(np.float32)
    kv = rng.normal(size=(tokens, 2, kv_heads, head_dim)).astype(np.float32)
    angles = rng.uniform(-7, 7, size=(tokens, head_dim // 2)).astype(np.float32)
    return [jnp.asarray(a) for a in (q, kv, np.cos(angles), np.sin(angles))]


def numpy_rope(x, cos, sin):
    """x [T, n, D] rotated per token: the rotate-half convention, in float64."""
    x, c, s = (np.asarray(a, np.float64) for a in (x, cos, sin))
    h = x.shape[-1] // 2
    c, s = c[:, None], s[:, None]
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


@pytest.mark.parametrize("storage,head_dim,heads,kv_heads", [
    (jnp.float32, 16, 6, 2), (jnp.uint16, 16, 6, 2), (jnp.uint16, 64, 9, 3),
    (jnp.bfloat16, 128, 8, 2)])
def test_write_and_attend_writes_rotated_keys_then_attends(storage, head_dim, heads, kv_heads):
    """Against float64 NumPy: every span token's key (rotated) and value land at its position
    (nothing else in the pool changes; out-of-range blocks are skipped), and the output is
    the attention of the rotated queries over the updated pool; and against the jnp path."""
    _, k, v = inputs(storage, seed=11, head_dim=head_dim, heads=heads, kv_heads=kv_heads,
                     layers=2)
    q, kv, cos, sin = fresh_tokens(11, heads, kv_heads, head_dim)
    table = shuffled_table(seed=11)
    table[4, 3] = NB + 5  # row 4: positions 15..19 have no block (not written, not read)
    args = (q, kv, cos, sin, k, v, *i32(table, Q_START, Q_LEN, KV_LEN))
    out, k2, v2 = jax.jit(ra.write_and_attend)(*args, jnp.int32(1))
    want_out, want_k, want_v = jax.jit(ra.write_and_attend_reference)(*args, jnp.int32(1))
    bf16 = storage != jnp.float32
    # The pool: exactly the reference's writes (one bf16 rounding of the same f32 value, or
    # f32 up to the rotation's rounding).
    for got, expected in ((k2, want_k), (v2, want_v)):
        np.testing.assert_allclose(*f64(got, expected), rtol=2**-7 if bf16 else 1e-6,
                                   atol=1e-6)
    rows, pos = (np.asarray(a) for a in ra.token_rows(Q_START, Q_LEN, KV_LEN, T, CAP))
    rot_k = numpy_rope(kv[:, 0], cos, sin)
    written = np.zeros(np.asarray(k).shape[:4], bool)  # [L, NB, Hkv, BS]
    for token in np.flatnonzero(rows >= 0):
        block = table[rows[token], pos[token] // BS]
        if not 0 <= block < NB:
            continue
        written[1, block, :, pos[token] % BS] = True
        np.testing.assert_allclose(f64(k2)[0][1, block, :, pos[token] % BS], rot_k[token],
                                   rtol=2**-7 if bf16 else 1e-5, atol=1e-5)
    untouched = ~written
    np.testing.assert_array_equal(np.asarray(k2)[untouched], np.asarray(k)[untouched])
    np.testing.assert_array_equal(np.asarray(v2)[untouched], np.asarray(v)[untouched])
    # The output: rotated queries over the updated pool.
    rot_q = jnp.asarray(numpy_rope(q, cos, sin), jnp.float32)
    exact = numpy_attention(*f64(rot_q, k2, v2), table, Q_START, Q_LEN, KV_LEN, layer=1)
    np.testing.assert_allclose(np.asarray(out), exact, atol=3e-2 if bf16 else 2e-5)
    close(np.asarray(out), np.asarray(want_out), tol=2e-3 if bf16 else 2e-5)
    assert not np.asarray(out)[UNCOVERED].any()
