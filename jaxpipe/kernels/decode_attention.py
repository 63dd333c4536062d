"""Decode attention as a C++ CPU kernel called through `jax.ffi`, with the XLA fallback.

XLA's CPU backend runs the decode attention einsums at ~4 GB/s and can only bound the keys read
by a static length, so every row pays for the longest row of its block. The kernel reads each
row's own `lengths[b]` positions and nothing more, at close to memory speed (figures in
scripts/bench_attention.py). Same contract as `llama.decode_attention` except that the cache is
passed whole (rows 0..B-1 are read in place, no slice copy) and lengths replace positions.

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
from jaxpipe.kv.device_cache import from_storage
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


def decode_attention(q, k, v, lengths):
    """q [B, H, D] f32; k, v [N >= B, Hkv, S, D] (f32, or bf16 stored as u16); lengths [B] i32
    (positions attended per row; 0 = idle row, output zeros) -> [B, H, D] f32."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the decode attention kernel cannot be built here; use reference()")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), k, v,
                                         lengths.astype(jnp.int32))


def reference(q, k, v, lengths):
    """The same contract in plain jnp (the XLA path), for tests and the fallback."""
    b = q.shape[0]
    kk, vv = from_storage(k[:b]), from_storage(v[:b])
    out = llama.decode_attention(q, kk, vv, lengths - 1)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)
