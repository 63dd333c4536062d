"""Dynamic fp8 W8A8 (`kernels/fp8.py`) against NumPy's statement of it through ml_dtypes'
e4m3 (tests/np_quant.py): the codes and scales bit for bit, the dot to f32 summation, and
the guards (zeros, values past e4m3's range, bad shapes)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from np_quant import fp8_quantize, w8a8

from jaxpipe.kernels import fp8


@pytest.mark.parametrize("k, n", [(7, 5), (64, 130), (576, 384)])
def test_weight_codes_and_scales_match_numpy_e4m3(k, n):
    w = np.random.default_rng(k).standard_normal((k, n)).astype(np.float32)
    w[:, 0] = 0  # a zero column: scale 1, codes 0
    codes, scale = fp8.quantize_weight(jnp.asarray(w))
    want_codes, want_scale = fp8_quantize(w, -2)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), want_codes.view(np.uint8))
    assert scale[0] == 1 and not np.asarray(codes[:, 0], np.float32).any()


@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (5, 33, 17), (32, 576, 192)])
def test_dot_equals_the_float64_reference_of_the_same_codes(m, k, n):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    codes, scale = fp8.quantize_weight(jnp.asarray(w))
    got = np.asarray(fp8.reference(jnp.asarray(x), codes, scale))
    want = w8a8(x, w, "fp8")
    # Products of e4m3 codes are exact in f32; only the f32 sum and two scalings round.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # And e4m3 (3 mantissa bits) stays near the float product: about 2^-4 relative per operand.
    exact = x.astype(np.float64) @ w
    assert np.abs(got - exact).max() <= 0.15 * np.abs(exact).max()


def test_the_largest_value_is_448_not_nan():
    x = np.array([[448.0, -1e-3, 3.0, -448.0]], np.float32) * np.float32(1.7)
    codes, scale = fp8.quantize_rows(jnp.asarray(x))
    values = np.asarray(codes, np.float32) * np.asarray(scale)[:, None]
    assert np.isfinite(values).all() and np.abs(np.asarray(codes, np.float32)).max() == 448
    np.testing.assert_allclose(values[0, [0, 3]], x[0, [0, 3]], rtol=1e-6)


def test_bad_shapes_say_what_is_expected():
    with pytest.raises(ValueError, match=r"w must be \[..., K, N\]; got shape \(3,\)"):
        fp8.quantize_weight(jnp.ones(3))
    with pytest.raises(ValueError, match=r"x must be \[..., K\]; got shape \(\)"):
        fp8.quantize_rows(jnp.float32(1))
