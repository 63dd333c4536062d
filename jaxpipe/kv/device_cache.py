"""The device KV store: one slot per running sequence, HND layout per slot.

The store is a tuple of per-layer caches, each `[slots, kv_heads, seq, head_dim]`, so each
layer's buffer is donated and updated on its own (and can live on its pipeline stage). HND keeps
each (sequence, head) contiguous over tokens, which is what attention over the cache reads
(DESIGN.md: HND is 4x faster than NHD here).

bf16 caches are *stored* as their uint16 bit patterns: XLA's CPU backend upcasts bf16 buffers
to f32 around a dynamic-update-slice or scatter, turning each one-token write into a copy of
the whole cache (measured: 84 ms per layer write at 64 slots x 2048 tokens, vs 0.01 ms as u16).
`to_storage` / `from_storage` are the only places that know this.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpipe.config import ModelConfig

# Logical axes of each cache array; the sharding rules map them to mesh axes.
KV_AXES = ("batch", "kv_heads", "seq", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every slot for one layer. Donated through each step."""

    k: jax.Array  # [N, Hkv, S, D]
    v: jax.Array  # [N, Hkv, S, D]


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype cache buffers are kept in for a compute dtype."""
    return jnp.dtype(jnp.uint16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


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


def allocate(cfg: ModelConfig, num_slots: int, max_len: int, dtype) -> tuple[KVCache, ...]:
    """Zeroed per-layer caches for `num_slots` sequences of up to `max_len` tokens."""
    shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    store = storage_dtype(dtype)
    return tuple(KVCache(jnp.zeros(shape, store), jnp.zeros(shape, store))
                 for _ in range(cfg.num_layers))


def cache_bytes(cfg: ModelConfig, num_slots: int, max_len: int, dtype_bytes: int) -> int:
    return num_slots * max_len * cfg.kv_bytes_per_token(dtype_bytes)


# ---- one slot in and out (the host KV tier's copies) --------------------------------------------


@partial(jax.jit, static_argnames=("length", "slot_axis"))
def read_slot(caches, slot, *, length: int, slot_axis: int = 0):
    """Positions 0..length-1 of one slot: every array of `caches` (a pytree of
    [..., N, Hkv, S, D], the slot axis at `slot_axis`) -> [..., Hkv, length, D]."""
    def one(x):
        x = jax.lax.dynamic_index_in_dim(x, slot, slot_axis, keepdims=False)
        return jax.lax.dynamic_slice_in_dim(x, 0, length, axis=x.ndim - 2)

    return jax.tree.map(one, caches)


@partial(jax.jit, static_argnames="slot_axis", donate_argnames="caches")
def write_slot(caches, slot, values, *, slot_axis: int = 0):
    """`caches` (donated) with `values` (as `read_slot` gives them) written at positions
    0..length-1 of `slot`."""
    def one(x, value):
        start = [0] * x.ndim
        start[slot_axis] = slot
        return jax.lax.dynamic_update_slice(x, jnp.expand_dims(value, slot_axis), start)

    return jax.tree.map(one, caches, values)
