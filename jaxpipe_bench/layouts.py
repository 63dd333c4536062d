"""Layout benchmarks on a multi-device mesh: re-shard cost and the pipeline bubble.

- Re-shard: for each (prefill, decode) layout pair, the seconds to move the padded weights
  prefill -> decode and back (and the KV store), next to one decode step on the decode layout.
- Bubble: a fixed prefill step on pp in {1, 2, 4, 8} stages (pp devices, tp = 1) with M
  micro-batches of its tokens. Every stage computes in every tick (SPMD: bubble ticks run on
  garbage), and the virtual devices share the machine's cores, so the time relative to
  pp = 1 measures the pipeline's total work, whose ideal is (M + pp - 1) / M; the bubble
  fraction is
  (pp - 1) / (M + pp - 1).

Call `run()` in a process whose JAX backend has the devices (scripts/bench_reshard.py).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.config.model import Dtype, ModelConfig
from jaxpipe.kv.device_cache import blocks_for
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.runner import Runner
from jaxpipe.runtime.sharding import timed_reshard
from jaxpipe.runtime.synthetic_step import median_seconds, step_call
from jaxpipe_bench.cli import check_sizes

PAIRS = (("pp=8", "tp=8"), ("pp=4,tp=2", "tp=4,pp=2"), ("pp=2,tp=4", "tp=8"),
         ("pp=8", "pp=2,tp=4"))


@dataclass(frozen=True)
class LayoutBenchConfig:
    """What to measure (sizes kept small: 8 virtual devices share two cores here); each entry
    is also its flag's help (scripts/bench_reshard.py's flags, jaxpipe.config.flags).

    model: the model, a preset name or a path (EngineConfig.model).
    out_path: where the record's JSON is written.
    dtype: the weights' and activations' dtype.
    decode_batch: rows of the timed decode step.
    context: KV positions each decode row attends over.
    prefill_batch: rows of the bubble's prefill step.
    prompt_len: tokens of each prefill row.
    repeats: timings of each measurement (the median is kept).
    pairs: the (prefill, decode) layout pairs whose re-shard is timed.
    stages: the pipeline depths (pp) of the bubble measurement.
    """

    model: str = EngineConfig.model
    out_path: str = field(default="out/bench_reshard.json", metadata={"flags": ("--out",)})
    dtype: Dtype = EngineConfig.dtype
    decode_batch: int = 16
    context: int = 128
    prefill_batch: int = 16
    prompt_len: int = 64
    repeats: int = 3
    pairs: tuple[tuple[str, str], ...] = PAIRS
    stages: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "decode_batch", "context", "prefill_batch", "prompt_len", "repeats")
        check_sizes(self, "stages")


def _runner(cfg: ModelConfig, values: dict, prefill: str, decode: str, bench: LayoutBenchConfig,
            devices) -> Runner:
    slots = max(bench.decode_batch, bench.prefill_batch)
    max_len = max(bench.context, bench.prompt_len)
    buckets = Buckets.for_engine(slots, max_len, slots * max_len)
    layouts = {"prefill": Layout.parse(prefill), "decode": Layout.parse(decode)}
    return Runner(cfg, values, buckets, slots, max_len, jnp.dtype(bench.dtype), layouts,
                  devices, num_blocks=slots * blocks_for(max_len))


def reshard_row(cfg: ModelConfig, values: dict, prefill: str, decode: str,
                bench: LayoutBenchConfig) -> dict:
    """Weight and KV re-shard seconds both ways for one pair, and a decode step's seconds."""
    r = _runner(cfg, values, prefill, decode, bench, jax.devices()[:8])
    to_decode, to_prefill, kv = [], [], []
    params, cache = r.params, r.cache  # copies move; the runner's own stay put until the end
    for _ in range(bench.repeats):
        for phase, times in (("decode", to_decode), ("prefill", to_prefill)):
            place = r.placements[phase]
            params, seconds = timed_reshard(params, place.params)
            times.append(seconds)
            cache, seconds = timed_reshard(cache, place.cache)
            kv.append(seconds)
    del params, cache
    r.set_phase("decode")
    step = step_call(r, bench.decode_batch, 1, bench.context - 1)
    param_bytes = sum(a.nbytes for a in r.params.values())
    return {"prefill": prefill, "decode": decode,
            "weights_mb": param_bytes / 2**20,
            "to_decode_s": statistics.median(to_decode),
            "to_prefill_s": statistics.median(to_prefill),
            "kv_move_s": statistics.median(kv),
            "decode_step_s": median_seconds(step, bench.repeats)}


def bubble_rows(cfg: ModelConfig, values: dict, bench: LayoutBenchConfig) -> list[dict]:
    """Prefill seconds on pp stages with M micro-batches, against the ideal (M+pp-1)/M."""
    b, t = bench.prefill_batch, bench.prompt_len
    rows, base = [], None
    for pp in bench.stages:
        layout = f"pp={pp}" if pp > 1 else "pp=1,tp=1"
        r = _runner(cfg, values, layout, layout, bench, jax.devices()[:pp])
        for m in sorted({pp, 2 * pp}):
            seconds = median_seconds(step_call(r, b, t, microbatches=m), bench.repeats)
            base = seconds if pp == 1 else base
            rows.append({"pp": pp, "microbatches": m, "prefill_s": seconds,
                         "ratio": seconds / base, "ideal_ratio": (m + pp - 1) / m,
                         "bubble_fraction": (pp - 1) / (m + pp - 1),
                         "tokens_per_s": b * t / seconds})
    return rows


def run(cfg: ModelConfig, values: dict, bench: LayoutBenchConfig) -> dict:
    """Every measurement, as one JSON-serialisable record."""
    return {"config": asdict(bench), "model": cfg.to_dict(),
            "devices": [str(d) for d in jax.devices()],
            "reshard": [reshard_row(cfg, values, p, d, bench) for p, d in bench.pairs],
            "bubble": bubble_rows(cfg, values, bench)}


def format_tables(record: dict) -> str:
    """The two tables, as printed by scripts/bench_reshard.py."""
    lines = ["re-shard (weights both ways, KV store) vs one decode step "
             f"(batch {record['config']['decode_batch']}, context {record['config']['context']})",
             f"{'prefill':>10} {'decode':>10} {'MiB':>6} {'->decode s':>11} {'->prefill s':>12} "
             f"{'KV s':>7} {'decode step s':>14}"]
    for r in record["reshard"]:
        lines.append(f"{r['prefill']:>10} {r['decode']:>10} {r['weights_mb']:>6.0f} "
                     f"{r['to_decode_s']:>11.3f} {r['to_prefill_s']:>12.3f} "
                     f"{r['kv_move_s']:>7.3f} {r['decode_step_s']:>14.3f}")
    c = record["config"]
    lines += ["", f"pipelined prefill ({c['prefill_batch']} x {c['prompt_len']} tokens), "
              "pp stages on pp devices",
              f"{'pp':>3} {'M':>3} {'seconds':>8} {'ratio':>6} {'ideal':>6} {'bubble':>7} "
              f"{'tok/s':>8}"]
    for r in record["bubble"]:
        lines.append(f"{r['pp']:>3} {r['microbatches']:>3} {r['prefill_s']:>8.3f} "
                     f"{r['ratio']:>6.2f} {r['ideal_ratio']:>6.2f} "
                     f"{r['bubble_fraction']:>7.2f} {r['tokens_per_s']:>8.0f}")
    return "\n".join(lines)
