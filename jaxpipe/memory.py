"""Free memory of the engine's devices, for budget checks at construction.

CPU devices (virtual ones included) share the host's RAM: `MemAvailable` of /proc/meminfo.
An accelerator reports its own: `bytes_limit - bytes_in_use` of `Device.memory_stats()`,
summed over the devices. None where neither is known (the check is then skipped).
"""

from __future__ import annotations

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
