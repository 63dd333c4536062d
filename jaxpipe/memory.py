"""Free memory of the engine's devices, and the budgets the engine sizes from it.

CPU devices (virtual ones included) share the host's RAM: `MemAvailable` of /proc/meminfo.
An accelerator reports its own: `bytes_limit - bytes_in_use` of `Device.memory_stats()`,
summed over the devices. None where neither is known (the check is then skipped).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
from dataclasses import dataclass
from pathlib import Path

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


# ---- budgets ----------------------------------------------------------------------------------

ACCELERATOR_UTILIZATION = 0.9
# CPU: the pool's pages are taken only as blocks are written (`clear`), so a pool sized for
# a full batch (256 rows of a few hundred tokens: ~8 GiB of SmolLM2 bf16 KV on a 24 GiB
# machine) costs memory only as the batch fills it.
CPU_UTILIZATION = 0.4
HOST_TIER_FRACTION = 0.1
ASSUMED_FREE = 4 * 2**30  # where a backend reports nothing
ACTIVATION_FACTOR = 3


@dataclass(frozen=True)
class Budget:
    """Bytes the engine may give its device KV pool and its host KV tier, and what set them
    (for messages): an explicit setting, or a fraction of the free memory."""

    pool_bytes: float
    pool_setting: str
    host_bytes: float
    host_setting: str


def utilization(config, devices) -> float:
    """`memory_utilization`, or its default for the platform: 0.9 of an accelerator's free
    memory after the weights (vLLM's `gpu_memory_utilization`); 0.4 of the host's available
    RAM for CPU devices, which share it with the host KV tier, the compiled programs, the OS
    and other programs (the pool's pages are taken only as blocks are written, `clear`)."""
    if config.memory_utilization is not None:
        return config.memory_utilization
    return CPU_UTILIZATION if devices[0].platform == "cpu" else ACCELERATOR_UTILIZATION


def activation_bytes(model, tokens: int, rows: int) -> int:
    """An upper bound of the memory one step of `tokens` tokens and `rows` sampled rows
    needs besides its arguments: f32 activations of one layer (residual, q/k/v, attention
    output, the MLP's gate, up and product) times ACTIVATION_FACTOR for XLA's temporaries,
    the rows' logits, and one f32 [V, E] buffer (the temporaries of the steps of 1024 tokens
    and more hold about that much more than their activations on CPU). Checked against
    XLA's `memory_analysis` in the tests."""
    e, f, d, v = model.hidden_size, model.intermediate_size, model.head_dim, model.vocab_size
    per_token = 3 * e + (2 * model.num_heads + 2 * model.num_kv_heads) * d + 3 * f
    return 4 * (ACTIVATION_FACTOR * tokens * per_token + 3 * rows * v + v * e)


def plan(config, devices, weight_bytes: int, reserve_bytes: int, block_bytes: int) -> Budget:
    """The device pool's budget: kv_cache_tokens, then kv_cache_gb, else `utilization` of
    the devices' free memory after the weights and `reserve_bytes`. The host tier's is filled
    in by `with_host_tier` once the pool's real size is known."""
    if config.kv_cache_tokens is not None:
        blocks = -(-config.kv_cache_tokens // 16)
        pool = float(blocks * block_bytes)
        pool_setting = f"kv_cache_tokens={config.kv_cache_tokens}"
    elif config.kv_cache_gb is not None:
        pool, pool_setting = config.kv_cache_gb * 2**30, f"kv_cache_gb={config.kv_cache_gb}"
    else:
        pool, pool_setting = _pool_from_free(config, devices, weight_bytes, reserve_bytes)
    return Budget(pool, pool_setting, 0.0, "")


def with_host_tier(budget: Budget, config, devices, pool_bytes: int,
                   weight_bytes: int) -> Budget:
    """`budget` with the host tier's: host_kv_tokens (the executor converts it), then
    host_kv_gb, else HOST_TIER_FRACTION of the host's available RAM (less the device pool of
    `pool_bytes` and the weights on CPU, where they live in the same RAM). The tier only
    takes memory for the sequences it holds; its budget is a cap."""
    if config.host_kv_tokens is not None:
        host, setting = 0.0, f"host_kv_tokens={config.host_kv_tokens}"
    elif config.host_kv_gb is not None:
        host, setting = config.host_kv_gb * 2**30, f"host_kv_gb={config.host_kv_gb}"
    else:
        ram = host_available_bytes() or ASSUMED_FREE
        if devices[0].platform == "cpu":
            ram = max(0, ram - pool_bytes - weight_bytes)
        host = HOST_TIER_FRACTION * ram
        setting = f"{HOST_TIER_FRACTION} of {ram / 2**30:.1f} GiB of available host RAM"
    return dataclasses.replace(budget, host_bytes=host, host_setting=setting)


def _pool_from_free(config, devices, weight_bytes: int, reserve_bytes: int):
    """`utilization` of what the devices have free once the weights and the activation
    reserve are taken (so a busy machine gets a smaller pool, not a failure, while the
    weights fit)."""
    free = free_bytes(devices)
    where = describe(devices) if free is not None else "not reported; assumed"
    free = ASSUMED_FREE if free is None else free
    share = utilization(config, devices)
    pool = share * (free - weight_bytes - reserve_bytes)
    setting = (f"memory_utilization={share} of the {free / 2**30:.1f} GiB free ({where}) "
               f"less {weight_bytes / 2**30:.2f} GiB of weights and "
               f"{reserve_bytes / 2**30:.2f} GiB of activations")
    return max(0.0, pool), setting
