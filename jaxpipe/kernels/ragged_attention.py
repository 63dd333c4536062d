"""Placeholder until the kernel branch lands: the XLA reference of ragged-span attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpipe.kv.device_cache import from_storage, gather
from jaxpipe.model import llama


def available() -> bool:
    return False


def ragged_attention(q, k, v, table, q_start, q_len, kv_len, layer=0):
    raise RuntimeError("the ragged attention kernel is not built")


def reference(q, k, v, table, q_start, q_len, kv_len, layer=0, max_kv: int | None = None):
    """Each span's queries over its row's first `max_kv` paged positions, causal."""
    k, v = (k[None] if k.ndim == 4 else k), (v[None] if v.ndim == 4 else v)
    t = q.shape[0]
    r = table.shape[0]
    bs = k.shape[3]
    max_kv = max_kv or table.shape[1] * bs
    idx = jnp.arange(t)[:, None]
    inside = (idx >= q_start[None, :]) & (idx < (q_start + q_len)[None, :])  # [T, R]
    has = inside.any(axis=1)
    row = jnp.argmax(inside, axis=1)
    pos = kv_len[row] - q_len[row] + (jnp.arange(t) - q_start[row])
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k.shape[0] - 1)
    rows_table = jnp.clip(table, 0, k.shape[1] - 1)[jnp.where(has, row, 0)]  # [T, MB]
    del r

    def keys(pool):
        x = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)
        return from_storage(gather(x, rows_table, max_kv))

    out = llama.decode_attention(q, keys(k), keys(v), pos)
    return jnp.where(has[:, None, None], out, 0.0)
