"""The C++ decode attention kernel over a paged KV pool, against a NumPy reference and against
the XLA path (`reference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import decode_attention as da
from jaxpipe.kv.device_cache import to_storage

pytestmark = pytest.mark.skipif(not da.available(), reason="kernel cannot be built here")

# Prime-ish sizes so that a swapped axis fails loudly. A pool of NB blocks of BS tokens; each
# row's table has MB entries (MB * BS = 40 positions); B * MB = 56 < NB: some blocks are unused.
B, H, HKV, D = 7, 6, 2, 16
BS, MB, NB = 5, 8, 61
CAP = MB * BS
LENGTHS = [1, CAP, 0, 5, 23, CAP - 1, 10]  # idle (0), 1, multiples of BS, full (MB * BS)


def numpy_attention(q, k, v, lengths, table, layer=0):
    """Textbook softmax(q·kᵀ/√D)·v in float64, per row over its first `length` positions, each
    found by walking the row's table: position t is k[layer, table[b, t // BS], :, t % BS]."""
    b, h, d = q.shape
    g = h // k.shape[2]
    bs = k.shape[3]
    out = np.zeros((b, h, d))
    for r in range(b):
        n = lengths[r]
        blocks = [table[r, t // bs] for t in range(n)]
        keys = np.stack([k[layer, blk, :, t % bs] for t, blk in enumerate(blocks)], 1) if n else 0
        vals = np.stack([v[layer, blk, :, t % bs] for t, blk in enumerate(blocks)], 1) if n else 0
        for head in range(h if n else 0):  # keys, vals [Hkv, n, D]
            s = keys[head // g] @ q[r, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[r, head] = (p / p.sum()) @ vals[head // g]
    return out


def shuffled_table(seed=0):
    """[B, MB]: each row's blocks scattered over the pool; NB - B * MB blocks unused."""
    perm = np.random.default_rng(seed).permutation(NB)
    return perm[: B * MB].reshape(B, MB).astype(np.int32)


def inputs(storage, seed=0, head_dim=D, layers=1):
    """q [B, H, D] f32; k, v [layers, NB, Hkv, BS, D] in `storage` (float32, uint16 = bf16
    bits, or bfloat16)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, head_dim)).astype(np.float32)
    k = rng.normal(size=(layers, NB, HKV, BS, head_dim)).astype(np.float32)
    v = rng.normal(size=(layers, NB, HKV, BS, head_dim)).astype(np.float32)
    store = jnp.zeros((1,), storage)
    return jnp.asarray(q), to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)


def f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def run(q, k, v, lengths, table, layer=0):
    return np.asarray(jax.jit(da.decode_attention)(q, k, v, jnp.asarray(lengths, jnp.int32),
                                                   jnp.asarray(table), layer))


@pytest.mark.parametrize("head_dim", [D, 64])  # 64: the compile-time specialised path
def test_f32_matches_numpy_with_a_shuffled_table(head_dim):
    q, k, v = inputs(jnp.float32, head_dim=head_dim)
    table = shuffled_table()
    got = run(q, k, v, LENGTHS, table)
    want = numpy_attention(*f64(q, k, v), LENGTHS, table)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_reference_matches_numpy():
    q, k, v = inputs(jnp.float32, seed=3)
    table = shuffled_table(seed=3)
    got = np.asarray(da.reference(q, k, v, jnp.asarray(LENGTHS), jnp.asarray(table)))
    want = numpy_attention(*f64(q, k, v), LENGTHS, table)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
def test_bf16_pool_matches_the_xla_path(storage):
    q, k, v = inputs(storage, seed=1)
    assert k.dtype == storage
    table = jnp.asarray(shuffled_table(seed=1))
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    got = run(q, k, v, lengths, table)
    want = np.asarray(da.reference(q, k, v, lengths, table))
    # Same roundings (q and probabilities to bf16), different summation order.
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_each_layer_is_read_by_python_int_and_by_traced_index():
    q, k, v = inputs(jnp.float32, seed=4, layers=3)
    table = shuffled_table(seed=4)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    wants = [numpy_attention(*f64(q, k, v), LENGTHS, table, layer=i) for i in range(3)]
    assert not np.allclose(wants[0], wants[1])  # the layers' data differ
    traced = jax.jit(lambda i: da.decode_attention(q, k, v, lengths, jnp.asarray(table), i))
    for i in range(3):
        np.testing.assert_allclose(run(q, k, v, lengths, table, i), wants[i], atol=2e-6,
                                   rtol=1e-5)
        np.testing.assert_allclose(traced(jnp.int32(i)), wants[i], atol=2e-6, rtol=1e-5)
    # Out-of-range layer indices are clamped to [0, L).
    np.testing.assert_allclose(traced(jnp.int32(7)), wants[2], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(traced(jnp.int32(-1)), wants[0], atol=2e-6, rtol=1e-5)


def test_scan_over_layers_reads_the_stacked_pool():
    """The engine's use: the stage's whole pool inside a `lax.scan`, layer = the scan index."""
    q, k, v = inputs(jnp.uint16, seed=5, layers=3)
    table = jnp.asarray(shuffled_table(seed=5))
    lengths = jnp.asarray(LENGTHS, jnp.int32)

    @jax.jit
    def all_layers(k, v):
        def body(carry, i):
            return carry, da.decode_attention(q, k, v, lengths, table, i)

        return jax.lax.scan(body, 0, jnp.arange(3))[1]  # [L, B, H, D]

    got = np.asarray(all_layers(k, v))
    for i in range(3):
        want = np.asarray(da.reference(q, k, v, lengths, table, i))
        np.testing.assert_allclose(got[i], want, atol=2e-5, rtol=1e-4)


def test_idle_rows_are_zero_and_unread_data_changes_nothing():
    q, k, v = inputs(jnp.float32, seed=6, layers=2)
    table = shuffled_table(seed=6)
    got = run(q, k, v, LENGTHS, table, 1)
    assert not got[2].any() and got[np.arange(B) != 2].all()
    k2, v2 = np.array(k), np.array(v)
    unused = np.setdiff1d(np.arange(NB), table)
    assert len(unused) == NB - B * MB
    k2[1, unused], v2[1, unused] = 100.0, -7.0
    k2[0], v2[0] = 50.0, 50.0  # the layer not read
    for r, n in enumerate(LENGTHS):  # positions past each row's length, in and after its block
        for t in range(n, CAP):
            k2[1, table[r, t // BS], :, t % BS] = v2[1, table[r, t // BS], :, t % BS] = 1e4
    np.testing.assert_array_equal(run(q, jnp.asarray(k2), jnp.asarray(v2), LENGTHS, table, 1),
                                  got)


def test_lengths_above_the_table_capacity_are_clamped():
    q, k, v = inputs(jnp.float32, seed=7)
    table = shuffled_table(seed=7)
    over = [n + CAP if n == CAP else n for n in LENGTHS]
    assert max(over) > CAP
    np.testing.assert_array_equal(run(q, k, v, over, table), run(q, k, v, LENGTHS, table))


def test_out_of_range_table_entries():
    q, k, v = inputs(jnp.float32, seed=8)
    table = shuffled_table(seed=8)
    row, length = 4, LENGTHS[4]  # 23 positions: blocks 0..4 needed, 5..7 not
    got = run(q, k, v, LENGTHS, table)
    # Beyond the blocks the row needs: harmless, never looked at.
    past = table.copy()
    past[row, 5:] = [NB, -1, 2**31 - 1]
    np.testing.assert_array_equal(run(q, k, v, LENGTHS, past), got)
    # Inside: the row stops before that block (positions 0..2*BS-1 only); others unchanged.
    for bad in (NB, -3, 10**9):
        inside = table.copy()
        inside[row, 2] = bad
        out = run(q, k, v, LENGTHS, inside)
        cut = list(LENGTHS)
        cut[row] = 2 * BS
        assert cut[row] < length
        np.testing.assert_allclose(out, numpy_attention(*f64(q, k, v), cut, table), atol=2e-6,
                                   rtol=1e-5)
        np.testing.assert_array_equal(np.delete(out, row, 0), np.delete(got, row, 0))
        np.testing.assert_allclose(da.reference(q, k, v, jnp.asarray(LENGTHS),
                                                jnp.asarray(inside)), out, atol=2e-6, rtol=1e-5)
    # In the row's first block: the row is idle.
    first = table.copy()
    first[row, 0] = -1
    assert not run(q, k, v, LENGTHS, first)[row].any()


def test_rank4_pool_equals_rank5_with_one_layer():
    q, k, v = inputs(jnp.uint16, seed=9)
    table = shuffled_table(seed=9)
    np.testing.assert_array_equal(run(q, k[0], v[0], LENGTHS, table),
                                  run(q, k, v, LENGTHS, table))


def test_identity_table_is_a_dense_cache():
    """A dense cache [B, Hkv, S, D] seen as a pool through an identity table (engine's old
    layout): the kernel sees a cache write made earlier in the same program."""
    rng = np.random.default_rng(10)
    q = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    dense = jnp.asarray(rng.normal(size=(2, B, HKV, CAP, D)), jnp.float32)  # k, v

    def as_pool(x):  # [B, Hkv, MB * BS, D] -> [B * MB, Hkv, BS, D] (a copy; fine in a test)
        return x.reshape(B, HKV, MB, BS, D).transpose(0, 2, 1, 3, 4).reshape(B * MB, HKV, BS, D)

    identity = jnp.arange(B * MB, dtype=jnp.int32).reshape(B, MB)
    lengths = jnp.asarray(LENGTHS, jnp.int32)

    @jax.jit
    def write_then_attend(k, v):
        k = k.at[:, :, 0].set(0.0)
        return da.decode_attention(q, as_pool(k), as_pool(v), lengths, identity)

    got = np.asarray(write_then_attend(dense[0], dense[1]))
    k0 = np.asarray(dense[0]).copy()
    k0[:, :, 0] = 0.0
    want = numpy_attention(*f64(q, as_pool(jnp.asarray(k0))[None], as_pool(dense[1])[None]),
                           LENGTHS, np.asarray(identity))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_bad_shapes_are_named():
    q, k, v = inputs(jnp.float32)
    table = jnp.asarray(shuffled_table())
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    with pytest.raises(ValueError, match="table"):
        da.decode_attention(q, k, v, lengths, table[:3])
    with pytest.raises(ValueError, match="kv heads"):
        da.decode_attention(q[:, :5], k, v, lengths, table)
    with pytest.raises(ValueError, match="float32, bfloat16 or uint16"):
        da.decode_attention(q, k, v.astype(jnp.float16), lengths, table)
