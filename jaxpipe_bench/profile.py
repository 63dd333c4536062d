"""Where a benchmark workload's time goes, per op family (`scripts/profile_step.py`).

jaxpipe serves the workload of `scripts/bench_throughput.py` (same requests, same engine
settings) under `jax.profiler`, while XLA dumps the text of every module it compiles (the
persistent compilation cache is off, so every program is compiled and dumped). Each op the
trace saw is put in a family by the instruction it ran in its module:

  matmuls    the step's projections: the C++ bf16 matmul kernel's calls and XLA's dot fusions
  attention  the step's ragged attention kernel calls
  collectives  the step's cross-device ops: the stage hand-over (`collective-permute`), tp's
             psums (`all-reduce`), gathers and all-to-alls; on CPU an op's time includes
             its wait for the other devices to reach it
  other      every other op of the step: norms, RoPE, residual adds, KV writes, the
             embedding, copies (XLA's copies of weight slices count here)
  lm_head    the logits program (the LM head on the sampled rows)
  sampling   the sampling programs (and the logprob parts)
  swaps      the KV moves between the pool and the host tier, and everything else

Op seconds are summed over the ops' own durations: XLA may run two independent ops at once
on its two threads, so the sum can exceed the wall time. The host's side comes from the
engine's step timeline: its seconds of work per part, and the share of the time the device
sat idle waiting for it. Tracing costs a few percent of the wall time.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

JSON_PATH = "out/profile_step.json"  # scripts/profile_step.py's --json unless told
FAMILIES = ("matmuls", "attention", "collectives", "other", "lm_head", "sampling", "swaps")
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
PROGRAMS = {"jit_tick": None, "jit_logits": "lm_head", "jit__sample": "sampling",
            "jit_logprob_parts": "sampling"}  # None: by instruction

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\s([a-z][\w-]*)\((.*)$")
HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
MODULE_FILE = re.compile(r"^module_(\d+)\.(.+)\.cpu_after_optimizations\.txt$")


def enable_dump(where: str | Path) -> None:
    """Ask XLA to dump every module it compiles into `where` (call before JAX's backend
    starts, i.e. before the first array or jit call)."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={where} --xla_dump_hlo_as_text".strip()


def instruction_families(hlo: str) -> dict[str, str]:
    """Instruction name -> "matmuls", "attention", "collectives" or "other" for the
    instructions of one compiled module's text: custom calls by target (the bf16 matmul and
    the ragged attention kernels), collectives by op (their async -start / -done halves too),
    fusions by whether they compute a dot."""
    bodies: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif current is not None and (op := INSTRUCTION.match(line)):
            current.append(op.groups())
    dots = {name for name, ops in bodies.items()
            if any(o in ("dot", "convolution") for _, o, _ in ops)}
    return {name: _family(op, rest, dots) for ops in bodies.values() for name, op, rest in ops}


def _family(op: str, rest: str, dots: set[str]) -> str:
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        return ("matmuls" if "matmul" in target else "attention" if "attention" in target
                else "other")
    if op in ("dot", "convolution"):
        return "matmuls"
    if op.removesuffix("-start").removesuffix("-done") in COLLECTIVES:
        return "collectives"
    called = re.search(r"calls=%(\S+?)[,}\s]", rest + " ")
    return "matmuls" if op == "fusion" and called and called.group(1) in dots else "other"


def module_families(dump: Path) -> dict[int, Callable[[str], str]]:
    """Program id -> (instruction name -> family) for every module dumped in `dump`."""
    out = {}
    for path in dump.iterdir():
        match = MODULE_FILE.match(path.name)
        if not match:
            continue
        program, name = int(match.group(1)), match.group(2)
        fixed = PROGRAMS.get(name, "swaps")
        if fixed is not None:
            out[program] = lambda op, fixed=fixed: fixed
        else:
            table = instruction_families(path.read_text())
            out[program] = lambda op, table=table: table.get(op, "other")
    return out


def op_seconds(trace_dir: Path, families: dict[int, Callable[[str], str]]) -> Counter:
    """Seconds of the traced ops by family (ops of modules not dumped: "unknown")."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(next(trace_dir.rglob("*.xplane.pb"))))
    total: Counter = Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats:
                    continue
                family = families.get(stats.get("program_id"))
                total[family(stats["hlo_op"]) if family else "unknown"] += (
                    event.duration_ns * 1e-9)
    return total


def profile_workload(cfg, dump: Path, log=print, fields: dict | None = None) -> dict:
    """Serve `cfg`'s workload (a `BenchConfig`) on jaxpipe under the profiler, `fields`
    (EngineConfig fields, one of `--engine-field`'s configurations) over the benchmark's; the
    dump directory must be the one `enable_dump` gave XLA. Returns the breakdown."""
    import jax

    from jaxpipe import Engine, EngineConfig
    from jaxpipe_bench import (
        _engine_kwargs,
        _generate,
        check_outputs,
        peer_model_path,
        warmup_requests,
    )
    from jaxpipe_bench.workload import make_workload, peer_vocab

    vocab, special = peer_vocab(peer_model_path(cfg))
    workload = make_workload(cfg.num_prompts, cfg.seed, vocab, cfg.input_len, cfg.output_len,
                             special)
    kwargs = _engine_kwargs(cfg, workload) | dict(fields or {}) | {"compilation_cache_dir": None}
    engine = Engine(EngineConfig(**kwargs))
    _generate(engine, warmup_requests(workload, cfg.warmup_prompts))
    engine.reset_stats()
    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where)
        start = time.perf_counter()
        try:
            outs = _generate(engine, workload)
            elapsed = time.perf_counter() - start
        finally:
            jax.profiler.stop_trace()
        check_outputs(outs, workload)
        seconds = op_seconds(Path(where), module_families(dump))
    stats = engine.stats()
    engine.close()
    output_tokens = sum(r.output_len for r in workload)
    log(f"[profile] {output_tokens / elapsed:.1f} output tok/s in {elapsed:.1f}s (traced)")
    return {"fields": dict(fields or {}), "elapsed_s": elapsed,
            "output_tok_s": output_tokens / elapsed,
            "steps": stats["steps"], "op_seconds": {f: seconds.get(f, 0.0) for f in
                                                    (*FAMILIES, "unknown")},
            "host_seconds": stats["host_seconds"],
            "device_idle_fraction": stats["device_idle_fraction"],
            "mean_decode_batch": stats["mean_decode_batch"]}


def format_table(result: dict) -> str:
    """Seconds, share of the ops' time and ms per step for each family, then the host."""
    ops = result["op_seconds"]
    total = sum(ops.values()) or 1.0
    steps = max(1, result["steps"])
    lines = [f"{'family':12s}{'seconds':>10s}{'share':>8s}{'ms/step':>10s}"]
    for name, seconds in ops.items():
        if name == "unknown" and not seconds:
            continue
        lines.append(f"{name:12s}{seconds:10.2f}{100 * seconds / total:7.1f}%"
                     f"{1e3 * seconds / steps:10.2f}")
    lines.append(f"{'ops, summed':12s}{total:10.2f}{'':8s}{1e3 * total / steps:10.2f}")
    host = result["host_seconds"]
    lines.append(f"{'host work':12s}{sum(host.values()):10.2f}{'':8s}"
                 f"{1e3 * sum(host.values()) / steps:10.2f}   "
                 + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    lines.append(f"wall {result['elapsed_s']:.1f} s over {steps} steps "
                 f"({result['output_tok_s']:.1f} output tok/s traced); device idle "
                 f"{100 * result['device_idle_fraction']:.1f}% of the wall time; mean decode "
                 f"batch {result['mean_decode_batch']:.1f}")
    return "\n".join(lines)
