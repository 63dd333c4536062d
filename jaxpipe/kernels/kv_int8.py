"""The int8 KV cache's arithmetic (`kv_cache_dtype="int8"`): one place that says how a K or V
vector is stored and read back; every attention path, the step's writes and the tests' float64
reference follow it.

A token's vector of one KV head, x [D], is stored as one row of D + 2 int8s: D codes and its
scale, a bfloat16 (its bit pattern: low byte at D, high byte at D + 1):

    scale = max|x| / 127, rounded *up* to bf16      codes = rint(x / scale)  (in [-127, 127])
    x ~= codes * scale                              (error <= scale / 2 per element)

Symmetric, one scale per token and KV head, as KIVI / LMDeploy's int8 KV keep them: a token's
row is written once (the step that computes it) and never rescaled, so the cache is append-only
as in bf16. Scales are bf16, not f32: the codes are computed against the rounded scale, so bf16
costs nothing but a step at most 2^-8 larger; f32 would make a head-dim-64 row 68 bytes (1.88x
bf16's tokens in the same memory) where bf16 makes it 66 (1.94x). Keeping the scale inside the
row means a pool is still one array per K and V, [L, NB, Hkv, BS, D + 2] int8: the host tier,
the layout switch, prefix caching and the block copies move codes and scales together, untouched,
and a kernel reads a token's codes and scale from one contiguous row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_BYTES = 2  # a bf16 scale at the end of each row
QMAX = 127  # codes in [-QMAX, QMAX]: symmetric, -128 unused


def row_width(head_dim: int) -> int:
    """Int8s in a stored row of a head-dim `head_dim` vector: its codes and its scale."""
    return head_dim + SCALE_BYTES


def head_dim_of(width: int) -> int:
    """The head dim whose rows are `width` int8s wide (`row_width`'s inverse)."""
    return width - SCALE_BYTES


def scale_bits(amax):
    """max|x| [...] f32 -> the bf16 bits [...] u32 of its scale, max|x| / 127 rounded up to bf16
    (so no code exceeds 127). Non-negative inputs only (a magnitude)."""
    bits = jax.lax.bitcast_convert_type((amax / QMAX).astype(jnp.float32), jnp.uint32)
    return (bits + 0xFFFF) >> 16  # ceil to bf16: the discarded low mantissa bits round up


def bits_to_scale(bits):
    """bf16 bits [...] (any unsigned int dtype) -> the scale [...] f32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


def quantize(x):
    """x [..., D] (any float dtype) -> stored rows [..., D + 2] int8 (the module docstring)."""
    x = x.astype(jnp.float32)
    bits = scale_bits(jnp.max(jnp.abs(x), axis=-1))  # [...]
    scale = bits_to_scale(bits)
    codes = jnp.rint(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    codes = jnp.clip(codes, -QMAX, QMAX).astype(jnp.int8)  # a no-op but for NaN / inf inputs
    tail = jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)  # [..., 2] lo, hi
    return jnp.concatenate([codes, jax.lax.bitcast_convert_type(tail, jnp.int8)], axis=-1)


def scales(rows):
    """Stored rows [..., D + 2] int8 -> their scales [...] f32."""
    tail = jax.lax.bitcast_convert_type(rows[..., -SCALE_BYTES:], jnp.uint8).astype(jnp.uint32)
    return bits_to_scale(tail[..., 0] | tail[..., 1] << 8)


def dequantize(rows, dtype=jnp.float32):
    """Stored rows [..., D + 2] int8 -> the vectors [..., D] in `dtype` (codes * scale, in
    f32, then cast)."""
    codes = rows[..., :-SCALE_BYTES].astype(jnp.float32)
    return (codes * scales(rows)[..., None]).astype(dtype)
