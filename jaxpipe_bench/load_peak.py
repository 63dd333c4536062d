"""The memory a model's load takes (scripts/bench_load.py): `builder.prepare` (header, weights
in the engine's dtype, tokenizer) in a fresh Python process per case, and that process's
resident memory before it (after the imports) and at its peak: all of it (`VmHWM`, the
mapped file's pages the load touched included; not `ru_maxrss`, which keeps the parent's
across the exec) and its private memory alone (`RssAnon`, sampled every 2 ms: what the load
allocates, without the file's page cache).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from jaxpipe.config.engine import EngineConfig
from jaxpipe_bench.cli import check_names
from jaxpipe_bench.proc_memory import status_bytes

QUANTIZATIONS = ("none", "int8", "gguf")


@dataclass(frozen=True)
class LoadPeakConfig:
    """What `scripts/bench_load.py` measures (its flags, jaxpipe.config.flags).

    model: a preset, a .gguf file or an HF / Orbax checkpoint directory
    quantization: the EngineConfig.quantization values to load it with, one process each
    dtype: the engine's dtype (EngineConfig.dtype)
    json_path: write the points here (none: only the table)
    """

    model: str = EngineConfig.model
    quantization: tuple[str, ...] = ("none",)
    dtype: str = EngineConfig.dtype
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_names(self, "quantization", QUANTIZATIONS)


def measure(config: LoadPeakConfig) -> list[dict]:
    """One point per quantization: {quantization, before_gb, peak_gb, peak_private_gb}."""
    points = []
    for quantization in config.quantization:
        done = subprocess.run([sys.executable, "-m", "jaxpipe_bench.load_peak", config.model,
                               quantization, config.dtype], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"loading {config.model} with quantization={quantization!r} "
                               f"failed:\n{done.stderr[-4000:]}")
        sizes = json.loads(done.stdout.strip().splitlines()[-1])
        points.append({"quantization": quantization, **{k: v / 1e9 for k, v in sizes.items()}})
    return points


def render(points: list[dict], config: LoadPeakConfig) -> str:
    lines = [f"{config.model}, dtype {config.dtype}: resident memory of the loading process",
             "| quantization | before the load, GB | peak, GB | peak private (RssAnon), GB |",
             "|---|---|---|---|"]
    lines += [f"| {p['quantization']} | {p['before_gb']:.2f} | {p['peak_gb']:.2f} | "
              f"{p['peak_private_gb']:.2f} |" for p in points]
    return "\n".join(lines)


def _main_child(model: str, quantization: str, dtype: str) -> None:
    """One case, in this fresh process: prints {before_gb, peak_gb, peak_private_gb} in bytes."""
    from jaxpipe.engine import builder

    before, private, done = status_bytes("VmRSS"), [0], threading.Event()

    def sample():
        while not done.is_set():
            private[0] = max(private[0], status_bytes("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    builder.prepare(EngineConfig(model=model, quantization=quantization, dtype=dtype), 1)
    done.set()
    sampler.join()
    print(json.dumps({"before_gb": before, "peak_gb": status_bytes("VmHWM"),
                      "peak_private_gb": private[0]}))


if __name__ == "__main__":
    _main_child(*sys.argv[1:4])
