"""Dynamic W8A8: the quantization (`kernels/int8.py`) against NumPy's statement of it, and the
C++ int8 kernel (`kernels/int8_matmul.py`) on each of its paths this machine's build has (the
others skipped, saying why), at every row count the kernel choice measures and odd ones,
against a float64 NumPy reference of the same quantized arithmetic: the int32 sums exactly,
the scaled result to f32 rounding; and the quantization error against the float matmul within
its bound. `pack` / `unpack` against an element-by-element NumPy statement of the order."""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import int8
from jaxpipe.kernels import int8_matmul as im
from jaxpipe.runtime.kernel_choice import HEAD_ROWS, ROWS

# SmolLM2-135M's decoder weights on one device: q/o, k+v, gate+up, down, LM head.
MODEL_SHAPES = [(576, 576), (576, 384), (576, 3072), (1536, 576), (576, 49152)]
BUCKETS = sorted(set(ROWS) | set(HEAD_ROWS))  # every row count the dispatcher can choose at

needs_kernel = pytest.mark.skipif(not im.available(), reason="int8 kernel cannot be built here")


# -- NumPy's statement of the arithmetic (independent of jaxpipe) ------------------------------


def np_quantize(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 along `axis`: scale = max |v| * f32(1 / 127) (1 for an all-zero slice),
    codes = round half to even of v * f32(1 / scale), clipped to [-127, 127]."""
    v = np.asarray(v, np.float32)
    amax = np.max(np.abs(v), axis=axis, keepdims=True, initial=0)
    scale = np.where(amax > 0, amax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(v * (np.float32(1) / scale)), -127, 127).astype(np.int8)
    return codes, np.squeeze(scale, axis)


def np_sums(xq: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """The exact integer dot products, through float64 (products and sums of int8 are exact
    there far past any K tested: |sum| < 2^53)."""
    return np.asarray(xq, np.float64) @ np.asarray(wq, np.float64)


def np_w8a8(x, w) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(y in float64 = sums * s_w * s_x, x codes, x scales, w codes, w scales)."""
    xq, xs = np_quantize(x, -1)
    wq, ws = np_quantize(w, -2)
    y = np_sums(xq, wq) * ws.astype(np.float64) * xs.astype(np.float64)[:, None]
    return y, xq, xs, wq, ws


def np_panel_order(w: np.ndarray) -> np.ndarray:
    """The int8 panel order written out element by element: panels of 64 columns (the last
    narrower), each its K // 4 quads (k = 4j .. 4j + 3 of each column), then its K % 4 tail
    rows as (column, tail k)."""
    k, n = w.shape
    full = k // 4 * 4
    out = []
    for p0 in range(0, n, im.PANEL):
        cols = range(p0, min(p0 + im.PANEL, n))
        for j in range(0, full, 4):
            for c in cols:
                out += [w[j + t, c] for t in range(4)]
        for c in cols:
            out += [w[t, c] for t in range(full, k)]
    return np.array(out, w.dtype).reshape(k, n)


def inputs(m, k, n, seed=0):
    """x [M, K] and w [K, N] f32, normal (x with a few large outliers, as activations have)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[:, ::97] *= 8
    return x, rng.normal(size=(k, n)).astype(np.float32)


def close_f32(got, want):
    """Equal up to the f32 roundings of the two scale multiplications and acc's conversion."""
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_less(np.abs(got - want), 4e-7 * np.abs(want) + 1e-30)


# -- the quantization ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 13), (3, 5, 64), (1, 1)])
def test_quantize_rows_and_weights_match_numpy(shape):
    rng = np.random.default_rng(1)
    v = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.01, 100, size=shape[-1])
    v[..., 0, :] = 0  # an all-zero row of a weight / a row of a batch
    for fn, axis in [(int8.quantize_rows, -1), (int8.quantize_weight, -2)]:
        if len(shape) + axis < 0:
            continue
        codes, scales = fn(jnp.asarray(v))
        want_codes, want_scales = np_quantize(v, axis)
        np.testing.assert_array_equal(np.asarray(scales), want_scales)
        np.testing.assert_array_equal(np.asarray(codes), want_codes)
        assert codes.dtype == jnp.int8 and np.abs(np.asarray(codes)).max() <= 127


def test_codes_are_symmetric_and_round_half_to_even():
    """max |x| maps to +-127 exactly and never -128; x / s halfway rounds to even."""
    x = np.array([[127.0, -127.0, 0.5, 1.5, 2.5, -0.5]], np.float32)  # scale 1
    codes, scale = int8.quantize_rows(jnp.asarray(x))
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(codes), [[127, -127, 0, 2, 2, 0]])


def test_reference_is_the_numpy_arithmetic():
    """XLA's int8 dot (the portable path, the numerics reference) against float64 NumPy."""
    x, w = inputs(9, 523, 70, seed=2)
    want, *_ = np_w8a8(x, w)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    close_f32(np.asarray(jax.jit(int8.reference)(jnp.asarray(x), wq, ws)), want)


@pytest.mark.parametrize("m,k,n", [(1, 576, 3072), (64, 1536, 576), (17, 523, 129)])
def test_quantization_error_within_its_bound(m, k, n):
    """|y - x @ w| <= sum_k |x| s_w / 2 + |w| s_x / 2 + s_x s_w / 4 (each code within half a
    step), plus f32 rounding; and it is a small error in practice (well under 5% of |x| @ |w|,
    whose bound is about (max|x| + max|w|) / 254 of it)."""
    x, w = inputs(m, k, n, seed=m + k)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    got = np.asarray(int8.reference(jnp.asarray(x), wq, ws), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    _, xs = np_quantize(x, -1)
    _, ws64 = np_quantize(w, -2)
    xs, ws64 = xs.astype(np.float64)[:, None], ws64.astype(np.float64)[None]
    ax, aw = np.abs(x).astype(np.float64), np.abs(w).astype(np.float64)
    bound = ax @ np.ones_like(aw) * ws64 / 2 + xs * (np.ones_like(ax) @ aw) / 2 + k * xs * ws64 / 4
    err = np.abs(got - exact)
    np.testing.assert_array_less(err, bound + 1e-6 * (ax @ aw))
    assert err.max() < 0.05 * (ax @ aw).max()


# -- the panel order ---------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(1, 1), (3, 64), (4, 70), (5, 129), (8, 192), (523, 131)])
def test_pack_is_the_panel_order_and_unpack_its_inverse(k, n):
    w = (np.arange(k * n) % 251 - 125).astype(np.int8).reshape(k, n)
    packed = np.asarray(im.pack(jnp.asarray(w)))
    np.testing.assert_array_equal(packed, np_panel_order(w))
    np.testing.assert_array_equal(np.asarray(im.unpack(jnp.asarray(packed))), w)


@pytest.mark.parametrize("k,n", [(1, 1), (3, 64), (5, 129), (576, 192), (523, 131)])
def test_columns_are_read_in_place_from_the_panel_order(k, n):
    """The columns of a weight in panel order (a tied int8 head's rows, read as the
    embedding) are NumPy's columns of the natural weight, tail panel and tail rows too."""
    w = np.random.default_rng(k + n).integers(-127, 128, (k, n)).astype(np.int8)
    cols = np.array([[0, n - 1, n // 2], [n - 1, 0, (7 * n) // 9]])
    got = im.packed_columns(jnp.asarray(np_panel_order(w).reshape(k, n)), jnp.asarray(cols))
    np.testing.assert_array_equal(np.asarray(got), np.moveaxis(w[:, cols], 0, -1))


def test_pack_keeps_leading_axes_apart():
    w = (np.arange(3 * 7 * 70) % 255 - 127).astype(np.int8).reshape(3, 7, 70)
    packed = np.asarray(im.pack(jnp.asarray(w)))
    for layer in range(3):
        np.testing.assert_array_equal(packed[layer], np_panel_order(w[layer]))


# -- the kernel ----------------------------------------------------------------------------------


def run(path, xq, xs, wq, ws, layer=None):
    """The kernel on NumPy-quantized operands (w in natural order, packed here)."""
    fn = jax.jit(partial(im.quantized_matmul, path=path))
    w = jnp.asarray(wq)
    args = (jnp.asarray(xq), jnp.asarray(xs), im.pack(w), jnp.asarray(ws))
    return np.asarray(fn(*args) if layer is None else fn(*args, layer))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 7, 13, 49, 97])
@pytest.mark.parametrize("k,n", [(1, 1), (3, 17), (5, 64), (66, 65), (523, 129), (576, 197)])
def test_int32_sums_are_exact(m, k, n, int8_path):
    """Unit scales: y is f32(acc) itself, exact while |acc| < 2^24, so the kernel's int32 sums
    must equal NumPy's to the last unit. Codes span [-127, 127] (extremes included): the avx2
    path's s16 pairs reach 2 x 127 x 127 and must not saturate. K % 4 = 1, 3, 2 (tails) and
    0; rows past a tile (6 or 4) and a task's chunk (48); panels with narrower last ones."""
    rng = np.random.default_rng(m * 1000 + k + n)
    xq = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
    wq = rng.integers(-127, 128, size=(k, n), dtype=np.int8)
    xq[0, :] = 127 * np.sign(wq[:, 0]).astype(np.int8)  # every product at its largest
    want = np_sums(xq, wq)
    assert np.abs(want).max() < 2**24
    got = run(int8_path, xq, np.ones(m, np.float32), wq, np.ones(n, np.float32))
    np.testing.assert_array_equal(got, want)


@needs_kernel
@pytest.mark.parametrize("m", [*BUCKETS, 3, 53, 2053])
def test_every_row_bucket_matches_float64(m, int8_path):
    """Each row count the kernel choice times (and odd ones past and between them), on an odd
    shape (K % 4 = 3, a 3-column last panel): the scaled result of the same quantized
    arithmetic, to f32 rounding."""
    x, w = inputs(m, 523, 131, seed=m)
    want, xq, xs, wq, ws = np_w8a8(x, w)
    close_f32(run(int8_path, xq, xs, wq, ws), want)


@needs_kernel
@pytest.mark.parametrize("m", [1, 8, 64, 256])
@pytest.mark.parametrize("k,n", MODEL_SHAPES)
def test_model_shapes_match_float64_and_xla(m, k, n, int8_path):
    """The decoder's shapes: x and w quantized by jaxpipe (`int8_matmul` quantizes rows
    itself), against float64 NumPy and XLA's int8 dot."""
    x, packed, ws, want, xla = model_case(m, k, n)
    got = np.asarray(jax.jit(partial(im.int8_matmul, path=int8_path))(x, packed, ws))
    close_f32(got, want)
    close_f32(got, xla)


@cache
def model_case(m, k, n):
    """(x, w's codes in panel order, its scales, float64 NumPy's y, XLA's y) for a model
    shape: computed once for every path."""
    x, w = inputs(m, k, n, seed=m + n)
    want, *_ = np_w8a8(x, w)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    xla = np.asarray(jax.jit(int8.reference)(jnp.asarray(x), wq, ws), np.float64)
    return jnp.asarray(x), im.pack(wq), ws, want, xla


@needs_kernel
@pytest.mark.parametrize("m", [1, 7, 53, 300])
@pytest.mark.parametrize("k,f", [(576, 1536), (67, 128), (1536, 64 * 3), (523, 64)])
def test_gated_is_silu_of_gate_times_up(m, k, f, int8_path):
    """`gated`: silu(g) * u for w = [gate | up] [K, 2F], g and u the same quantized arithmetic
    in float64 (silu there too), and XLA's int8 path; row 0 scaled so its gates run far past
    exp's range (its outputs are 0 or the up value, never NaN)."""
    x, w = inputs(m, k, 2 * f, seed=m + k)
    x[0] *= 40.0
    y, xq, xs, wq, ws = np_w8a8(x, w)
    g, u = y[:, :f], y[:, f:]
    want = g / (1 + np.exp(-np.clip(g, -700, 700))) * u
    fn = jax.jit(partial(im.quantized_matmul, gated=True, path=int8_path))
    got = np.asarray(fn(jnp.asarray(xq), jnp.asarray(xs), im.pack(jnp.asarray(wq)),
                        jnp.asarray(ws)))
    assert got.shape == (m, f) and np.isfinite(got).all()
    # g and u are f32 (relative 2^-23 off), silu' is within [-0.1, 1.1], expf a few ulps
    bound = 1e-6 * (np.abs(g) * (np.abs(u) + 1) + np.abs(u) * (np.abs(g) + 1)) + 1e-30
    np.testing.assert_array_less(np.abs(got - want), bound)
    wq_j, ws_j = jnp.asarray(wq), jnp.asarray(ws)
    xla = np.asarray(jax.jit(im.gated_reference)(jnp.asarray(x), wq_j, ws_j))
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5 * np.abs(xla).max())


@needs_kernel
def test_gated_refuses_widths_it_cannot_pair():
    x, w = inputs(3, 66, 2 * 96)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    with pytest.raises(ValueError, match="gated needs N a multiple of 128"):
        im.int8_matmul(jnp.asarray(x), im.pack(wq), ws, gated=True)


@needs_kernel
def test_stacked_weight_picks_its_layer_in_place(int8_path):
    """w [L, K, N] and w_scale [L, N] with a traced layer index (clamped to [0, L))."""
    x, w = inputs(5, 67, 129, seed=3)
    _, xq, xs, _, _ = np_w8a8(x, w)
    layers = [np_quantize(w * f, -2) for f in (0.5, -1.0, 3.0)]
    wq = np.stack([q for q, _ in layers])
    ws = np.stack([s for _, s in layers])
    for layer, want_l in [(1, 1), (2, 2), (7, 2), (-3, 0)]:
        want = np_sums(xq, wq[want_l]) * ws[want_l] * xs[:, None].astype(np.float64)
        close_f32(run(int8_path, xq, xs, wq, ws, jnp.int32(layer)), want)


@needs_kernel
@pytest.mark.parametrize("m,k", [(1, 576), (53, 523), (7, 3), (300, 523)])
def test_rows_quantized_in_the_kernel_are_numpys_to_the_bit(m, k, int8_path):
    """`int8_matmul` quantizes f32 rows inside the kernel (on the pool from 2^16 values: 300 x
    523): the result equals the kernel on NumPy's codes and scales exactly (same int32 sums,
    same scalings), for rows of every magnitude, ties at .5 steps (the row [127, 0.5, 1.5,
    2.5, ...] has scale 1) and zeros."""
    x, w = inputs(m, k, 70, seed=k)
    x *= np.logspace(-30, 30, m, dtype=np.float32)[:, None]  # scales from 1e-32 to 1e28
    x[0, :3] = [127.0, 0.5, -2.5][:k]
    x[0, 3:] = np.resize([1.5, 2.5, -0.5], k - 3) if k > 3 else []
    if m > 2:
        x[m // 2] = 0
    wq, ws = np_quantize(w, -2)
    xq, xs = np_quantize(x, -1)
    packed = im.pack(jnp.asarray(wq))
    got = np.asarray(im.int8_matmul(jnp.asarray(x), packed, jnp.asarray(ws), path=int8_path))
    want = np.asarray(im.quantized_matmul(jnp.asarray(xq), jnp.asarray(xs), packed,
                                          jnp.asarray(ws), path=int8_path))
    np.testing.assert_array_equal(got, want)


@needs_kernel
def test_a_row_with_inf_or_nan_gives_nan_and_leaves_the_others(int8_path):
    x, w = inputs(4, 66, 70, seed=9)
    x[1, 5], x[2, 60] = np.inf, np.nan
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    got = np.asarray(im.int8_matmul(jnp.asarray(x), im.pack(wq), ws, path=int8_path))
    assert np.isnan(got[1:3]).all() and np.isfinite(got[[0, 3]]).all()
    want, *_ = np_w8a8(x[[0, 3]], w)
    close_f32(got[[0, 3]], want)


@needs_kernel
def test_leading_dims_and_the_default_path():
    x, w = inputs(2 * 3 * 5, 66, 129, seed=4)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    got = np.asarray(im.int8_matmul(jnp.asarray(x).reshape(2, 15, 66), im.pack(wq), ws))
    want, *_ = np_w8a8(x, w)
    close_f32(got.reshape(30, 129), want)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(0, 66, 129), (3, 0, 17), (3, 66, 0)])
def test_empty(m, k, n, int8_path):
    x, w = inputs(m, k, n)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    got = np.asarray(im.int8_matmul(jnp.asarray(x), im.pack(wq), ws, path=int8_path))
    assert got.shape == (m, n) and not got.any()


@needs_kernel
def test_inside_shard_map():
    """The engine calls kernels inside `jax.shard_map` (a custom call cannot be partitioned)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    spec = jax.sharding.PartitionSpec
    fn = jax.jit(jax.shard_map(im.int8_matmul, mesh=mesh,
                               in_specs=(spec(), spec(None, "tp"), spec("tp")),
                               out_specs=spec(None, "tp")))
    x, w = inputs(7, 576, 3072, seed=5)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    want, *_ = np_w8a8(x, w)
    close_f32(np.asarray(fn(jnp.asarray(x), im.pack(wq), ws)), want)


@needs_kernel
def test_bad_inputs_are_named():
    x, w = inputs(3, 66, 129)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    x = jnp.asarray(x)
    with pytest.raises(ValueError, match=r"x must be \[..., K\]"):
        im.int8_matmul(x[:, :6], wq, ws)
    with pytest.raises(ValueError, match="w must be int8 codes"):
        im.int8_matmul(x, wq.astype(jnp.int32), ws)
    with pytest.raises(ValueError, match="x must be a float array"):
        im.int8_matmul(wq[:3], wq, ws)
    with pytest.raises(ValueError, match=r"w_scale must be \[N\]"):
        im.int8_matmul(x, wq, ws[:5])
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        im.int8_matmul(x, wq, ws, 0)
    with pytest.raises(ValueError, match="x_scale must be"):
        im.quantized_matmul(jnp.zeros((3, 66), jnp.int8), jnp.ones(4), wq, ws)
    with pytest.raises(ValueError, match=r"quantize_weight: w must be \[..., K, N\]"):
        int8.quantize_weight(jnp.ones(3))


@needs_kernel
def test_a_path_not_built_here_is_refused_naming_the_ones_that_are():
    x, w = inputs(3, 66, 129)
    wq, ws = int8.quantize_weight(jnp.asarray(w))
    missing = next((p for p in im.PATHS if p not in im.paths()), "no_such_path")
    with pytest.raises(ValueError, match=rf"path '{missing}' is not built here; this machine "
                                         rf"has {', '.join(im.paths())}"):
        im.int8_matmul(jnp.asarray(x), im.pack(wq), ws, path=missing)
