"""The C++ bf16 matmul kernel against a float64 NumPy reference of the bf16-rounded inputs and
against XLA's dot (`reference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import matmul as mm

pytestmark = pytest.mark.skipif(not mm.available(), reason="kernel cannot be built here")

# SmolLM2-135M's weights: fused q/k/v/o-sized, MLP down, and the LM head.
MODEL_SHAPES = [(576, 3072), (1536, 576), (576, 49152)]


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


@pytest.mark.parametrize("n", [1, 17, 129, 3072])
@pytest.mark.parametrize("k", [5, 67, 521, 576])
@pytest.mark.parametrize("m", [1, 3, 7, 13, 40])
def test_matches_float64(m, k, n):
    """Prime-ish sizes: row tiles of 6 with tails, column chunks of 64 / 128 with tails, odd K
    over several K blocks of 256."""
    x, w = inputs(m, k, n, seed=m * k + n)
    close(np.asarray(mm.bf16_matmul(x, w)), numpy_matmul(x, w), x, w)


@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("k,n", MODEL_SHAPES)
def test_matches_xla_at_model_shapes(m, k, n):
    x, w = inputs(m, k, n, seed=m)
    got, want = np.asarray(mm.bf16_matmul(x, w)), np.asarray(jax.jit(mm.reference)(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_rounds_x_to_nearest_even_bf16():
    """x halfway between two bf16 values rounds to the even one, as XLA's convert does."""
    halfway = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0]], np.float32)  # [1, 4]
    w = jnp.eye(4, dtype=jnp.bfloat16)
    got = np.asarray(mm.bf16_matmul(jnp.asarray(halfway), w))
    np.testing.assert_array_equal(got, [[1.0, 1 + 2**-6, -1.0, 3.0]])
    np.testing.assert_array_equal(got, np.asarray(mm.reference(jnp.asarray(halfway), w)))


@pytest.mark.parametrize("m,k,n", [(0, 67, 129), (3, 0, 17), (3, 67, 0)])
def test_empty(m, k, n):
    """No rows, an empty contraction (zeros) or no columns: the right shape, no crash."""
    x, w = inputs(m, k, n)
    got = np.asarray(mm.bf16_matmul(x, w))
    assert got.shape == (m, n) and not got.any()


def test_leading_dims_and_u16_weights():
    """x [..., K] is flattened to rows; w may be bf16 bits as uint16."""
    x, w = inputs(2 * 3 * 5, 67, 129, seed=3)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    got = np.asarray(mm.bf16_matmul(x.reshape(2, 15, 67), bits))
    np.testing.assert_array_equal(got.reshape(30, 129), np.asarray(mm.bf16_matmul(x, w)))


def test_under_jit():
    x, w = inputs(13, 576, 129, seed=4)
    got = np.asarray(jax.jit(mm.bf16_matmul)(x * 2, w))
    close(got, numpy_matmul(x * 2, w), x * 2, w)


def test_stacked_weight_picks_its_layer_in_place():
    """w [L, K, N] with a traced layer index reads that layer (clamped to [0, L)), as the
    step's unrolled layer loop calls it on the stacked weights."""
    x, w = inputs(5, 67, 129, seed=3)
    stack = jnp.stack([w * 0.5, w, w * 2.0])
    fn = jax.jit(mm.bf16_matmul)
    for layer, want_w in [(1, w), (2, w * 2.0), (7, w * 2.0), (-3, w * 0.5)]:
        got = np.asarray(fn(x, stack, jnp.int32(layer)))
        close(got, numpy_matmul(x, want_w), x, want_w)


def test_inside_shard_map():
    """The engine calls it inside `jax.shard_map` (a custom call cannot be partitioned)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))  # as jaxpipe.sharding
    spec = jax.sharding.PartitionSpec
    fn = jax.jit(jax.shard_map(mm.bf16_matmul, mesh=mesh, in_specs=(spec(), spec(None, "tp")),
                               out_specs=spec(None, "tp")))
    x, w = inputs(7, 576, 3072, seed=5)
    close(np.asarray(fn(x, w)), numpy_matmul(x, w), x, w)


def test_matmul_picks_by_rows():
    """`matmul` equals the kernel up to MAX_ROWS (MAX_ROWS_WIDE for wide weights) and XLA's
    dot past it."""
    for m, n in [(1, 129), (mm.MAX_ROWS + 1, 129), (mm.MAX_ROWS_WIDE + 1, mm.WIDE_N + 1)]:
        x, w = inputs(m, 67, n, seed=m)
        want = mm.bf16_matmul if mm.use_kernel(m, n) else mm.reference
        np.testing.assert_array_equal(np.asarray(mm.matmul(x, w)), np.asarray(want(x, w)))
    assert mm.use_kernel(1) and mm.use_kernel(mm.MAX_ROWS) and not mm.use_kernel(0)
    assert not mm.use_kernel(mm.MAX_ROWS + 1)
    assert mm.use_kernel(mm.MAX_ROWS_WIDE, mm.WIDE_N + 1)
    assert not mm.use_kernel(mm.MAX_ROWS_WIDE + 1, mm.WIDE_N + 1)


def test_bad_shapes_are_named():
    x, w = inputs(3, 67, 129)
    with pytest.raises(ValueError, match=r"x must be \[..., K\]"):
        mm.bf16_matmul(x[:, :5], w)
    with pytest.raises(ValueError, match="bfloat16 or uint16"):
        mm.bf16_matmul(x, w.astype(jnp.float32))
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        mm.bf16_matmul(x, w, 0)
    with pytest.raises(ValueError, match="layer index goes with a stacked w"):
        mm.bf16_matmul(x, w[None])

