"""The C++ bf16 matmul kernel (weights in panel order) against a float64 NumPy reference of the
bf16-rounded inputs and against XLA's dot on the natural-order weights (`reference`), on each
of its paths this machine's build has (the others are skipped, saying so); `pack` / `unpack`
against an independent NumPy statement of the panel order."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import matmul as mm

pytestmark = pytest.mark.skipif(not mm.available(), reason="kernel cannot be built here")

# SmolLM2-135M's weights: fused q/k/v/o-sized, MLP down, K/V, and the LM head.
MODEL_SHAPES = [(576, 3072), (1536, 576), (576, 384), (576, 49152)]


def inputs(m, k, n, seed=0):
    """x [M, K] f32 (not bf16-exact, so the kernel must round it), w [K, N] bf16."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.bfloat16)
    return x, w


def numpy_matmul(x, w):
    """bf16(x) @ w in float64: x rounded to bf16 (nearest even) by XLA's convert."""
    xb = np.asarray(x.astype(jnp.bfloat16), np.float64)
    return xb @ np.asarray(w, np.float64)


def close(got, expected, x, w, rtol=1e-4):
    """Within rtol of the sum of |terms| (the f32 summation error bound's scale)."""
    scale = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float64)) @ np.abs(
        np.asarray(w, np.float64))
    assert got.shape == expected.shape
    np.testing.assert_array_less(np.abs(got - expected), rtol * scale + 1e-30)


def numpy_panel_order(w: np.ndarray) -> np.ndarray:
    """The panel order written out element by element: panels of 64 columns (the last one
    narrower), each its K/2 pair rows of (k = 2j, 2j + 1) for each of its columns."""
    k, n = w.shape
    out = []
    for p0 in range(0, n, mm.PANEL):
        for j in range(k // 2):
            for c in range(p0, min(p0 + mm.PANEL, n)):
                out += [w[2 * j, c], w[2 * j + 1, c]]
    return np.array(out, w.dtype).reshape(k, n)


@pytest.mark.parametrize("k,n", [(2, 1), (4, 64), (6, 70), (10, 129), (8, 192)])
def test_pack_is_the_panel_order_and_unpack_its_inverse(k, n):
    w = np.arange(k * n, dtype=np.float32).reshape(k, n)
    packed = np.asarray(mm.pack(jnp.asarray(w)))
    np.testing.assert_array_equal(packed, numpy_panel_order(w))
    np.testing.assert_array_equal(np.asarray(mm.unpack(jnp.asarray(packed))), w)


def test_pack_keeps_leading_axes_apart():
    """A stack [L, K, N] packs each layer alone."""
    w = np.arange(3 * 4 * 70, dtype=np.float32).reshape(3, 4, 70)
    packed = np.asarray(mm.pack(jnp.asarray(w)))
    for layer in range(3):
        np.testing.assert_array_equal(packed[layer], numpy_panel_order(w[layer]))


@pytest.mark.parametrize("n", [1, 17, 64, 129, 3072])
@pytest.mark.parametrize("k", [2, 66, 522, 576])
@pytest.mark.parametrize("m", [1, 3, 7, 13, 40, 53])
def test_matches_float64(m, k, n, path):
    """Prime-ish sizes: row tiles (6 or 4) and row chunks of 48 with tails, panels of 64 with
    a narrower last one (1, 17 columns: masked vectors)."""
    x, w = inputs(m, k, n, seed=m * k + n)
    close(np.asarray(mm.bf16_matmul(x, mm.pack(w), path=path)), numpy_matmul(x, w), x, w)


@pytest.mark.parametrize("k,n", [(522, 129), (66, 17)])
def test_rows_past_the_largest_bucket(k, n, path):
    """2053 rows, a prime past the kernel choice's largest measured count (2048): many row
    chunks, the last one ragged."""
    x, w = inputs(2053, k, n, seed=k)
    close(np.asarray(mm.bf16_matmul(x, mm.pack(w), path=path)), numpy_matmul(x, w), x, w)


@pytest.mark.parametrize("m", [1, 8, 16, 64, 300])
@pytest.mark.parametrize("k,n", MODEL_SHAPES)
def test_matches_xla_at_model_shapes(m, k, n, path):
    x, w = inputs(m, k, n, seed=m)
    got = np.asarray(mm.bf16_matmul(x, mm.pack(w), path=path))
    want = np.asarray(jax.jit(mm.reference)(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_rounds_x_to_nearest_even_bf16(path):
    """x halfway between two bf16 values rounds to the even one, as XLA's convert does, in
    the vector conversion (32 values at a time) and its tail alike."""
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0] * 9, np.float32)[None]
    w = jnp.eye(36, dtype=jnp.bfloat16)
    got = np.asarray(mm.bf16_matmul(jnp.asarray(halfway), mm.pack(w), path=path))
    np.testing.assert_array_equal(got[0, :4], [1.0, 1 + 2**-6, -1.0, 3.0])
    np.testing.assert_array_equal(got, np.asarray(mm.reference(jnp.asarray(halfway), w)))


def test_nan_and_inf_in_x_propagate(path):
    """Row 0 has a NaN (NaN in every column, as 0 * NaN is NaN), row 1 an inf (inf where its
    weight is positive, NaN where it is 0): as XLA's dot."""
    x = np.ones((2, 64), np.float32)
    x[0, 3], x[1, 40] = np.nan, np.inf
    w = jnp.eye(64, dtype=jnp.bfloat16)
    got = np.asarray(mm.bf16_matmul(jnp.asarray(x), mm.pack(w), path=path))
    assert np.isnan(got[0]).all() and got[1, 40] == np.inf and np.isnan(got[1, :40]).all()
    want = np.asarray(mm.reference(jnp.asarray(x), w))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("m,k,n", [(0, 66, 129), (3, 0, 17), (3, 66, 0)])
def test_empty(m, k, n, path):
    """No rows, an empty contraction (zeros) or no columns: the right shape, no crash."""
    x, w = inputs(m, k, n)
    got = np.asarray(mm.bf16_matmul(x, mm.pack(w), path=path))
    assert got.shape == (m, n) and not got.any()


def test_leading_dims_and_u16_weights():
    """x [..., K] is flattened to rows; w may be bf16 bits as uint16."""
    x, w = inputs(2 * 3 * 5, 66, 129, seed=3)
    packed = mm.pack(w)
    bits = jax.lax.bitcast_convert_type(packed, jnp.uint16)
    got = np.asarray(mm.bf16_matmul(x.reshape(2, 15, 66), bits))
    np.testing.assert_array_equal(got.reshape(30, 129), np.asarray(mm.bf16_matmul(x, packed)))


def test_under_jit():
    x, w = inputs(13, 576, 129, seed=4)
    got = np.asarray(jax.jit(mm.bf16_matmul)(x * 2, mm.pack(w)))
    close(got, numpy_matmul(x * 2, w), x * 2, w)


def test_stacked_weight_picks_its_layer_in_place(path):
    """w [L, K, N] with a traced layer index reads that layer (clamped to [0, L)), as the
    step's unrolled layer loop calls it on the stacked weights."""
    x, w = inputs(5, 66, 129, seed=3)
    stack = mm.pack(jnp.stack([w * 0.5, w, w * 2.0]))
    fn = jax.jit(partial(mm.bf16_matmul, path=path))
    for layer, want_w in [(1, w), (2, w * 2.0), (7, w * 2.0), (-3, w * 0.5)]:
        got = np.asarray(fn(x, stack, jnp.int32(layer)))
        close(got, numpy_matmul(x, want_w), x, want_w)


def test_inside_shard_map():
    """The engine calls it inside `jax.shard_map` (a custom call cannot be partitioned)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))  # as jaxpipe.runtime.sharding
    spec = jax.sharding.PartitionSpec
    fn = jax.jit(jax.shard_map(mm.bf16_matmul, mesh=mesh, in_specs=(spec(), spec(None, "tp")),
                               out_specs=spec(None, "tp")))
    x, w = inputs(7, 576, 3072, seed=5)
    close(np.asarray(fn(x, mm.pack(w))), numpy_matmul(x, w), x, w)


def test_bad_shapes_are_named():
    x, w = inputs(3, 66, 129)
    with pytest.raises(ValueError, match=r"x must be \[..., K\]"):
        mm.bf16_matmul(x[:, :6], w)
    with pytest.raises(ValueError, match="K must be even"):
        mm.bf16_matmul(x[:, :65], w[:65])
    with pytest.raises(ValueError, match="K must be even"):
        mm.pack(w[:65])
    with pytest.raises(ValueError, match="bfloat16 or uint16"):
        mm.bf16_matmul(x, w.astype(jnp.float32))
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        mm.bf16_matmul(x, w, 0)
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        mm.bf16_matmul(x, w[None])


@pytest.mark.parametrize("m", [1, 7, 53, 300])
@pytest.mark.parametrize("k,f", [(576, 1536), (66, 128), (1536, 64 * 3), (522, 64)])
def test_gated_matches_silu_of_gate_times_up(m, k, f, path):
    """`gated`: silu(x @ gate) * (x @ up) for w = [gate | up] [K, 2F], against float64 NumPy
    (silu on the float64 products) and XLA's path; outputs with large negative gates are 0."""
    x, w = inputs(m, k, 2 * f, seed=m + k)
    x = x.at[0, :].multiply(40.0)  # gates far past exp's range in row 0
    got = np.asarray(mm.bf16_matmul(x, mm.pack(w), gated=True, path=path))
    y = numpy_matmul(x, w)
    g, u = y[:, :f], y[:, f:]
    want = g / (1 + np.exp(-np.clip(g, -700, 700))) * u
    # f32 sums err by up to ~1e-4 of sum |terms| (S); silu' is within [-0.1, 1.1]
    s = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float64)) @ np.abs(np.asarray(w, float))
    bound = 1e-4 * (s[:, :f] * (np.abs(u) + 1) + s[:, f:] * (np.abs(g) + 1))
    assert got.shape == (m, f) and np.isfinite(got).all()
    np.testing.assert_array_less(np.abs(got - want), bound)
    np.testing.assert_allclose(got, np.asarray(jax.jit(mm.gated_reference)(x, w)),
                               rtol=1e-3, atol=1e-3)


def test_a_path_not_built_here_is_refused_naming_the_ones_that_are():
    x, w = inputs(3, 66, 129)
    missing = next((p for p in mm.PATHS if p not in mm.paths()), "no_such_path")
    with pytest.raises(ValueError, match=rf"path '{missing}' is not built here; this "
                                         rf"machine has {', '.join(mm.paths())}"):
        mm.bf16_matmul(x, mm.pack(w), path=missing)


def test_gated_refuses_widths_it_cannot_pair():
    x, w = inputs(3, 66, 2 * 96)
    with pytest.raises(ValueError, match="gated needs N a multiple of 128"):
        mm.bf16_matmul(x, mm.pack(w), gated=True)
