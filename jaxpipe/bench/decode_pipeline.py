"""Pipelined decode benchmark: one GPipe pass per step (today) against K steps per call with
the micro-batches kept in flight (`pipeline.multistep_decode_program`).

For each decode layout (prefill on the same layout, so nothing moves), B rows at the same
position decode greedily:
  - "1 (gpipe)": today's step, the one-step program then the separate sampler, once per token;
  - "K": one call of `LayoutRunner.decode(steps=K)` (K = 1 too: the new program, one pass).
Seconds per step (one token for every row) are the call's median seconds / K; the first
call's seconds include compiling (steps 1, 4, 8 share one program: the first K only). CPU
seconds (this process, all threads) are the work done, less sensitive than wall time to
other processes on a shared machine.

The ideal tick ratio is today's ticks per step over the interleaved program's:
(M + pp - 1) / ((K*M + pp - 1) / K). On virtual devices that share the machine's cores
every stage computes in every tick (bubble ticks on garbage), so total work, and hence time,
scales with ticks at best; the LM head, sampling and the collectives come on top.

Call `run()` in a process whose JAX backend has the devices (scripts/bench_decode_pipeline.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe import pipeline, sampling
from jaxpipe.buckets import Buckets
from jaxpipe.config import ModelConfig
from jaxpipe.layout import Layout
from jaxpipe.layout_runner import LayoutRunner
from jaxpipe.runner import SamplingPlan


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What to measure (small: 8 virtual devices share two cores here)."""

    dtype: str = "bfloat16"
    batch: int = 16
    position: int = 120  # every row's first position; + max(steps) stays in one KV bucket
    max_len: int = 256
    steps: tuple[int, ...] = (1, 4, 8)
    layouts: tuple[str, ...] = ("pp=2,tp=4", "pp=4,tp=2", "pp=8")
    repeats: int = 3


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _measure(calls: dict, repeats: int) -> dict[str, tuple[float, float, float]]:
    """name -> (wall seconds of the first call, compile included; median wall seconds and
    median CPU seconds of `repeats` more). The repeats go round-robin over the calls, so
    that load from other processes on the machine falls on every variant alike."""
    first = {name: _timed(fn)[0] for name, fn in calls.items()}
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_timed(fn))
    return {name: (first[name], statistics.median(w for w, _ in t),
                   statistics.median(c for _, c in t)) for name, t in times.items()}


def _greedy_plan(rows: int) -> SamplingPlan:
    params = [sampling.SamplingParams(temperature=0.0)] * rows
    t = sampling.build_sampling_tensors(params, [0] * rows, [0] * rows, [[]] * rows, rows)
    return SamplingPlan(t, "greedy", False, None)


def ideal_ratio(steps: int, m: int, pp: int) -> float:
    """Today's ticks per step over the interleaved program's (K steps per call)."""
    return (m + pp - 1) * steps / pipeline.interleaved_ticks(steps, m, pp)


def layout_rows(cfg: ModelConfig, values: dict, layout: str, bench: DecodeBenchConfig) -> list:
    """One row per variant (today's one-step path, then each K) on one decode layout."""
    lo = Layout.parse(layout)
    b = bench.batch
    r = LayoutRunner(cfg, values, Buckets.for_engine(b, bench.max_len, b * bench.max_len), b,
                     bench.max_len, jnp.dtype(bench.dtype), {"prefill": lo, "decode": lo},
                     jax.devices()[:lo.num_devices], decode_steps_per_call=max(bench.steps))
    r.set_phase("decode")
    tokens = np.zeros(b, np.int32)
    positions = np.full(b, bench.position, np.int32)
    active = np.ones(b, bool)
    plan = _greedy_plan(b)
    m = pipeline.microbatches(b, lo.pp)
    kv_len = r.buckets.kv_len[0]

    def today():
        logits = r.decode_logits(tokens, positions, positions + 1, kv_len,
                                 r.table_rows(np.arange(len(tokens))))
        return r._sample_host(logits, np.arange(b, dtype=np.int32), plan, b)

    def steps(k: int):
        def call():
            r.decode(tokens, positions, active, plan, k)
            busy[k] = (np.asarray(r.decode_busy).tolist(), r.decode_ticks)

        return call

    busy = {}
    calls = {"1 (gpipe)": today, **{str(k): steps(k) for k in bench.steps}}
    times = _measure(calls, bench.repeats)
    rows = [_row(layout, lo, m, "1 (gpipe)", 1, times["1 (gpipe)"], b)]
    for k in bench.steps:
        rows.append(_row(layout, lo, m, str(k), k, times[str(k)], b))
        rows[-1]["busy"], rows[-1]["ticks"] = busy[k]
    for row in rows:
        row["speedup"] = rows[0]["step_s"] / row["step_s"]
        row["cpu_speedup"] = rows[0]["step_cpu_s"] / row["step_cpu_s"]
    return rows


def _row(layout: str, lo: Layout, m: int, variant: str, steps: int,
         times: tuple[float, float, float], batch: int) -> dict:
    first, seconds, cpu = times
    ideal = 1.0 if variant.endswith("(gpipe)") else ideal_ratio(steps, m, lo.pp)
    return {"layout": layout, "pp": lo.pp, "tp": lo.tp, "microbatches": m,
            "variant": variant, "steps": steps, "first_call_s": first, "call_s": seconds,
            "step_s": seconds / steps, "step_cpu_s": cpu / steps,
            "tokens_per_s": batch * steps / seconds, "ideal_ratio": ideal}


def run(cfg: ModelConfig, values: dict, bench: DecodeBenchConfig) -> dict:
    """Every measurement, as one JSON-serialisable record."""
    load = os.getloadavg()[0]
    rows = [row for lo in bench.layouts for row in layout_rows(cfg, values, lo, bench)]
    return {"config": asdict(bench), "model": cfg.to_dict(),
            "devices": [str(d) for d in jax.devices()], "cpus": os.cpu_count(),
            "load_1min": [load, os.getloadavg()[0]],  # before, after: others' work counts
            "rows": rows}


def format_table(record: dict) -> str:
    """The table printed by scripts/bench_decode_pipeline.py."""
    c = record["config"]
    load = ", ".join(f"{x:.1f}" for x in record["load_1min"])
    lines = [f"pipelined decode, {c['batch']} rows at position {c['position']}, {c['dtype']}, "
             f"median of {c['repeats']}; steps = tokens per row per call; {record['cpus']} "
             f"cores, load average {load} (before, after)",
             f"{'layout':>10} {'M':>2} {'steps':>9} {'s/call':>7} {'s/step':>7} {'tok/s':>6} "
             f"{'speedup':>7} {'ideal':>5} {'cpu-s/step':>10} {'cpu speedup':>11} "
             f"{'1st call s':>10}"]
    for r in record["rows"]:
        lines.append(f"{r['layout']:>10} {r['microbatches']:>2} {r['variant']:>9} "
                     f"{r['call_s']:>7.3f} {r['step_s']:>7.3f} {r['tokens_per_s']:>6.1f} "
                     f"{r['speedup']:>7.2f} {r['ideal_ratio']:>5.2f} "
                     f"{r['step_cpu_s']:>10.3f} {r['cpu_speedup']:>11.2f} "
                     f"{r['first_call_s']:>10.1f}")
    return "\n".join(lines)
