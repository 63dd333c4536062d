"""The int8 KV cache (kernels/kv_int8.py): its quantization against a float64 NumPy reference
of the same arithmetic, and every attention path (the C++ kernel, Pallas in interpret mode,
the XLA path) reading int8 pools against float64 attention over the NumPy-dequantized K/V."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import kv_int8
from jaxpipe.kernels import pallas_attention as pa
from jaxpipe.kernels import ragged_attention as ra
from jaxpipe.kernels.paged import from_storage, storage_dtype, to_storage
from kernel_tests.attention_cases import (
    BS,
    CAP,
    IMPLS,
    KV_LEN,
    NB,
    Q_LEN,
    Q_START,
    UNCOVERED,
    T,
    close,
    i32,
    inputs,
    int16_rows,
    numpy_attention,
    numpy_dequantize,
    numpy_row_scales,
    shuffled_table,
    want,
)
from kernel_tests.test_ragged_attention import fresh_tokens, numpy_rope


def numpy_scale(x):
    """max|x| / 127 (in f32, as stored values are f32 before rounding) rounded up to bf16,
    in float64."""
    amax = np.abs(x.astype(np.float32)).max(axis=-1)
    bits = (amax / np.float32(127)).astype(np.float32).view(np.uint32).astype(np.uint64)
    up = ((bits + 0xFFFF) >> 16 << 16).astype(np.uint32)
    return up.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("d", [1, 13, 64, 128])
def test_quantize_matches_numpy(d):
    rng = np.random.default_rng(d)
    x = rng.normal(size=(7, 3, d)).astype(np.float32) * rng.uniform(0.01, 50, size=(7, 3, 1))
    x[2, 1] = 0.0  # a zero vector: scale 0, codes 0
    rows = np.asarray(kv_int8.quantize(jnp.asarray(x)))
    assert rows.shape == (7, 3, d + 2) and rows.dtype == np.int8
    scale = numpy_scale(x)
    codes = np.rint(x / np.where(scale > 0, scale, 1)[..., None])
    np.testing.assert_array_equal(rows[..., :d], codes)
    np.testing.assert_array_equal(numpy_dequantize(rows), codes * scale[..., None])
    assert np.abs(rows[..., :d]).max() <= 127
    # The round trip's error is at most half a step, and a step at most 2^-7 over max|x|/127.
    err = np.abs(numpy_dequantize(rows) - x)
    assert (err <= scale[..., None] / 2 + 1e-12).all()
    assert (scale <= np.abs(x).max(-1) / 127 * (1 + 2**-7) + 1e-30).all()
    assert not rows[2, 1].any()


def test_dequantize_and_storage_round_trip():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 2, 16)), jnp.float32)
    pool = jnp.zeros((1,), jnp.int8)
    rows = to_storage(x, pool)
    np.testing.assert_array_equal(np.asarray(from_storage(rows)), numpy_dequantize(
        np.asarray(rows)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(kv_int8.scales(rows)),
                                  numpy_scale(np.asarray(x)).astype(np.float32))


def test_storage_dtype_names_bad_values():
    assert storage_dtype(jnp.bfloat16, "cpu", "int8") == jnp.int8
    assert storage_dtype(jnp.bfloat16, "cpu", "auto") == jnp.uint16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of.*'fp8'"):
        storage_dtype(jnp.bfloat16, "cpu", "fp8")


def runner(name):
    if name == "cpu" and not (ra.available() and "portable" in ra.paths()):
        pytest.skip("the C++ kernel cannot be built here")
    return jax.jit(IMPLS[name], static_argnames=("softcap", "scale"))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 6, 2), (13, 5, 5), (64, 9, 3)])
def test_int8_pool_matches_numpy(impl, head_dim, heads, kv_heads):
    q, k, v = inputs(jnp.int8, seed=2, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    assert k.dtype == jnp.int8 and k.shape[-1] == head_dim + 2
    table = shuffled_table(seed=2)
    got = np.asarray(runner(impl)(q, k, v, *i32(table, Q_START, Q_LEN, KV_LEN)))
    int16 = impl == "cpu" and int16_rows(None, jnp.int8, head_dim)
    close(got, want(q, k, v, table, int16=int16), tol=5e-5)
    assert not got[UNCOVERED].any()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("window,softcap,scale", [(6, 0.0, None), (0, 3.0, 0.3), (11, 5.0, 0.2)])
def test_int8_pool_with_window_softcap_and_scale(impl, window, softcap, scale):
    q, k, v = inputs(jnp.int8, seed=4, layers=2)
    table = shuffled_table(seed=4)
    got = np.asarray(runner(impl)(q, k, v, *i32(table, Q_START, Q_LEN, KV_LEN), jnp.int32(1),
                                  window=jnp.int32(window), softcap=softcap, scale=scale))
    close(got, want(q, k, v, table, layer=1, window=window, softcap=softcap, scale=scale),
          tol=5e-5)


def int8_paths(head_dim):
    if not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    return [p for p in ra.paths() if ra.takes(p, jnp.int8, head_dim)]


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 8, 1), (128, 8, 2),
                                                     (256, 4, 4)])
@pytest.mark.parametrize("window,softcap,scale", [(0, 0.0, None), (6, 3.0, 0.3)])
def test_every_kernel_path_reads_int8_pools_as_numpy(head_dim, heads, kv_heads, window,
                                                     softcap, scale):
    """Each path this build has that takes an int8 pool (avx2's decode rows: codes widened
    to f32 and times the row's scale, q and probabilities f32; avx512_bf16's: int16 products
    where the build has them, `int16_rows`, else 16-lane f32 ones; the tiles of avx512_bf16
    and amx: bf16 products of q and the probabilities split in two bf16 parts each) against
    float64 attention over the NumPy-dequantized K/V (with the int16 quantizations where the
    path makes them), decode rows and tiles, windows, soft caps and scales."""
    paths = int8_paths(head_dim)
    assert "portable" in paths and set(paths) == set(ra.paths())
    q, k, v = inputs(jnp.int8, seed=head_dim + heads, head_dim=head_dim, heads=heads,
                     kv_heads=kv_heads)
    table = shuffled_table(seed=heads)
    for path in paths:
        expected = want(q, k, v, table, window=window, softcap=softcap, scale=scale,
                        int16=int16_rows(path, jnp.int8, head_dim))
        got = np.asarray(jax.jit(ra.ragged_attention, static_argnames=(
            "softcap", "scale", "path"))(q, k, v, *i32(table, Q_START, Q_LEN, KV_LEN),
                                         window=jnp.int32(window), softcap=softcap,
                                         scale=scale, path=path))
        close(got, expected, tol=5e-5)
        assert not got[UNCOVERED].any()


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (256, 4, 1)])
def test_int8_decode_rows_of_every_length_match_numpy(head_dim, heads, kv_heads):
    """Decode rows only, in 16-token blocks, of lengths around the avx paths' groups of 8 and
    16 keys and across blocks (1 .. 300 keys), on each path that takes an int8 pool, against
    float64 attention over the NumPy-dequantized K/V."""
    kv_len = [1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 250, 300]
    rows, block, max_blocks = len(kv_len), 16, 19
    rng = np.random.default_rng(head_dim)
    pool = (1, rows * max_blocks + 3, kv_heads, block, head_dim)
    k, v = (kv_int8.quantize(jnp.asarray(rng.normal(size=pool), jnp.float32)) for _ in "kv")
    q = jnp.asarray(rng.normal(size=(rows, heads, head_dim)), jnp.float32)
    table = rng.permutation(pool[1])[: rows * max_blocks].reshape(rows, max_blocks)
    q_start, q_len = list(range(rows)), [1] * rows
    for path in int8_paths(head_dim):
        v_scales = numpy_row_scales(np.asarray(v)) if int16_rows(path, jnp.int8, head_dim) else None
        expected = numpy_attention(np.asarray(q, np.float64), numpy_dequantize(np.asarray(k)),
                                   numpy_dequantize(np.asarray(v)), table, q_start, q_len,
                                   kv_len, v_scales=v_scales)
        got = ra.ragged_attention(q, k, v, *i32(table, q_start, q_len, kv_len), path=path)
        close(np.asarray(got), expected, tol=5e-5)


def test_int8_pools_default_to_the_widest_path():
    """An int8 pool of head dim 64 runs on the last path the build has (amx's AMX tiles and
    int16 decode rows, avx512_bf16's int16 decode rows, or avx2's 8-lane ones, where built),
    one of head dim 16 on the portable code."""
    if "avx2" not in ra.paths():
        pytest.skip("no avx2 path in this build")
    assert ra.path_for(jnp.int8, 64) == ra.paths()[-1]
    assert ra.path_for(jnp.int8, 16) == "portable"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 6, 2), (64, 9, 3)])
def test_write_and_attend_quantizes_the_rotated_keys(head_dim, heads, kv_heads):
    """The C++ kernel's write (and the jnp path's): each span token's rotated key and its
    value land as int8 rows within half a step of float64 NumPy's, nothing else changes, and
    the output is float64 attention over the pool as written."""
    if not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    _, k, v = inputs(jnp.int8, seed=11, head_dim=head_dim, heads=heads, kv_heads=kv_heads,
                     layers=2)
    q, kv, cos, sin = fresh_tokens(11, heads, kv_heads, head_dim)
    table = shuffled_table(seed=11)
    table[4, 3] = NB + 5  # row 4: positions 15..19 have no block (not written, not read)
    args = (q, kv, cos, sin, k, v, *i32(table, Q_START, Q_LEN, KV_LEN))
    out, k2, v2 = jax.jit(ra.write_and_attend)(*args, jnp.int32(1))
    ref_out, ref_k, ref_v = jax.jit(ra.write_and_attend_reference)(*args, jnp.int32(1))
    rows, pos = (np.asarray(a) for a in ra.token_rows(Q_START, Q_LEN, KV_LEN, T, CAP))
    rot_k, values = numpy_rope(kv[:, 0], cos, sin), np.asarray(kv[:, 1], np.float64)
    written = np.zeros(k.shape[:4], bool)  # [L, NB, Hkv, BS]
    for token in np.flatnonzero(rows >= 0):
        block, offset = table[rows[token], pos[token] // BS], pos[token] % BS
        if not 0 <= block < NB:
            continue
        written[1, block, :, offset] = True
        for pool, ref, x in ((k2, ref_k, rot_k[token]), (v2, ref_v, values[token])):
            got = np.asarray(pool)[1, block, :, offset]  # [Hkv, D + 2]
            step = numpy_scale(x)[:, None]
            assert (np.abs(numpy_dequantize(got) - x) <= step / 2 + 1e-6).all()
            # the jnp path's rows: the same, up to a code where f32 rotations round apart
            other = numpy_dequantize(np.asarray(ref)[1, block, :, offset])
            assert (np.abs(numpy_dequantize(got) - other) <= 1.01 * step).all()
    for new, old in ((k2, k), (v2, v)):
        np.testing.assert_array_equal(np.asarray(new)[~written], np.asarray(old)[~written])
    rot_q = jnp.asarray(numpy_rope(q, cos, sin), jnp.float32)
    close(np.asarray(out), want(rot_q, k2, v2, table, layer=1,
                                int16=int16_rows(None, jnp.int8, head_dim)), tol=5e-5)
    close(np.asarray(ref_out), want(rot_q, ref_k, ref_v, table, layer=1), tol=5e-5)


def test_bad_int8_pools_are_named():
    """An int8 pool must hold rows of D + 2 (codes and scale); no avx path takes one of a
    head dim other than 64, 128 or 256."""
    q, k, v = inputs(jnp.int8)
    spans = i32(shuffled_table(), Q_START, Q_LEN, KV_LEN)
    with pytest.raises(ValueError, match=r"int8 pools: rows of D \+ 2"):
        pa.pallas_attention(q, k[..., :-2], v[..., :-2], *spans, interpret=True)
    if not ra.available():
        return
    with pytest.raises(ValueError, match=r"int8 pools: rows of D \+ 2"):
        ra.ragged_attention(q, k[..., :-2], v[..., :-2], *spans)
    for path in set(ra.paths()) - {"portable"}:
        with pytest.raises(ValueError, match=f"path '{path}' cannot run a int8 pool"):
            ra.ragged_attention(q, k, v, *spans, path=path)
