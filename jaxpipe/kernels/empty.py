"""An array XLA allocates and no program writes (`empty.cc`): the CPU's missing
`AllocateBuffer`. `jaxpipe.runtime.memory.zeros` clears it without touching its pages."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpipe.kernels.build import register

SOURCE = Path(__file__).with_name("empty.cc")
TARGET = "jaxpipe_empty"


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the handler; False, with a warning, if it
    cannot be built (or the backend is not the CPU)."""
    what = "the unwritten allocation of the KV pool"
    return register(SOURCE, "JaxpipeEmpty", TARGET, what) is not None


def empty(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
    """An uninitialised array of `shape` and `dtype` in `sharding`: each device allocates its
    own shard (a custom call is not partitioned: it runs inside `shard_map`). Call only where
    `available()`."""
    return _program(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _program(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    local = jax.ShapeDtypeStruct(sharding.shard_shape(shape), dtype)
    shard = jax.shard_map(lambda: jax.ffi.ffi_call(TARGET, local)(), mesh=sharding.mesh,
                          in_specs=(), out_specs=sharding.spec, check_vma=False)
    return jax.jit(shard, out_shardings=sharding)
