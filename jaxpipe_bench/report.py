"""Throughput arithmetic, the printed table and the JSON record of a benchmark run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpipe_peers.protocol import best_point, throughput  # noqa: F401 -- the report's too

# Distributions whose versions every result records (a missing one is recorded as None); each
# peer's result records its own environment's (`jaxpipe_peers.protocol.versions`).
_VERSIONED = ("jax", "jaxlib", "flax", "numpy")
# Peers in the order the table and the ratio lines show them: (result key, display name).
PEERS = (("openvino", "OpenVINO"), ("hf", "HF"), ("llamacpp", "llama.cpp"))

_COLUMNS = (
    # (header, width, row key, format)
    ("engine", 8, "engine", "{}"),
    ("dtype", 9, "dtype", "{}"),
    ("config", 22, "config", "{}"),  # `_config_cell`
    ("batch", 6, "batch_size", "{}"),
    ("tok budget", 11, "max_num_batched_tokens", "{}"),
    ("requests", 9, "num_requests", "{}"),
    ("req/s", 8, "requests_per_s", "{:.3f}"),
    ("total tok/s", 12, "total_tok_s", "{:.1f}"),
    ("output tok/s", 13, "output_tok_s", "{:.1f}"),
    ("elapsed s", 10, "elapsed_s", "{:.1f}"),
    ("prefix cache", 13, "prefix_caching", "{}"),  # `_prefix_cell`
)


def _version(dist: str) -> str | None:
    """Installed version of a distribution, without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_info() -> dict:
    """CPU (model, the ISA extensions that matter to its kernels, the bf16 kernel's paths
    built for it) and library versions, plus the load average: other work on a shared
    machine skews every number here, and the JSON should say so when it happened."""
    from jaxpipe.kernels import matmul
    from jaxpipe.runtime import kernel_choice

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "isa": kernel_choice.isa(),
        "kernel_paths": list(matmul.paths()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in _VERSIONED},
        "loadavg_at_start": list(os.getloadavg()),
    }


def format_table(rows: Sequence[dict]) -> str:
    """Fixed-width table of result rows (keys as produced by `throughput` plus engine/dtype/
    batch_size). A truncated (time-capped) row is marked with '*'."""
    header = " ".join(f"{h:>{w}}" for h, w, _, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = []
        for _, width, key, fmt in _COLUMNS:
            value = row.get(key)
            text = "-" if value is None else fmt.format(value)
            if key == "prefix_caching":
                text = _prefix_cell(row)
            if key == "config":
                text = _config_cell(row)
            if key == "num_requests" and row.get("truncated"):
                text += "*"
            cells.append(f"{text:>{width}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _config_cell(row: dict) -> str:
    """What a row ran beyond its engine and dtype: jaxpipe's --engine-field values, OpenVINO's
    IR weights; "-" for none."""
    if row.get("fields"):
        return " ".join(f"{k}={v}" for k, v in row["fields"].items())
    if row.get("weight_format"):
        return f"weights {row['weight_format']}"
    return "-"


def _prefix_cell(row: dict) -> str:
    """The prefix cache of a row: off, its hit rate (jaxpipe's), on (OpenVINO reports no
    hit rate), or "-" (an engine without one)."""
    if row.get("prefix_caching") is None:
        return "-"
    if not row["prefix_caching"]:
        return "off"
    rate = row.get("prefix_cache_hit_rate")
    return "on" if rate is None else f"{rate:.1%} hit"


def _setting(row: dict) -> str:
    """The swept knob of a peer's best row, for the ratio line."""
    if row.get("engine") == "openvino":
        weights = f", weights {row['weight_format']}" if row.get("weight_format") else ""
        return f"batched tokens {row['max_num_batched_tokens']}{weights}"
    if row.get("engine") == "jaxpipe":
        return _config_cell(row) if row.get("fields") else "its defaults"
    if row.get("engine") == "llamacpp":
        threads = row["threads"]
        return f"{threads} thread{'s' * (threads != 1)}, {row['batch_size']} sequences"
    return f"batch {row['batch_size']}"


def ratio_line(jaxpipe: dict, best: dict, name: str = "HF") -> str:
    """The jaxpipe / best-of-peer `name` ratio for each throughput metric (a jaxpipe run with
    --engine-field values is named with them)."""
    parts = [
        f"{label} {jaxpipe[key] / best[key]:.2f}x"
        for label, key in (
            ("requests/s", "requests_per_s"),
            ("total tok/s", "total_tok_s"),
            ("output tok/s", "output_tok_s"),
        )
    ]
    note = ""
    if best["num_requests"] != jaxpipe["num_requests"]:
        done, total = best["num_requests"], jaxpipe["num_requests"]
        note = f"  ({name} measured on {done} of {total} requests)"
    ours = " ".join(["jaxpipe", _config_cell(jaxpipe)]) if jaxpipe.get("fields") else "jaxpipe"
    return f"{ours} / {name} ({_setting(best)}): " + ", ".join(parts) + note


def flops_line(flops: dict) -> str:
    """Achieved model FLOP/s against the measured matmul peak."""
    return (
        f"jaxpipe model FLOP/s: {flops['achieved_gflops']:.1f} GFLOP/s = "
        f"{100 * flops['fraction_of_matmul_peak']:.1f}% of this machine's {flops['dtype']} matmul "
        f"peak ({flops['matmul_peak_gflops']:.1f} GFLOP/s, f32 accumulate, "
        f"{flops.get('matmul_peak_impl', 'xla')})"
    )


def machine_line(machine: dict, kernels: dict | None) -> str:
    """Where the run ran: the CPU, its ISA, the kernel paths it has and the ones jaxpipe's
    step ran (`engine.stats()["kernels"]`)."""
    line = (f"CPU: {machine.get('cpu_model')} x {machine.get('cpu_count')} "
            f"({', '.join(machine.get('isa') or []) or 'no avx2'}); bf16 kernel paths: "
            f"{', '.join(machine.get('kernel_paths') or []) or 'none'}")
    if kernels:
        used = {impl for by_rows in kernels["matmul"].values() for impl in by_rows.values()}
        line += (f"; jaxpipe ran matmuls on {', '.join(sorted(used))}, attention on "
                 f"{kernels['attention']}")
    return line


def render(result: dict) -> str:
    """The human-readable report: where it ran, the table, one ratio line per peer, the
    FLOP/s line."""
    ours = [result["jaxpipe"], *result.get("jaxpipe_variants", [])] if result.get("jaxpipe") \
        else []
    rows = list(ours)
    for key, _ in PEERS:
        rows.extend(result.get(key, {}).get("points", []))
    kernels = (result.get("jaxpipe") or {}).get("engine_stats", {}).get("kernels")
    lines = [machine_line(result.get("machine", {}), kernels)]
    lines += [format_table(rows)] if rows else []
    for run in ours[1:]:  # each variant against the baseline run
        lines.append(ratio_line(run, ours[0], "jaxpipe"))
    for key, name in PEERS:
        for run in ours if result.get(key) else ():
            lines.append(ratio_line(run, result[key]["best"], name))
    if result.get("flops"):
        lines.append(flops_line(result["flops"]))
    elif result.get("matmul"):
        lines.append(f"jax matmul peak: {result['matmul']['peak_gflops']:.1f} GFLOP/s")
    ref = result.get("matmul", {}).get("torch_reference")
    if ref:
        lines.append(f"(torch reaches {ref['peak_gflops']:.1f} GFLOP/s on the same matmul shapes)")
    if any(r.get("truncated") for r in rows):
        lines.append("* stopped early by --hf-max-seconds: throughput over the requests done")
    busy = _busy_warning(result.get("machine", {}))
    if busy:
        lines.append(busy)
    return "\n".join(lines)


def _busy_warning(machine: dict) -> str | None:
    """A warning when other processes were loading the CPUs as the run started.

    Both engines run multi-threaded; on an oversubscribed machine a descheduled thread stalls
    every parallel region, which slows them by far more than the load ratio (and unevenly).
    """
    load = machine.get("loadavg_at_start")
    cpus = machine.get("cpu_count") or 1
    if not load or load[0] <= 0.5 * cpus:
        return None
    return (
        f"WARNING: load average {load[0]:.1f} on {cpus} CPUs when the run started; other "
        f"processes were competing for the cores, so these numbers are not reliable"
    )


def write_json(result: Any, path: str | Path) -> Path:
    """Write `result` as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def write_points(path: str | None, points: list[dict]) -> None:
    """A kernel benchmark's points with the machine they ran on (`runtime.kernel_choice.machine`),
    as JSON at `path` (nothing when None); the directory is made if missing."""
    if path is None:
        return
    from jaxpipe.runtime.kernel_choice import machine

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), "points": points}, indent=2))
