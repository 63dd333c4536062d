"""The arithmetic of dynamic W8A8 (`quantization="int8"`), in jnp: what every int8 matmul
path computes, and XLA's int8 dot as the portable path and the numerics reference.

- A weight w [..., K, N] is quantized once, per output column (`quantize_weight`): scale
  s_w[n] = max_k |w[k, n]| * f32(1 / 127), q_w = round(w * f32(1 / s_w)) in [-127, 127].
- Activations x [..., K] are quantized at run time, per row (token; `quantize_rows`):
  s_x[m] = max_k |x[m, k]| * f32(1 / 127), q_x = round(x * f32(1 / s_x)) in [-127, 127].
  Symmetric, so a row's zero is exactly 0 and no zero point enters the sums.
- acc[m, n] = sum_k q_x[m, k] q_w[k, n], exact in int32 (|acc| <= 127^2 K < 2^31 for
  K < 133,000), and y = (f32(acc) * s_w[n]) * s_x[m] in f32, that order on every path.

Both sides are signed and -128 is never produced: the C++ kernel's avx2 path (vpmaddubsw)
relies on |w| <= 127 to stay clear of s16 saturation, and its VNNI paths (vpdpbusd, u8 x s8)
add the zero point 128 to the weight in registers and take 128 * sum_k q_x back off per row
(`int8_matmul.cc`). Rounding is to nearest, ties to even (jnp.round); a row or column of
zeros gets scale 1 (its codes are 0, so its outputs are 0). A row with inf or NaN yields NaN.

Error: each code is within half a step (s / 2) of its value, so |y - x @ w| is at most
sum_k (|x_k| s_w / 2 + |w_k| s_x / 2 + s_x s_w / 4) (tests/kernel_tests/test_int8_matmul.py
checks it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127  # codes are in [-QMAX, QMAX]: symmetric, never -128
# A scale is max |v| times f32(1 / 127), not max |v| / 127, and codes are v times f32(1 /
# scale), not v / scale: XLA may rewrite a division into a product by the reciprocal (one
# division per slice, a product per element), so the products are the definition, one that any
# other implementation reproduces to the bit.
STEP = np.float32(1 / QMAX)


def _quantize(v, axis: int) -> tuple[jax.Array, jax.Array]:
    """v's codes (int8, same shape) and scales (f32, `axis` removed): per slice along `axis`,
    scale = max |v| * STEP (1 where that is 0), codes = round(v * (1 / scale))."""
    v = jnp.asarray(v, jnp.float32)
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=True, initial=0.0)  # K = 0: scale 1
    scale = jnp.where(amax > 0, amax * STEP, jnp.float32(1))
    codes = jnp.clip(jnp.round(v * (1 / scale)), -QMAX, QMAX).astype(jnp.int8)
    return codes, jnp.squeeze(scale, axis)


def quantize_weight(w) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (codes [..., K, N] int8, scales [..., N] f32): one scale per output
    column (max over K of |w| * STEP), in natural order (`int8_matmul.pack` reorders codes)."""
    if jnp.ndim(w) < 2:
        raise ValueError(f"quantize_weight: w must be [..., K, N]; got shape {jnp.shape(w)}")
    return _quantize(w, -2)


def quantize_rows(x) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (codes [..., K] int8, scales [...] f32): one scale per row (token)."""
    if jnp.ndim(x) < 1:
        raise ValueError(f"quantize_rows: x must be [..., K]; got shape {jnp.shape(x)}")
    return _quantize(x, -1)


def dequantize(codes, scales, axis: int) -> jax.Array:
    """codes * scales (f32), the scales broadcast along `axis` (-2: a weight's, -1: rows')."""
    return codes.astype(jnp.float32) * jnp.expand_dims(scales, axis)


def scaled(acc, x_scale, w_scale) -> jax.Array:
    """y [..., N] f32 = (f32(acc) * w_scale[n]) * x_scale[...]: the order every path uses."""
    return acc.astype(jnp.float32) * w_scale * x_scale[..., None]


def quantized_reference(x_codes, x_scale, w_codes, w_scale) -> jax.Array:
    """XLA's int8 dot of quantized operands (natural order): x [..., K] int8, x_scale [...],
    w [K, N] int8, w_scale [N] -> y [..., N] f32 (int32 sums, then `scaled`)."""
    acc = jax.lax.dot_general(x_codes, w_codes, (((x_codes.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return scaled(acc, x_scale, w_scale)


def reference(x, w_codes, w_scale) -> jax.Array:
    """x [..., K] (any float dtype, quantized per row here) @ a quantized weight (w_codes [K,
    N] int8 in natural order, w_scale [N]) -> [..., N] f32, through XLA's int8 dot."""
    x_codes, x_scale = quantize_rows(x)
    return quantized_reference(x_codes, x_scale, w_codes, w_scale)


def accumulate(x_codes, w_codes, dimension_numbers) -> jax.Array:
    """XLA's dot_general of int8 codes, exact int32 sums (what `quantized_reference` runs,
    for callers with other contractions: an MoE layer's experts)."""
    return jax.lax.dot_general(x_codes, w_codes, dimension_numbers,
                               preferred_element_type=jnp.int32)
