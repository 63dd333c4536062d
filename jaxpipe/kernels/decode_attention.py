"""Decode attention as a C++ CPU kernel called through `jax.ffi`, with the XLA fallback.

XLA's CPU backend runs the decode attention einsums at ~4 GB/s and can only bound the keys read
by a static length, so every row pays for the longest row of its block. The kernel reads each
row's own `lengths[b]` positions and nothing more, at close to memory speed (figures in
scripts/bench_attention.py). The math is `llama.decode_attention`'s; the cache is a paged pool
read in place through a block table (a dense cache is a pool with an identity table), and
lengths replace positions.

The pool is [L, NB, Hkv, BS, D]: L layers (a pipeline stage's whole stack, so that a `lax.scan`
over layers passes it unsliced and names the layer with a traced index), NB blocks of BS tokens.
Position t of row b is k[layer, table[b, t // BS], :, t % BS]. A block's tokens are contiguous
per head, so the kernel walks each row block by block.

Out-of-range inputs are defined, never read out of bounds:
  - lengths[b] is clamped to [0, MB * BS] (MB = table.shape[1]);
  - if a block row b needs (j < ceil(length / BS)) has a table entry outside [0, NB), the row
    attends over positions 0..j*BS-1 only, j the first such block (zeros if j = 0); entries
    of blocks a row does not need are never looked at;
  - layer is clamped to [0, L).

A custom call cannot be partitioned by the SPMD partitioner: on a sharded layout call it inside
`jax.shard_map`, heads split over the tensor-parallel axis.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.kernels.build import KernelBuildError, build
from jaxpipe.kv.device_cache import from_storage, gather
from jaxpipe.model import llama

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "jaxpipe_decode_attention"
log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if it cannot."""
    if jax.default_backend() != "cpu":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(SOURCE)))
    except (KernelBuildError, OSError) as e:
        log.warning("decode attention kernel unavailable, using XLA attention: %s", e)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxpipeDecodeAttention),
                                platform="cpu")
    return True


def decode_attention(q, k, v, lengths, table, layer=0):
    """Attention of one query per row over its paged keys and values.

    q [B, H, D] f32; k, v [L, NB, Hkv, BS, D] (f32, bf16, or bf16 stored as u16), or
    [NB, Hkv, BS, D] for L = 1; lengths [B] i32: row b attends over positions
    0..lengths[b]-1 (0 = idle row, output zeros); table [B, MB] i32: the pool block holding
    each row's positions j*BS..(j+1)*BS-1; layer: python int or traced i32 scalar, the layer
    of the pool to read. Returns [B, H, D] f32. Edge cases: see the module docstring."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the decode attention kernel cannot be built here; use reference()")
    k, v = _as_pool(k), _as_pool(v)
    _check_shapes(q, k, v, lengths, table)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), k, v, lengths.astype(jnp.int32),
                                         table.astype(jnp.int32), jnp.asarray(layer, jnp.int32))


def reference(q, k, v, lengths, table, layer=0):
    """The same contract in plain jnp (the XLA math of `llama.decode_attention`), for tests and
    as its documentation: gather each row's blocks into [B, Hkv, MB * BS, D] and attend."""
    k, v = _as_pool(k), _as_pool(v)
    num_layers, num_blocks, _, block_size, _ = k.shape
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    lengths = usable_lengths(lengths, table, num_blocks, block_size)
    blocks = jnp.clip(table, 0, num_blocks - 1)  # entries past a row's usable length are masked

    def rows(pool):  # [L, NB, Hkv, BS, D] -> [B, Hkv, MB * BS, D]
        x = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)
        return from_storage(gather(x, blocks, table.shape[1] * block_size))

    out = llama.decode_attention(q, rows(k), rows(v), lengths - 1)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)


def usable_lengths(lengths, table, num_blocks: int, block_size: int):
    """lengths [B] clamped to [0, MB * BS] and cut before the first block a row needs whose
    table [B, MB] entry is outside [0, num_blocks) -> [B] i32 (what the kernel attends over)."""
    max_blocks = table.shape[1]
    bad = (table < 0) | (table >= num_blocks)  # [B, MB]
    first_bad = jnp.where(bad.any(axis=1), jnp.argmax(bad, axis=1), max_blocks)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_blocks * block_size)
    return jnp.minimum(lengths, first_bad * block_size).astype(jnp.int32)


def _as_pool(x):
    """A rank-4 pool [NB, Hkv, BS, D] -> [1, NB, Hkv, BS, D] (a free reshape); rank 5 as is."""
    return x[None] if x.ndim == 4 else x


def _check_shapes(q, k, v, lengths, table) -> None:
    if q.ndim != 3 or k.ndim != 5 or k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"decode_attention: q must be [B, H, D] and k, v [L, NB, Hkv, BS, D] "
                         f"or [NB, Hkv, BS, D] with the same D; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    b, h = q.shape[:2]
    if h % k.shape[2]:
        raise ValueError(f"decode_attention: {h} query heads is not a multiple of "
                         f"{k.shape[2]} kv heads")
    if lengths.shape != (b,) or table.ndim != 2 or table.shape[0] != b:
        raise ValueError(f"decode_attention: lengths must be [B] and table [B, MB] with "
                         f"B = {b}; got lengths {lengths.shape}, table {table.shape}")
    if k.dtype != v.dtype or k.dtype not in (jnp.float32, jnp.bfloat16, jnp.uint16):
        raise ValueError(f"decode_attention: k and v must both be float32, bfloat16 or uint16 "
                         f"(bf16 bits); got {k.dtype} and {v.dtype}")
