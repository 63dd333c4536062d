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

The pool's storage dtype (bf16 as u16 bits on CPU; int8 with `kv_cache_dtype="int8"`, each
row D codes and its scale, [.., D + 2], `kernels/kv_int8.py`), `OUT_OF_RANGE` and the gather
through a block table are the kernels' (`kernels/paged.py`): every attention path reads the
pool the same way. Everything here moves rows whatever they hold, so an int8 pool's codes and
scales travel together (host tier, layout switch, prefix cache) with no float round trip.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

BLOCK = 16  # tokens per KV block


class KVCache(NamedTuple):
    """Keys and values of the block pool, every layer's. Donated through each step."""

    k: jax.Array  # [L, NB, Hkv, BLOCK, D] (int8: [L, NB, Hkv, BLOCK, D + 2], scales inside)
    v: jax.Array  # [L, NB, Hkv, BLOCK, D] (int8: as k)


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // BLOCK)


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
