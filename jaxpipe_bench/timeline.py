"""Where the engine's decode time goes: the step timeline with each host-side technique off
and on (scripts/bench_timeline.py).

One engine per run; the variants take turns on the same requests (greedy, ignore_eos, the
seeded ShareGPT-like workload), `repeats` times each, interleaved so that drift in this
machine's speed hits every variant alike; each figure is the median over the repeats. Every
variant must produce the same tokens as the first (the techniques may not change outputs).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype
from jaxpipe_bench.workload import SEED, Request

# name -> the techniques it switches on (each adds one to the one before; Engine.set_overlap etc.)
# ("host-sampler" replaces the device sampler: overlap is then off, see EngineConfig.sampler)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {"overlap": False, "detok_worker": False, "sampler": "device"},
    "+overlap": {"overlap": True, "detok_worker": False, "sampler": "device"},
    "+detok": {"overlap": True, "detok_worker": True, "sampler": "device"},
    "host-sampler": {"overlap": True, "detok_worker": True, "sampler": "host"},
}
DEFAULT_VARIANTS = ("baseline", "+overlap", "+detok")


@dataclass(frozen=True)
class TimelineConfig:
    """The engine, workload and variants of `scripts/bench_timeline.py` (its flags).

    model: model preset or path
    dtype: EngineConfig.dtype
    mesh: EngineConfig.mesh
    layout: one layout for prefill and decode, e.g. pp=2,tp=4 (none: the mesh's default)
    num_prompts: requests in the ShareGPT-like workload
    seed: seeds the workload
    repeats: runs of each variant (each figure is their median)
    variants: which variants run, from baseline, +overlap, +detok and host-sampler
    stop: a stop string for every request (one that never matches, e.g. '<<never>>', makes
        every request detokenize as it runs)
    trace: write a Chrome/Perfetto trace JSON per run into this folder
    json_path: where the JSON goes
    """

    model: str = EngineConfig.model
    dtype: Dtype = EngineConfig.dtype
    mesh: str = EngineConfig.mesh
    layout: str | None = None
    num_prompts: int = 64
    seed: int = SEED
    repeats: int = 2
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    stop: str | None = None
    trace: str | None = None
    json_path: str = field(default="out/bench_timeline.json", metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "num_prompts", "repeats")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"TimelineConfig.variants must be one or more of {list(VARIANTS)}, "
                             f"got {list(self.variants)!r}")


def run(config: TimelineConfig, log: Callable[[str], None] = print) -> dict:
    """`config`'s variants on one engine over the seeded workload (the default model's
    vocabulary): the table logged, the results written as JSON to `config.json_path`."""
    from jaxpipe import Engine
    from jaxpipe_bench import default_max_model_len, describe_workload
    from jaxpipe_bench.workload import default_gguf_path, gguf_vocab, make_workload

    vocab, special = gguf_vocab(default_gguf_path())
    workload = make_workload(config.num_prompts, config.seed, vocab, special_ids=special)
    layouts = {"prefill": config.layout, "decode": config.layout} if config.layout else {}
    engine = Engine(EngineConfig(model=config.model, dtype=config.dtype, mesh=config.mesh,
                                 max_model_len=default_max_model_len(workload),
                                 kv_cache_gb=8.0, show_progress=False, **layouts))
    title = (f"{config.model} {config.dtype} on {config.mesh} "
             f"({engine.runner.layouts['decode']}), {config.num_prompts} requests, median of "
             f"{config.repeats}" + (f", stop={config.stop!r}" if config.stop else ""))
    results = run_variants(engine, workload, config.variants, config.repeats, config.trace,
                           config.stop, log)
    log(render(title, results))
    record = {"title": title, "workload": describe_workload(workload), "results": results}
    out = Path(config.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    log(f"wrote {out}")
    return record


def run_variants(engine, workload: Sequence[Request], variants: Sequence[str], repeats: int,
                 trace_dir: str | None = None, stop: str | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Run `workload` under each variant `repeats` times; per variant the median output
    tok/s, device idle fraction during decode and host ms per step by part. `stop`: a stop
    string every request carries (one that never matches makes every request detokenize
    as it runs, the work the detokenizer worker takes off the loop)."""
    from jaxpipe_bench import _generate, check_outputs

    rows: dict[str, list[dict]] = {v: [] for v in variants}
    reference = None
    for rep in range(repeats):
        for name in variants:
            _switch(engine, **VARIANTS[name])
            engine.reset_stats()
            start = time.perf_counter()
            outs = _generate(engine, workload, stop=stop)
            elapsed = time.perf_counter() - start
            check_outputs(outs, workload)
            tokens = [o.outputs[0].token_ids for o in outs]
            reference = reference or tokens
            stats = engine.stats()
            row = _row(stats, workload, elapsed, tokens == reference)
            rows[name].append(row)
            log(f"[{name} #{rep + 1}] {row['output_tok_s']:.1f} tok/s, device idle "
                f"{row['device_idle_fraction']:.3f}, same tokens: {row['same_tokens']}")
            if trace_dir:
                path = Path(trace_dir) / f"timeline_{name.strip('+')}_{rep + 1}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(engine.executor.chrome_trace()))
    return {name: _median(runs) for name, runs in rows.items()}


def _switch(engine, overlap: bool, detok_worker: bool, sampler: str) -> None:
    """Set a variant's techniques on the idle engine (between runs: no slot in use)."""
    engine.set_overlap(overlap)
    engine.set_detok_worker(detok_worker)
    engine.runner.set_sampler(sampler)


def _row(stats: dict, workload: Sequence[Request], elapsed: float, same: bool) -> dict:
    return {"output_tok_s": sum(r.output_len for r in workload) / elapsed,
            "elapsed_s": elapsed,
            "device_idle_fraction": stats["device_idle_fraction"],
            "decode_wall_s": stats["decode_wall_seconds"],
            "host_ms_per_step": stats["host_ms_per_step"],
            "steps": stats["steps"],
            "same_tokens": same}


def _median(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs)
           for k in ("output_tok_s", "elapsed_s", "device_idle_fraction", "decode_wall_s")}
    parts = runs[0]["host_ms_per_step"]
    out["host_ms_per_step"] = {p: statistics.median(r["host_ms_per_step"][p] for r in runs)
                               for p in parts}
    out["steps"] = runs[0]["steps"]
    out["same_tokens"] = all(r["same_tokens"] for r in runs)
    out["runs"] = runs
    return out


def render(title: str, results: dict) -> str:
    """One table: a row per variant."""
    parts = list(next(iter(results.values()))["host_ms_per_step"])
    head = (f"{'variant':<12} {'out tok/s':>9} {'idle':>6} "
            + " ".join(f"{p[:9]:>9}" for p in parts) + "  same tokens")
    lines = [title, head, "-" * len(head)]
    for name, r in results.items():
        host = " ".join(f"{r['host_ms_per_step'][p]:>9.2f}" for p in parts)
        lines.append(f"{name:<12} {r['output_tok_s']:>9.1f} {r['device_idle_fraction']:>6.3f} "
                     f"{host}  {r['same_tokens']}")
    lines.append("idle: device idle fraction during decode; host columns: ms per step")
    return "\n".join(lines)
