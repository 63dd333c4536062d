"""GGUF's quantized blocks: the decoding (`kernels/gguf_blocks.py`) against the `gguf` package's
dequantizer, the activation quantization against NumPy's statement of llama.cpp's q8_0 / q8_1,
XLA's reference and the C++ kernel (`kernels/gguf_matmul.py`) on each of its paths this
machine's build has, at every row count the kernel choice measures and odd ones, against a
float64 NumPy reference of the same quantized arithmetic (the integer sums exactly); and the
shipped SmolLM2 GGUF's real tensors through the kernel against the f32 matmul of their
dequantized weights, within the bound of the activations' quantization."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxpipe.kernels import gguf_blocks as gb  # noqa: E402
from jaxpipe.kernels import gguf_matmul as gm  # noqa: E402
from jaxpipe.runtime.kernel_choice import HEAD_ROWS, ROWS  # noqa: E402

TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_k": gguf.GGMLQuantizationType.Q4_K,
         "q6_k": gguf.GGMLQuantizationType.Q6_K}
SMALL = ["q8_0", "q4_0", "q4_1"]  # the formats of 32-weight blocks (q8_0 / q8_1 activations)
BUCKETS = sorted(set(ROWS) | set(HEAD_ROWS))  # every row count the dispatcher can choose at
U = 2.0**-24  # f32's unit roundoff

needs_kernel = pytest.mark.skipif(not gm.available(), reason="GGUF kernel cannot be built here")


# -- NumPy's statement of the arithmetic (independent of jaxpipe) ------------------------------


def np_f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> f64 values of those f16s."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float64)


def np_decode(rows: np.ndarray, fmt: str):
    """GGUF rows [N, R] -> (codes [N, B, 32] as multiplied, d [N, B], m [N, B]) in f64/int64,
    read from ggml's block layouts."""
    size = gb.FORMATS[fmt].block_bytes
    b = rows.reshape(rows.shape[0], -1, size)
    d, m = np_f16(b[..., 0:2]), np.zeros(b.shape[:2])
    if fmt == "q8_0":
        return b[..., 2:].view(np.int8).astype(np.int64), d, m
    qs = b[..., 2:18] if fmt == "q4_0" else b[..., 4:20]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    if fmt == "q4_1":
        m = np_f16(b[..., 2:4])
    return codes - (8 if fmt == "q4_0" else 0), d, m


def np_quantize(x: np.ndarray):
    """llama.cpp's q8_1 of rows x [M, K] (q8_0 is its codes and d): per block of 32, d32 =
    amax * f32(1 / 127), codes = roundf(x * f32(1 / d32)) (halves away from zero), d =
    f16(d32), s = f16(d32 * sum codes). Returns (codes [M, B, 32] int64, d32, d, s)."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    d32 = np.abs(blocks).max(-1) * np.float32(1 / 127)
    with np.errstate(divide="ignore"):
        inv = np.where(d32 > 0, np.float32(1) / d32, np.float32(0)).astype(np.float32)
    v = blocks * inv[..., None]
    codes = np.clip(np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5), -127, 127)
    codes = codes.astype(np.int64)
    s = (d32 * codes.sum(-1).astype(np.float32)).astype(np.float16)
    return codes, d32, d32.astype(np.float16).astype(np.float64), s.astype(np.float64)


def np_dot(x: np.ndarray, rows: np.ndarray, fmt: str):
    """(y [M, N] f64 = sum_b dx dw sumi + mw sx, the magnitude sum_b dx dw sum_i |qx qw| +
    |mw sx| that bounds f32 rounding)."""
    xq, _, xd, xs = np_quantize(x)
    wq, wd, wm = np_decode(rows, fmt)
    sumi = np.einsum("mbi,nbi->mnb", xq, wq)  # exact in int64
    mag = np.einsum("mbi,nbi->mnb", np.abs(xq), np.abs(wq))
    scale = xd[:, None, :] * wd[None, :, :]
    low = wm[None, :, :] * xs[:, None, :]
    return (scale * sumi + low).sum(-1), (np.abs(scale) * mag + np.abs(low)).sum(-1)


def quantized(w: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF rows of w [N, K] (the gguf package's quantizer: real blocks)."""
    return gguf.quants.quantize(np.asarray(w, np.float32), TYPES[fmt])


def inputs(m, k, n, seed=0):
    """x [M, K] and w [N, K] f32, normal (x with a few large outliers, as activations have)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[:, ::97] *= 8
    return x, rng.normal(size=(n, k)).astype(np.float32)


def close(got, x, rows, fmt):
    """got within f32 rounding of the float64 arithmetic: (B + 8) roundings of the magnitude."""
    want, mag = np_dot(x, rows, fmt)
    assert got.shape == want.shape and got.dtype == np.float32
    blocks = x.shape[-1] // 32
    np.testing.assert_array_less(np.abs(got - want), (blocks + 8) * U * mag + 1e-30)


# -- decoding and quantization -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", SMALL)
def test_dequantize_equals_gguf(fmt):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(37, 96)).astype(np.float32) * rng.uniform(0.01, 50, size=(37, 1))
    w[0] = 0  # an all-zero row
    w[1, :32] = 7.0  # a constant block (q4_1: d = 0, m = 7)
    rows = quantized(w, fmt)
    want = gguf.quants.dequantize(rows, TYPES[fmt])
    got = np.asarray(gb.dequantize(jnp.asarray(rows), gb.FORMATS[fmt]))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", SMALL)
def test_decode_is_ggml_block_layout(fmt):
    rows = quantized(np.random.default_rng(2).normal(size=(5, 64)), fmt)
    codes, d, m = gb.decode(jnp.asarray(rows), gb.FORMATS[fmt])
    want_codes, want_d, want_m = np_decode(rows, fmt)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    np.testing.assert_array_equal(np.asarray(m) if m is not None else 0 * want_m, want_m)


@pytest.mark.parametrize("shape", [(7, 64), (1, 32), (3, 576)])
def test_quantize_rows_is_llama_cpp_q8_1(shape):
    rng = np.random.default_rng(3)
    x = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.01, 100, size=shape[-1])
    x[0, :32] = 0  # an all-zero block: d = 0, codes 0
    codes, d, s = gb.quantize_rows(jnp.asarray(x), "q8_1")
    want_codes, _, want_d, want_s = np_quantize(x)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    assert gb.quantize_rows(jnp.asarray(x), "q8_0")[2] is None


def test_codes_round_halves_away_from_zero():
    """amax 127 gives d = 1 (to f16), so x's halves are the codes' ties: roundf, not even."""
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5]
    codes, d, _ = gb.quantize_rows(jnp.asarray(x), "q8_0")
    assert float(d[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(codes)[0, 0, :6], [127, 1, 2, 3, -1, -3])


def test_reference_is_the_numpy_arithmetic():
    x, w = inputs(9, 576, 70, seed=4)
    for fmt in SMALL:
        rows = quantized(w, fmt)
        got = jax.jit(partial(gb.reference, fmt=gb.FORMATS[fmt]))(jnp.asarray(x), rows)
        close(np.asarray(got), x, rows, fmt)


@pytest.mark.parametrize("fmt", SMALL)
def test_random_blocks_are_finite_weights_of_the_shape(fmt):
    """The timing inputs (kernel choice, benchmark): valid blocks, scales about 1 / 64."""
    rows = gb.random_blocks(gb.FORMATS[fmt], (2, 3, 64))
    assert rows.shape == (2, 3, 2 * gb.FORMATS[fmt].block_bytes) and rows.dtype == np.uint8
    w = gguf.quants.dequantize(rows.reshape(6, -1), TYPES[fmt])
    assert w.shape == (6, 64) and np.isfinite(w).all() and 0 < np.abs(w).max() < 16


def test_bad_format_and_shapes_are_named():
    with pytest.raises(ValueError, match="'q5_0'.*q8_0, q4_0, q4_1, q4_k, q6_k"):
        gb.format_of("q5_0")
    with pytest.raises(ValueError, match=r"multiple of 32; got \(2, 33\)"):
        gb.quantize_rows(jnp.zeros((2, 33)), "q8_0")


# -- the kernel ----------------------------------------------------------------------------------


def kernel(x, rows, fmt, path, layer=None):
    fn = jax.jit(partial(gm.gguf_matmul, fmt=fmt, path=path))
    args = (jnp.asarray(x), jnp.asarray(rows))
    return np.asarray(fn(*args) if layer is None else fn(*args, layer=layer))


def unit_blocks(codes: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF rows whose every block has d = 1 (q4_1: m = 0) and the given stored codes [N, K]
    (q8_0: int8; q4: 0..15)."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 32)
    one = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    head = [np.broadcast_to(one, (n, k // 32, 2))]
    if fmt == "q8_0":
        body = [c.astype(np.int8).view(np.uint8)]
    else:
        body = [(c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)]
        if fmt == "q4_1":
            head.append(np.zeros((n, k // 32, 2), np.uint8))
    return np.concatenate(head + body, axis=-1).reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("fmt", SMALL)
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (5, 64, 7), (13, 576, 67), (50, 1536, 9)])
def test_integer_sums_are_exact(fmt, m, k, n, gguf_path):
    """Unit scales (x's integer blocks hold a 127, so dx = 1; dw = 1): y is the sum of the
    blocks' integer sums, exact in f32 below 2^24, so it must equal NumPy's to the unit. Codes
    span their whole range (q8_0's -128 included, every product at its largest in row 0)."""
    rng = np.random.default_rng(m + k + n)
    lo, hi = (-128, 128) if fmt == "q8_0" else (0, 16)
    wc = rng.integers(lo, hi, size=(n, k))
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, ::32] = 127
    x[0] = np.where(wc[0] - (8 if fmt == "q4_0" else 0) < 0, -127, 127)
    rows = unit_blocks(wc, fmt)
    want = x.astype(np.int64) @ (wc - (8 if fmt == "q4_0" else 0)).T
    assert np.abs(want).max() < 2**24
    np.testing.assert_array_equal(kernel(x, rows, fmt, gguf_path), want)


@needs_kernel
def test_kernel_quantizes_rows_as_numpy(gguf_path):
    """One-hot q8_0 weights (d = 1) read the kernel's own activation codes back: y[m, j] =
    dx16 qx_j exactly. Thousands of rows of random magnitudes, so that some x / d land within
    an ulp of a half (a reassociated 1 / d rounds those the other way), and a parallel
    quantization (M K >= 2^16)."""
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(4099, 64)) * rng.uniform(1e-3, 1e3, size=(4099, 1))).astype(np.float32)
    rows = unit_blocks(np.tile(np.eye(32, dtype=np.int64), (1, 2)), "q8_0")
    if gguf_path == "portable":
        x = x[:300]
    codes, _, d, _ = np_quantize(x)
    want = (d[..., None] * codes).reshape(x.shape[0], 2, 32).sum(1)
    np.testing.assert_array_equal(kernel(x, rows, "q8_0", gguf_path), want.astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("fmt", SMALL)
@pytest.mark.parametrize("m", [*BUCKETS, 3, 53, 2053])
def test_every_row_bucket_matches_float64(fmt, m, gguf_path):
    """Each row count the kernel choice times and odd ones past and between them (a tile's 4
    rows, a task's 48), on an odd N (67: a column tile's remainder): the float64 arithmetic to
    f32 rounding."""
    if gguf_path == "portable" and m > 256:
        pytest.skip("the plain loops are slow; the portable path is checked up to 256 rows")
    x, w = inputs(m, 320, 67, seed=m)
    rows = quantized(w, fmt)
    close(kernel(x, rows, fmt, gguf_path), x, rows, fmt)


@needs_kernel
@pytest.mark.parametrize("fmt", SMALL)
def test_stack_reads_the_traced_layer_in_place(fmt, gguf_path):
    x, _ = inputs(6, 96, 1, seed=5)
    stack = np.stack([quantized(inputs(1, 96, 130, seed=10 + i)[1], fmt) for i in range(3)])
    for layer in (0, 2):
        got = kernel(x, stack, fmt, gguf_path, layer=jnp.int32(layer))
        close(got, x, stack[layer], fmt)


@needs_kernel
def test_kernel_equals_xla_reference_and_leading_axes():
    x, w = inputs(2 * 3 * 5, 576, 131, seed=6)
    rows = jnp.asarray(quantized(w, "q4_1"))
    got = np.asarray(gm.gguf_matmul(x.reshape(2, 3, 5, 576), rows, "q4_1"))
    want = np.asarray(gb.reference(x, rows, gb.FORMATS["q4_1"]))
    np.testing.assert_allclose(got.reshape(30, 131), want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_bad_input_is_named():
    rows = jnp.asarray(quantized(np.ones((4, 64)), "q4_1"))
    with pytest.raises(ValueError, match="q4_1 row of K = 96 is 60 bytes; w has 40"):
        gm.gguf_matmul(jnp.ones((2, 96)), rows, "q4_1")
    with pytest.raises(ValueError, match="path 'amx' is not built here"):
        gm.gguf_matmul(jnp.ones((2, 64)), rows, "q4_1", path="amx")
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        gm.gguf_matmul(jnp.ones((2, 64)), rows, "q4_1", layer=0)
    with pytest.raises(ValueError, match="q4_k: K must be a multiple of 256; got 576"):
        gm.gguf_matmul(jnp.ones((2, 576)), jnp.zeros((3, 324), jnp.uint8), "q4_k")


# -- q4_k (super-blocks of 256, q8_k activations) ---------------------------------------------


def np_decode_k(rows: np.ndarray):
    """q4_k rows [N, R] -> (codes [N, S, 8, 32], sc, m [N, S, 8], d, dmin [N, S]) as int64 /
    f64, from ggml's block_q4_K: d, dmin, 12 scale bytes (get_scale_min_k4), 128 nibble bytes."""
    b = rows.reshape(rows.shape[0], -1, 144)
    d, dmin = np_f16(b[..., 0:2]), np_f16(b[..., 2:4])
    s = b[..., 4:16].astype(np.int64)
    sc, m = np.zeros(s.shape[:-1] + (8,), np.int64), np.zeros(s.shape[:-1] + (8,), np.int64)
    for j in range(4):
        sc[..., j], m[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        sc[..., j + 4] = (s[..., j + 8] & 15) | ((s[..., j] >> 6) << 4)
        m[..., j + 4] = (s[..., j + 8] >> 4) | ((s[..., j + 4] >> 6) << 4)
    qs = b[..., 16:].astype(np.int64).reshape(*b.shape[:-1], 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    return codes, sc, m, d, dmin


def np_quantize_k(x: np.ndarray):
    """llama.cpp's quantize_row_q8_K of rows x [M, K]: per 256, v = the first value of largest
    magnitude, iscale = f32(-127 / v), codes = min(127, round half to even(iscale x)), d =
    f32(1 / iscale). Returns (codes [M, S, 256] int64, d [M, S] f64)."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, 256)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (np.float32(-127) / top).astype(np.float32)
        d = np.where(top == 0, 0, np.float32(1) / iscale).astype(np.float32)
        codes = np.where(top[..., None] == 0, 0,
                         np.minimum(127, np.rint(blocks * iscale[..., None])))
    return codes.astype(np.int64), d.astype(np.float64)


def np_dot_k(x: np.ndarray, rows: np.ndarray):
    """(y [M, N] f64 = sum_s (dx d) isum - (dx dmin) msum, the magnitude for f32 rounding)."""
    xq, xd = np_quantize_k(x)
    wq, sc, m, d, dmin = np_decode_k(rows)
    xq = xq.reshape(*xq.shape[:-1], 8, 32)
    sumi = np.einsum("msji,nsji->mnsj", xq, wq)
    mag = np.einsum("msji,nsji->mnsj", np.abs(xq), wq) * sc[None]
    isum, msum = (sumi * sc[None]).sum(-1), np.einsum("msj,nsj->mns", xq.sum(-1), m)
    hi, lo = xd[:, None, :] * d[None], xd[:, None, :] * dmin[None]
    y = (hi * isum - lo * msum).sum(-1)
    return y, (np.abs(hi) * mag.sum(-1) + np.abs(lo * msum)).sum(-1)


def close_k(got, x, rows):
    want, mag = np_dot_k(x, rows)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got - want), (x.shape[-1] // 256 + 10) * U * mag + 1e-30)


Q4K = gb.FORMATS["q4_k"]


def test_q4_k_dequantize_equals_gguf_and_decodes_ggml_layout():
    rows = gb.random_blocks(Q4K, (29, 512), seed=9)
    rows[0, 4:16] = 255  # every scale and minimum at 63
    want = gguf.quants.dequantize(rows, TYPES["q4_k"])
    got = np.asarray(gb.dequantize(jnp.asarray(rows), Q4K))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for a, b in zip(gb.decode_k(jnp.asarray(rows), Q4K), np_decode_k(rows), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_quantize_rows_k_is_llama_cpp_q8_k():
    rng = np.random.default_rng(10)
    x = (rng.normal(size=(9, 512)) * rng.uniform(1e-3, 1e3, size=(9, 1))).astype(np.float32)
    x[0, :256] = 0  # a zero super-block
    x[1] /= np.abs(x[1]).max()
    x[1, 3], x[1, 7] = -50, 50  # two of largest magnitude: the first (negative) is v
    codes, d, sums = gb.quantize_rows_k(jnp.asarray(x))
    want_codes, want_d = np_quantize_k(x)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    np.testing.assert_array_equal(np.asarray(sums), want_codes.reshape(9, 2, 8, 32).sum(-1))
    assert np.asarray(codes)[1, 0, 3] == -127 and np.asarray(codes)[1, 0, 7] == 127  # v: -127


def test_q4_k_reference_is_the_numpy_arithmetic():
    x, _ = inputs(7, 768, 1, seed=11)
    rows = gb.random_blocks(Q4K, (70, 768), seed=11)
    close_k(np.asarray(jax.jit(partial(gb.reference, fmt=Q4K))(jnp.asarray(x), rows)), x, rows)


def unit_blocks_k(codes, sc, m, dmin: float) -> np.ndarray:
    """q4_k rows with d = 1, dmin, the given codes [N, K] (0..15) and scales / minimums [N,
    S, 8] (0..63) packed as ggml's get_scale_min_k4 reads them."""
    n, k = codes.shape
    b = np.zeros((n, k // 256, 144), np.uint8)
    b[..., 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    b[..., 2:4] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
    for j in range(4):
        b[..., 4 + j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        b[..., 8 + j] = (m[..., j] & 63) | ((m[..., j + 4] >> 4) << 6)
        b[..., 12 + j] = (sc[..., j + 4] & 15) | ((m[..., j + 4] & 15) << 4)
    q = codes.reshape(n, k // 256, 4, 2, 32)
    b[..., 16:] = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    return b.reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 256, 1), (5, 512, 7), (13, 768, 9)])
def test_q4_k_integer_sums_are_exact(m, k, n, gguf_path):
    """d = dmin = 1 and x's super-blocks led by 127 (so q8_k's d = -1 and its codes are -x):
    y = sum_j sc_j (x_j . q_j) - sum_j m_j sum x_j, integers, exact in f32 below 2^24."""
    rng = np.random.default_rng(m + k + n)
    wc = rng.integers(0, 16, size=(n, k))
    sc, mn = rng.integers(0, 64, size=(2, n, k // 256, 8))
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, ::256] = 127
    rows = unit_blocks_k(wc, sc, mn, 1.0)
    np.testing.assert_array_equal(np_decode_k(rows)[1], sc)  # the packing is ggml's
    np.testing.assert_array_equal(np_decode_k(rows)[2], mn)
    xs = x.reshape(m, -1, 8, 32).astype(np.int64)
    ws = wc.reshape(n, -1, 8, 32)
    want = (np.einsum("msji,nsji->mnsj", xs, ws) * sc[None]).sum((-1, -2)) - np.einsum(
        "msj,nsj->mn", xs.sum(-1), mn)
    assert np.abs(want).max() < 2**24
    np.testing.assert_array_equal(kernel(x, rows, "q4_k", gguf_path), want)


@needs_kernel
def test_kernel_quantizes_rows_as_q8_k(gguf_path):
    """One-hot q4_k weights (d = 1, sc = 1, no minimum) read the kernel's q8_k codes back:
    y[m, j] = dx qx_j, rounded once. Thousands of rows of random magnitudes (near-ties of
    iscale x included), in parallel (M K >= 2^16)."""
    rng = np.random.default_rng(13)
    x = (rng.normal(size=(4099, 256)) * rng.uniform(1e-3, 1e3, size=(4099, 1))).astype(np.float32)
    if gguf_path == "portable":
        x = x[:300]
    ones = np.ones((256, 1, 8), np.int64)
    rows = unit_blocks_k(np.eye(256, dtype=np.int64), ones, 0 * ones, 0.0)
    codes, d = np_quantize_k(x)
    want = (d[:, 0, None] * codes[:, 0]).astype(np.float32)
    np.testing.assert_array_equal(kernel(x, rows, "q4_k", gguf_path), want)


@needs_kernel
@pytest.mark.parametrize("m", [*BUCKETS, 3, 53, 2053])
def test_q4_k_every_row_bucket_matches_float64(m, gguf_path):
    if gguf_path == "portable" and m > 256:
        pytest.skip("the plain loops are slow; the portable path is checked up to 256 rows")
    x, _ = inputs(m, 512, 1, seed=m)
    rows = gb.random_blocks(Q4K, (67, 512), seed=m)
    close_k(kernel(x, rows, "q4_k", gguf_path), x, rows)


@needs_kernel
def test_q4_k_stack_reads_the_traced_layer(gguf_path):
    x, _ = inputs(6, 256, 1, seed=12)
    stack = gb.random_blocks(Q4K, (3, 5, 256), seed=12)
    for layer in (0, 2):
        close_k(kernel(x, stack, "q4_k", gguf_path, layer=jnp.int32(layer)), x, stack[layer])


# -- q6_k (super-blocks of 256, a scale per 16, q8_k activations) ------------------------------


Q6K = gb.FORMATS["q6_k"]


def np_decode_k6(rows: np.ndarray):
    """q6_k rows [N, R] -> (codes [N, S, 256] int64 as q - 32, sc [N, S, 16], d [N, S]) read
    weight by weight from ggml's block_q6_K (ql, qh, scales, d)."""
    b = rows.reshape(rows.shape[0], -1, 210).astype(np.int64)
    codes = np.zeros(b.shape[:-1] + (256,), np.int64)
    for i in range(256):
        h, u, lane = i // 128, i % 128 // 32, i % 32
        lo = b[..., 64 * h + lane + 32 * (u % 2)]
        lo = lo & 15 if u < 2 else lo >> 4
        codes[..., i] = (lo | (((b[..., 128 + 32 * h + lane] >> (2 * u)) & 3) << 4)) - 32
    sc = rows.reshape(rows.shape[0], -1, 210)[..., 192:208].view(np.int8).astype(np.int64)
    return codes, sc, np_f16(rows.reshape(rows.shape[0], -1, 210)[..., 208:210])


def np_dot_k6(x, rows):
    """(y [M, N] f64 = sum_s (dx d) sum_i sc_i sumi_i, the magnitude for f32 rounding)."""
    xq, xd = np_quantize_k(x)
    wq, sc, d = np_decode_k6(rows)
    xq = xq.reshape(*xq.shape[:-1], 16, 16)
    wq = wq.reshape(*wq.shape[:-1], 16, 16)
    isum = (np.einsum("msji,nsji->mnsj", xq, wq) * sc[None]).sum(-1)
    mag = (np.einsum("msji,nsji->mnsj", np.abs(xq), np.abs(wq)) * np.abs(sc[None])).sum(-1)
    scale = xd[:, None, :] * d[None]
    return (scale * isum).sum(-1), (np.abs(scale) * mag).sum(-1)


def close_k6(got, x, rows):
    want, mag = np_dot_k6(x, rows)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got - want), (x.shape[-1] // 256 + 10) * U * mag + 1e-30)


def test_q6_k_dequantize_equals_gguf_and_decodes_ggml_layout():
    rows = gb.random_blocks(Q6K, (29, 512), seed=14)
    rows[0, 192:208] = 128  # scales at -128
    want = gguf.quants.dequantize(rows, TYPES["q6_k"])
    got = np.asarray(gb.dequantize(jnp.asarray(rows), Q6K))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    codes, sc, d = gb.decode_k6(jnp.asarray(rows), Q6K)
    want_codes, want_sc, want_d = np_decode_k6(rows)
    np.testing.assert_array_equal(np.asarray(codes).reshape(want_codes.shape), want_codes)
    np.testing.assert_array_equal(np.asarray(sc), want_sc)
    np.testing.assert_array_equal(np.asarray(d), want_d)


def test_q6_k_reference_is_the_numpy_arithmetic():
    x, _ = inputs(7, 768, 1, seed=15)
    rows = gb.random_blocks(Q6K, (70, 768), seed=15)
    close_k6(np.asarray(jax.jit(partial(gb.reference, fmt=Q6K))(jnp.asarray(x), rows)), x, rows)


def unit_blocks_k6(codes, sc) -> np.ndarray:
    """q6_k rows with d = 1, the given codes [N, K] (q in 0..63, stored) and scales [N, S,
    16] (int8), laid out as ggml's block_q6_K."""
    n, k = codes.shape
    q = codes.reshape(n, k // 256, 2, 4, 32)  # [.., half, u, lane]
    b = np.zeros((n, k // 256, 210), np.uint8)
    for h in range(2):
        b[..., 64 * h:64 * h + 32] = (q[..., h, 0, :] & 15) | ((q[..., h, 2, :] & 15) << 4)
        b[..., 64 * h + 32:64 * h + 64] = (q[..., h, 1, :] & 15) | ((q[..., h, 3, :] & 15) << 4)
        b[..., 128 + 32 * h:160 + 32 * h] = sum((q[..., h, u, :] >> 4) << (2 * u) for u in range(4))
    b[..., 192:208] = sc.astype(np.int8).view(np.uint8)
    b[..., 208:210] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    return b.reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 256, 1), (5, 512, 7), (13, 768, 9)])
def test_q6_k_integer_sums_are_exact(m, k, n, gguf_path):
    """d = 1 and x's super-blocks led by 127 (q8_k's d = -1, codes -x): y = sum_i sc_i (x_i .
    (q_i - 32)), integers, exact in f32 below 2^24; scales span [-128, 127], codes [0, 63]."""
    rng = np.random.default_rng(m + k + n)
    wc = rng.integers(0, 64, size=(n, k))
    sc = rng.integers(-128, 128, size=(n, k // 256, 16))
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, ::256] = 127
    rows = unit_blocks_k6(wc, sc)
    np.testing.assert_array_equal(np_decode_k6(rows)[0], (wc - 32).reshape(n, -1, 256))
    xs = x.reshape(m, -1, 16, 16).astype(np.int64)
    want = (np.einsum("msji,nsji->mnsj", xs, (wc - 32).reshape(n, -1, 16, 16)) * sc[None]).sum(
        (-1, -2))
    assert np.abs(want).max() < 2**24
    np.testing.assert_array_equal(kernel(x, rows, "q6_k", gguf_path), want)


@needs_kernel
@pytest.mark.parametrize("m", [*BUCKETS, 3, 53, 2053])
def test_q6_k_every_row_bucket_matches_float64(m, gguf_path):
    if gguf_path == "portable" and m > 256:
        pytest.skip("the plain loops are slow; the portable path is checked up to 256 rows")
    x, _ = inputs(m, 512, 1, seed=m)
    rows = gb.random_blocks(Q6K, (67, 512), seed=m)
    close_k6(kernel(x, rows, "q6_k", gguf_path), x, rows)


@needs_kernel
def test_q6_k_stack_reads_the_traced_layer(gguf_path):
    x, _ = inputs(6, 256, 1, seed=16)
    stack = gb.random_blocks(Q6K, (3, 5, 256), seed=16)
    for layer in (0, 2):
        close_k6(kernel(x, stack, "q6_k", gguf_path, layer=jnp.int32(layer)), x, stack[layer])


# -- the shipped model's tensors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_layer():
    """{name: (GGUF rows [N, R] uint8, format)} of SmolLM2-135M's layer 0 and its (tied) token
    embedding, from the shipped Q4_1 GGUF."""
    from jaxpipe.model.presets import resolve_model

    try:
        path = resolve_model("smollm2-135m").path
    except (ValueError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 weights unavailable: {err}")
    reader = gguf.GGUFReader(str(path))
    names = {t.name: t for t in reader.tensors}
    wanted = [n for n in names if n.startswith("blk.0.") and names[n].tensor_type.name != "F32"]
    return {n: (np.asarray(names[n].data), names[n].tensor_type.name.lower())
            for n in [*wanted, "token_embd.weight"]}


def activation_bound(x, w_codes, w_d, w_m) -> np.ndarray:
    """|kernel - x @ dequantized w^T| <= sum_b e_b sum_i |dw q_i| + |mw| (sum_i |x_i - dx qx_i|
    + |s - dx32 sum qx|): each x_i is represented by dx qx_i within e_b = dx32 (1/2 + 127 x
    2^-11) (half a step, then d rounded to f16: a relative 2^-11 on codes up to 127), and
    q8_1's s is f16(dx32 sum qx), within 2^-11 of it; plus f32 rounding."""
    xq, d32, _, _ = np_quantize(x)
    e = d32.astype(np.float64) * (0.5 + 127 * 2.0**-11 + 1e-6)  # [M, B]
    wabs = np.abs(w_d[..., None] * w_codes).sum(-1)  # [N, B]
    low = 32 * e + 2.0**-11 * np.abs(d32 * xq.sum(-1))  # [M, B]
    return e @ wabs.T + low @ np.abs(w_m).T


@needs_kernel
def test_smollm2_tensors_through_the_kernel(smollm2_layer):
    """Layer 0's q/k/v/o/gate/up/down (q4_1) and the tied embedding as the LM head (q8_0) on
    activation-like rows: within the activations' quantization bound of the f32 matmul of
    gguf's dequantized weights, and well under it in practice (relative RMS error < 2%)."""
    x, _ = inputs(5, 1536, 1, seed=7)
    for name, (rows, fmt) in smollm2_layer.items():
        k = rows.shape[1] // gb.FORMATS[fmt].block_bytes * 32
        xs = x[:, :k]
        got = np.asarray(gm.gguf_matmul(jnp.asarray(xs), jnp.asarray(rows), fmt), np.float64)
        w = gguf.quants.dequantize(rows, TYPES[fmt]).astype(np.float64)
        exact = xs.astype(np.float64) @ w.T
        bound = activation_bound(xs, *np_decode(rows, fmt))
        slack = (k // 32 + 8) * U * (np.abs(xs) @ np.abs(w).T)
        np.testing.assert_array_less(np.abs(got - exact), bound + slack, err_msg=name)
        rel = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact ** 2))
        assert rel < 0.02, (name, rel)
