"""What an accelerator machine is, before anything of jaxpipe's runs on it
(`python -m jaxpipe_bench.device_report --json FILE`, the first part of
`scripts/gpu_first_run.sh`): the devices JAX sees with their kind and `memory_stats`, their
memory kinds, the versions of what jaxpipe runs with, and three checks of what the engine
relies on: a donated buffer is given up (the KV pool is donated to every step), a copy to and
from `pinned_host` memory (the host KV tier's path) with its GB/s each way, and the
device-to-device bandwidth a decode step is judged against.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import time
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "gguf", "tokenizers",
            "triton", "jax-cuda13-plugin", "jax-cuda12-plugin")


def versions() -> dict:
    """Installed version of each package that matters here (None: not installed)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def nvidia_smi() -> str | None:
    """nvidia-smi's summary, if the machine has one."""
    if not shutil.which("nvidia-smi"):
        return None
    run = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    return run.stdout or run.stderr


def devices() -> list[dict]:
    import jax

    out = []
    for d in jax.devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        out.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                    "memory_stats": stats or None,
                    "memories": sorted(m.kind for m in d.addressable_memories())})
    return out


def donation_check(nbytes: int = 1 << 28) -> dict:
    """A jitted update that donates its input: whether the input was given up (its buffer
    reused), as every engine step does with the KV pool."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros(nbytes // 4, jnp.float32)
    step = jax.jit(lambda a: a.at[0].add(1.0), donate_argnums=0)
    y = step(x)
    jax.block_until_ready(y)
    return {"donated": x.is_deleted(), "bytes": nbytes}


def pinned_host_check(nbytes: int = 1 << 28) -> dict:
    """A copy device -> pinned_host -> device: whether the memory kind exists, the data comes
    back unchanged, and the GB/s each way (the host KV tier's swaps)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        return {"available": False, "memories": sorted(kinds)}
    x = jax.block_until_ready(jnp.arange(nbytes // 4, dtype=jnp.float32))
    host, device = (SingleDeviceSharding(dev, memory_kind=k) for k in ("pinned_host", "device"))
    to_host, on_host = _timed_put(x, host)
    to_device, back = _timed_put(on_host, device)
    return {"available": True, "bytes": nbytes, "to_host_gbs": nbytes / to_host / 1e9,
            "to_device_gbs": nbytes / to_device / 1e9,
            "round_trip_equal": bool(jnp.array_equal(back, x))}


def _timed_put(x, sharding) -> tuple[float, object]:
    """Seconds of the second of two `device_put`s of x to `sharding` (the first allocates),
    and the copy."""
    import jax

    jax.block_until_ready(jax.device_put(x, sharding))
    start = time.perf_counter()
    moved = jax.block_until_ready(jax.device_put(x, sharding))
    return time.perf_counter() - start, moved


def report() -> dict:
    """Every section; a check that raises is recorded as its error, not raised."""
    from jaxpipe_bench.gpu_check import measured_bandwidth

    record = {"versions": versions(), "nvidia_smi": nvidia_smi()}
    for name, fn in (("devices", devices), ("donation", donation_check),
                     ("pinned_host", pinned_host_check),
                     ("bandwidth_gbs", lambda: measured_bandwidth() / 1e9)):
        try:
            record[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failed check is what this reports
            record[name] = {"error": f"{type(e).__name__}: {e}"}
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    record = report()
    text = json.dumps(record, indent=1)
    print(record["nvidia_smi"] or "no nvidia-smi")
    print(json.dumps({k: v for k, v in record.items() if k != "nvidia_smi"}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
