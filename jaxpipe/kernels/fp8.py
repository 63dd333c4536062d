"""The arithmetic of dynamic fp8 W8A8 (`quantization="fp8"`), in jnp, beside `int8.py`: e4m3
weights with a scale per output channel, e4m3 activations with a scale per token, products
summed in f32 by XLA's dot on float8_e4m3fn operands. For GPUs (Hopper and later multiply
e4m3 natively); on CPU XLA upcasts, so this is where the numbers are checked, not timed.

- A weight w [..., K, N]: s_w[n] = max_k |w[k, n]| * f32(1 / 448) (448: e4m3's largest
  finite value), q_w = e4m3(clip(w * f32(1 / s_w), -448, 448)) (round to nearest even in
  the cast). Products by reciprocals, not divisions, as `int8.py` defines its own: XLA may
  rewrite a division so, and then only the products reproduce to the bit.
- Activations x [..., K], per row: s_x[m] = max_k |x[m, k]| * f32(1 / 448), q_x likewise.
- y[m, n] = (sum_k f32(q_x[m, k]) f32(q_w[k, n])) * s_w[n] * s_x[m], the sum in f32.
A slice of zeros gets scale 1 (codes 0). The clip matters: e4m3fn has no infinity, a value
rounded past 448 by the division would become NaN in the cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPE = jnp.float8_e4m3fn
FMAX = 448.0  # e4m3fn's largest finite value
STEP = np.float32(1 / FMAX)


def _quantize(v, axis: int) -> tuple[jax.Array, jax.Array]:
    """v's e4m3 codes (same shape) and f32 scales (`axis` removed), per slice along `axis`."""
    v = jnp.asarray(v, jnp.float32)
    amax = jnp.max(jnp.abs(v), axis=axis, keepdims=True, initial=0.0)
    scale = jnp.where(amax > 0, amax * STEP, jnp.float32(1))
    codes = jnp.clip(v * (1 / scale), -FMAX, FMAX).astype(DTYPE)
    return codes, jnp.squeeze(scale, axis)


def quantize_weight(w) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (codes [..., K, N] e4m3, scales [..., N] f32): a scale per column."""
    if jnp.ndim(w) < 2:
        raise ValueError(f"fp8.quantize_weight: w must be [..., K, N]; got shape {jnp.shape(w)}")
    return _quantize(w, -2)


def quantize_rows(x) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (codes [..., K] e4m3, scales [...] f32): a scale per row (token)."""
    if jnp.ndim(x) < 1:
        raise ValueError(f"fp8.quantize_rows: x must be [..., K]; got shape {jnp.shape(x)}")
    return _quantize(x, -1)


def accumulate(x_codes, w_codes, dimension_numbers) -> jax.Array:
    """XLA's dot_general of e4m3 operands, summed in f32 (`jax.lax.dot_general` with
    `preferred_element_type=f32`)."""
    return jax.lax.dot_general(x_codes, w_codes, dimension_numbers,
                               preferred_element_type=jnp.float32)


def reference(x, w_codes, w_scale) -> jax.Array:
    """x [..., K] (any float dtype, quantized per row here) @ an e4m3 weight (w_codes [K, N],
    w_scale [N]) -> [..., N] f32."""
    x_codes, x_scale = quantize_rows(x)
    acc = accumulate(x_codes, w_codes, (((x_codes.ndim - 1,), (0,)), ((), ())))
    return acc * w_scale * x_scale[..., None]
