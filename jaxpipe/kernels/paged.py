"""The paged KV pool as every attention path reads it: pools of blocks [L, NB, Hkv, BS, D]
(`kv/device_cache.py` holds the engine's), addressed through block tables whose entries past a
sequence's blocks hold `OUT_OF_RANGE` (writes there are dropped, reads never look at them), and
the dtype the pool is *stored* in.

bf16 caches are stored on CPU as their uint16 bit patterns: XLA's CPU backend upcasts bf16
buffers to f32 around a dynamic-update-slice or scatter, turning each one-token write into a
copy of the whole cache (measured: 84 ms per layer write at 64 slots x 2048 tokens, vs 0.01 ms
as u16). `to_storage` / `from_storage` are the only places that know this.

An int8 cache (`kv_cache_dtype="int8"`) is stored as rows of D codes and a bf16 scale
(`kernels/kv_int8.py`): its pools are [L, NB, Hkv, BS, D + 2] int8, `to_storage` quantizes and
`from_storage` dequantizes (to f32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.kernels import kv_int8

KV_CACHE_DTYPES = ("auto", "int8")  # EngineConfig.kv_cache_dtype: "auto" is the model's dtype


def storage_dtype(dtype, platform: str = "cpu", kv_cache_dtype: str = "auto") -> jnp.dtype:
    """The dtype cache buffers are kept in for a compute dtype on `platform`: int8 for
    kv_cache_dtype "int8"; else bf16 as its u16 bits on CPU (the module docstring), as itself
    elsewhere."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8)
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    return jnp.dtype(jnp.uint16) if bf16 and platform == "cpu" else jnp.dtype(dtype)


def row_width(head_dim: int, stored) -> int:
    """The last axis of a pool of `stored` dtype for vectors of `head_dim`: D + 2 for int8
    (codes and scale), D otherwise."""
    return kv_int8.row_width(head_dim) if jnp.dtype(stored) == jnp.int8 else head_dim


def head_dim_of(pool) -> int:
    """The head dim of the vectors a pool [..., W] stores (`row_width`'s inverse)."""
    width = pool.shape[-1]
    return kv_int8.head_dim_of(width) if pool.dtype == jnp.int8 else width


def to_storage(x: jax.Array, cache: jax.Array) -> jax.Array:
    """Values about to be written into `cache` (any float dtype; [..., D]) -> the cache's
    storage dtype (int8: quantized rows [..., D + 2])."""
    if cache.dtype == jnp.int8:
        return kv_int8.quantize(x)
    if cache.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(cache.dtype)


def from_storage(x: jax.Array) -> jax.Array:
    """A slice read from the cache -> its compute dtype (free: a bitcast; int8 rows
    [..., D + 2] -> f32 [..., D], dequantized)."""
    if x.dtype == jnp.int8:
        return kv_int8.dequantize(x)
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x


# ---- addressing tokens through a block table ---------------------------------------------------


OUT_OF_RANGE = np.iinfo(np.int32).max  # a block id past every pool: writes there are dropped


def gather(x, table, length: int):
    """Positions 0..length-1 of each table row: x [NB, Hkv, BS, D] (BS: the pool's block
    size, BLOCK in the engine), table [b, MB] -> [b, Hkv, length, D]. Blocks past the table,
    or out of range, read clipped garbage (callers mask positions past each row's length)."""
    bs = x.shape[2]
    nb = -(-length // bs)
    cols = jnp.minimum(jnp.arange(nb), table.shape[1] - 1)
    blocks = jnp.take(x, table[:, cols], axis=0, mode="clip")  # [b, nb, Hkv, BS, D]
    b, _, hkv, _, d = blocks.shape
    out = blocks.transpose(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, d)
    return out[:, :, :length]


