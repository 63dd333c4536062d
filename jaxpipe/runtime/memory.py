"""Memory as the OS and the devices see it: what is free, how freed pages go back, and zeroed
arrays whose pages are taken only as they are written.

CPU devices (virtual ones included) share the host's RAM: `MemAvailable` of /proc/meminfo.
An accelerator reports its own: `bytes_limit - bytes_in_use` of `Device.memory_stats()`,
summed over the devices. None where neither is known (the check is then skipped).
How the engine divides that memory (KV pool, host tier, sequences) is `jaxpipe.runtime.sizing`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpipe.kernels import empty

MEMINFO = Path("/proc/meminfo")


def host_available_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (Linux), or None."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def clear(array) -> bool:
    """Zero a CPU array in place, cheaply: its whole pages go back to the OS (they read as
    zeros and take memory again only once written) and the partial pages at either end of
    each shard are written with zeros. No computation may be using the array, and its
    buffers must be its own (a `device_put` of a NumPy array may alias the NumPy array's
    memory). False, with nothing done, off CPU or off Linux."""
    madvise = _madvise()
    if madvise is None or any(s.device.platform != "cpu" for s in array.addressable_shards):
        return False
    for shard in array.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        end = start + shard.data.nbytes
        first = min(-(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end)
        last = max(end // mmap.PAGESIZE * mmap.PAGESIZE, first)
        if last > first and madvise(first, last - first, MADV_DONTNEED) != 0:
            ctypes.memset(first, 0, last - first)
        ctypes.memset(start, 0, first - start)
        ctypes.memset(last, 0, end - last)
    return True


def zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
    """A zeroed array in `sharding` (its buffers its own, so a program may take it donated and
    write it in place). On CPU under Linux it costs no memory until written: each shard is
    allocated unwritten (`kernels/empty.cc`) and `clear`ed, so its pages are the OS's zero
    pages until a block is written. A program that writes the zeros takes every page at once
    until `clear` gives them back: a default engine (a 6.7 GiB KV pool) peaked at 4.5 GB of
    RSS at start that way, 1.55 GB this way. Where the allocation cannot be built (no C++
    compiler) the zeros are written, then cleared; off CPU they are written."""
    lazy = (math.prod(shape) > 0 and all(d.platform == "cpu" for d in sharding.device_set)
            and _madvise() is not None and empty.available())
    if lazy:
        array = jax.block_until_ready(empty.empty(shape, dtype, sharding))
    else:
        array = jax.block_until_ready(_filled(tuple(shape), jnp.dtype(dtype), sharding)())
    clear(array)
    return array


@functools.cache
def _filled(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


MADV_DONTNEED = 4
_MADVISE = []


def _madvise():
    if not _MADVISE:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _MADVISE.append(fn)
    return _MADVISE[0]


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED_BYTES = 1 << 30  # free memory at a heap's top kept for reuse (M_TRIM_THRESHOLD)


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve every allocation from its heaps and keep what is freed for
    reuse (process-wide), instead of mapping each large block fresh from the OS and
    unmapping it when freed. XLA's CPU runtime allocates a program's buffers at every
    execution; a buffer over malloc's mmap threshold (32 MiB at most) then costs a page fault
    and a page of zeros per 4 KiB touched, every step: the bf16 kernel's [4096, 3072] output
    ran at 424 GFLOP/s with 12,289 faults a call, 911 without; the default workload took
    114.9 s before, 100.2 s after (scripts/profile_step.py). `release_freed_memory` gives the
    free memory back. False (nothing done) where the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def release_freed_memory() -> None:
    """Give the memory malloc holds free back to the OS (`malloc_trim`; glibc only)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def free_bytes(devices) -> int | None:
    """Bytes the devices have free (one shared figure for CPU devices), or None."""
    if devices[0].platform == "cpu":
        return host_available_bytes()
    total = 0
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        total += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return total


def describe(devices) -> str:
    """Where `free_bytes` comes from, for messages."""
    if devices[0].platform == "cpu":
        return "host RAM, MemAvailable"
    return f"{len(devices)} device(s), memory_stats"
