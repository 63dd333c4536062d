"""The device KV store: a pool of fixed-size blocks, HND layout per block, and block tables.

The store is a pool of `num_blocks` blocks of `BLOCK` tokens; K and V are each `[layers, blocks,
kv_heads, BLOCK, head_dim]` (layers split over a layout's pp, KV heads over its tp;
`sharding.KV_AXES` names the axes). A sequence holds as many blocks as its KV needs, wherever
they are in the pool; its row of a *block table* `[rows, max_blocks]` lists them in order:
position t of table row r is at block `table[r, t // BLOCK]`, offset `t % BLOCK`. So the store's
capacity is counted in tokens (blocks), not in sequences of the longest length, and a sequence
grows one block at a time. Entries past a sequence's blocks hold `OUT_OF_RANGE`: writes there
are dropped.

HND inside a block keeps each (block, head) contiguous over tokens, which is what attention
reads (measured on CPU: attention's einsum over an NHD cache ran 4x slower than over HND). The
pool is donated to each step and updated in place.

bf16 caches are *stored* on CPU as their uint16 bit patterns: XLA's CPU backend upcasts bf16
buffers to f32 around a dynamic-update-slice or scatter, turning each one-token write into a
copy of the whole cache (measured: 84 ms per layer write at 64 slots x 2048 tokens, vs 0.01 ms
as u16). `to_storage` / `from_storage` are the only places that know this.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16  # tokens per KV block


class KVCache(NamedTuple):
    """Keys and values of the block pool, every layer's. Donated through each step."""

    k: jax.Array  # [L, NB, Hkv, BLOCK, D]
    v: jax.Array  # [L, NB, Hkv, BLOCK, D]


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


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // BLOCK)


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


# ---- one sequence in and out (the host KV tier's copies) -----------------------------------------


@partial(jax.jit, static_argnames=("length", "block_axis"))
def read_blocks(caches, blocks, *, length: int, block_axis: int = 0):
    """Positions 0..length-1 of the sequence held in `blocks` [>= blocks_for(length)] (in
    order): every array of `caches` (a pytree of [..., NB, Hkv, BLOCK, D], the block axis at
    `block_axis`) -> [..., Hkv, length, D]."""
    nb = blocks_for(length)

    def one(x):
        picked = jnp.take(x, blocks[:nb], axis=block_axis, mode="clip")  # [.., nb, Hkv, BLK, D]
        picked = jnp.moveaxis(picked, block_axis, -3)  # [..., Hkv, nb, BLOCK, D]
        shape = picked.shape[:-3] + (nb * BLOCK, picked.shape[-1])
        return picked.reshape(shape)[..., :length, :]

    return jax.tree.map(one, caches)


@partial(jax.jit, static_argnames="block_axis", donate_argnames="caches")
def write_blocks(caches, blocks, values, *, block_axis: int = 0):
    """`caches` (donated) with `values` (as `read_blocks` gives them, [..., Hkv, length, D])
    written at positions 0..length-1 of the sequence in `blocks` (entries out of range:
    dropped)."""
    def one(x, value):
        length = value.shape[-2]
        nb = blocks_for(length)
        pad = [(0, 0)] * value.ndim
        pad[-2] = (0, nb * BLOCK - length)
        value = jnp.pad(value, pad)
        value = value.reshape(value.shape[:-2] + (nb, BLOCK, value.shape[-1]))
        value = jnp.moveaxis(value, -3, block_axis)  # the blocks axis where the pool has it
        index = [slice(None)] * x.ndim
        index[block_axis] = blocks[:nb]
        return x.at[tuple(index)].set(value, mode="drop")

    return jax.tree.map(one, caches, values)
