"""The paged KV pool as every attention path reads it: pools of blocks [L, NB, Hkv, BS, D]
(`kv/device_cache.py` holds the engine's), addressed through block tables whose entries past a
sequence's blocks hold `OUT_OF_RANGE` (writes there are dropped, reads never look at them), and
the dtype the pool is *stored* in.

bf16 caches are stored on CPU as their uint16 bit patterns: XLA's CPU backend upcasts bf16
buffers to f32 around a dynamic-update-slice or scatter, turning each one-token write into a
copy of the whole cache (measured: 84 ms per layer write at 64 slots x 2048 tokens, vs 0.01 ms
as u16). `to_storage` / `from_storage` are the only places that know this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def storage_dtype(dtype, platform: str = "cpu") -> jnp.dtype:
    """The dtype cache buffers are kept in for a compute dtype on `platform`: bf16 as its u16
    bits on CPU (the module docstring), as itself elsewhere."""
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    return jnp.dtype(jnp.uint16) if bf16 and platform == "cpu" else jnp.dtype(dtype)


def to_storage(x: jax.Array, cache: jax.Array) -> jax.Array:
    """Values about to be written into `cache` (any float dtype) -> the cache's storage dtype."""
    if cache.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(cache.dtype)


def from_storage(x: jax.Array) -> jax.Array:
    """A slice read from the cache -> its compute dtype (free: a bitcast)."""
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


