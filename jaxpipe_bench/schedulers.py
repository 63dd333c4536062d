"""Scheduling policies end to end on one mesh: the same seeded workload through `Engine` once
per (policy, prefill layout, decode layout), with the engine's stats for each run.

Entry point: `scripts/bench_schedulers.py`. Each run builds its own engine (weights, warm-up
compile), runs a few warm-up requests, resets the stats and times one `generate` over the
workload; outputs are checked (every request, exactly its output_len tokens).
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype
from jaxpipe_bench import _generate, check_outputs, default_max_model_len, warmup_requests
from jaxpipe_bench.report import machine_info, throughput
from jaxpipe_bench.workload import (
    NUM_PROMPTS,
    SEED,
    Request,
    default_gguf_path,
    describe_workload,
    gguf_vocab,
    make_workload,
)

STAT_KEYS = ("transitions", "reshards", "reshard_seconds", "reshard_weights_seconds",
             "reshard_kv_seconds", "reshard_kv_blocks", "prefill_seconds", "decode_seconds",
             "swap_out_bytes", "swap_in_bytes", "swap_seconds", "prefetch_seconds",
             "mean_decode_batch", "preemptions", "padding_waste", "host_kv_peak", "device_kv_peak",
             "compile_seconds")
COLUMNS = (("policy", "{}"), ("prefill", "{}"), ("decode", "{}"), ("output_tok_s", "{:.1f}"),
           ("elapsed_s", "{:.1f}"), ("transitions", "{}"), ("reshard_seconds", "{:.1f}"),
           ("reshard_weights_seconds", "{:.1f}"), ("reshard_kv_seconds", "{:.1f}"),
           ("move_share", "{:.1%}"),
           ("prefill_seconds", "{:.1f}"), ("decode_seconds", "{:.1f}"),
           ("swap_out_mib", "{:.0f}"), ("swap_seconds", "{:.1f}"),
           ("mean_decode_batch", "{:.1f}"), ("preemptions", "{}"), ("padding_waste", "{:.2f}"))


@dataclass(frozen=True)
class RunSpec:
    policy: str
    prefill: str
    decode: str


DEFAULT_RUNS = "seesaw:pp=8:tp=8,prefill_first:tp=8:tp=8,prefill_first:pp=2,tp=4:pp=2,tp=4"


@dataclass(frozen=True)
class SchedulersConfig:
    """The runs and the workload of `scripts/bench_schedulers.py` (its flags), on mesh cpu-8.

    runs: the runs, each policy:prefill-layout:decode-layout, comma-separated (layouts
        contain commas; a policy starts a run)
    num_prompts: requests in the ShareGPT-like workload
    seed: seeds the workload
    output_len: fixed output length (none: lognormal)
    model: model preset or path
    dtype: EngineConfig.dtype
    max_num_seqs: EngineConfig.max_num_seqs
    host_kv_tokens: host tier size (none: the engine's)
    out_path: where the JSON goes (rewritten after every run)
    """

    runs: str = DEFAULT_RUNS
    num_prompts: int = NUM_PROMPTS
    seed: int = SEED
    output_len: int | None = None
    model: str = EngineConfig.model
    dtype: Dtype = EngineConfig.dtype
    max_num_seqs: int = 64
    host_kv_tokens: int | None = None
    out_path: str = field(default="out/bench_schedulers.json", metadata={"flags": ("--out",)})

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "num_prompts")
        self.run_specs()  # refuses a malformed --runs

    def run_specs(self) -> list[RunSpec]:
        """`runs` parsed: 'a:pp=8:tp=8,b:pp=2,tp=4:tp=8' -> two RunSpecs."""
        runs: list[str] = []
        for part in self.runs.split(","):
            if ":" in part.split("=")[0]:  # "policy:..." starts a new run
                runs.append(part)
            elif runs:
                runs[-1] += "," + part
            else:
                runs.append(part)
        specs = []
        for item in runs:
            fields = item.split(":")
            if len(fields) != 3 or not all(fields):
                raise ValueError(f"SchedulersConfig.runs: {item!r} is not "
                                 f"policy:prefill-layout:decode-layout (in {self.runs!r})")
            specs.append(RunSpec(*fields))
        return specs

    def engine_kwargs(self) -> dict:
        """The EngineConfig fields every run shares (the run adds its policy and layouts)."""
        kwargs = dict(model=self.model, dtype=self.dtype, mesh="cpu-8",
                      max_num_seqs=self.max_num_seqs, show_progress=True)
        if self.host_kv_tokens is not None:
            kwargs["host_kv_tokens"] = self.host_kv_tokens
        return kwargs


def run_all(config: SchedulersConfig, log=print) -> list[dict]:
    """Every run of `config` on 8 virtual CPU devices over one seeded workload (the default
    model's vocabulary), a table logged and the JSON at `config.out_path` rewritten after each
    run (a run that is stopped keeps the ones before it)."""
    from jaxpipe.runtime import sharding

    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend
    vocab, special = gguf_vocab(default_gguf_path())
    workload = make_workload(config.num_prompts, config.seed, vocab, None, config.output_len,
                             special)
    log(f"[workload] {describe_workload(workload)}")
    out = Path(config.out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in config.run_specs():
        rows.append(run_one(spec, workload, config.engine_kwargs(), log=log))
        out.write_text(json.dumps({"args": asdict(config), "machine": machine_info(),
                                   "workload": describe_workload(workload), "runs": rows},
                                  indent=1))
        log(format_table(rows))
    log(f"wrote {out}")
    return rows


def run_one(spec: RunSpec, workload: Sequence[Request], engine_kwargs: dict,
            warmup_prompts: int = 4, log=print) -> dict:
    """Throughput and stats of one (policy, layouts) run over `workload`."""
    from jaxpipe import Engine, EngineConfig

    kwargs = dict(engine_kwargs, scheduler=spec.policy, prefill=spec.prefill,
                  decode=spec.decode)
    kwargs.setdefault("max_model_len", default_max_model_len(workload))
    start = time.perf_counter()
    engine = Engine(EngineConfig(**kwargs))
    startup = time.perf_counter() - start
    warm = warmup_requests(workload, warmup_prompts)
    if warm:
        check_outputs(_generate(engine, warm), warm)
    engine.reset_stats()
    compiled = engine.stats()["compile_seconds"]
    start = time.perf_counter()
    outs = _generate(engine, workload, progress=True)  # an hour per run on cpu-8 here
    elapsed = time.perf_counter() - start
    check_outputs(outs, workload)
    stats = engine.stats()
    engine.close()
    row = dict(policy=spec.policy, prefill=spec.prefill, decode=spec.decode,
               startup_s=startup, **throughput(workload, elapsed))
    row.update({k: stats[k] for k in STAT_KEYS})
    row["compile_seconds"] -= compiled  # compilation inside the timed run (0: warm-up did all)
    row["swap_out_mib"] = stats["swap_out_bytes"] / 2**20
    # the share of the wall time spent moving KV and weights (re-shards and swaps)
    row["move_share"] = (stats["reshard_seconds"] + stats["swap_seconds"]) / elapsed
    row["host_timeline"] = stats["host_timeline"]
    log(f"[{spec.policy} {spec.prefill} -> {spec.decode}] {row['output_tok_s']:.1f} output "
        f"tok/s in {elapsed:.1f} s, {stats['transitions']} transitions")
    del engine
    gc.collect()
    return row


def format_table(rows: Sequence[dict]) -> str:
    names = [name for name, _ in COLUMNS]
    cells = [[fmt.format(row[name]) for name, fmt in COLUMNS] for row in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    lines = ["  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)
