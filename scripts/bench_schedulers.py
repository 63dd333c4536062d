#!/usr/bin/env python
"""Scheduling policies end to end on 8 virtual CPU devices (mesh cpu-8).

  python scripts/bench_schedulers.py                   # 256 ShareGPT-like requests, SmolLM2
  python scripts/bench_schedulers.py --num-prompts 32 --runs seesaw:pp=8:tp=8
Each run is policy:prefill-layout:decode-layout; the default compares seesaw (pp-heavy prefill
-> tp-heavy decode) with prefill_first on single layouts. Prints a table, writes JSON.
The logic lives in `jaxpipe_bench.schedulers`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe import sharding  # noqa: E402

DEFAULT_RUNS = "seesaw:pp=8:tp=8,prefill_first:tp=8:tp=8,prefill_first:pp=2,tp=4:pp=2,tp=4"


def parse_runs(text: str):
    from jaxpipe_bench.schedulers import RunSpec

    specs = []
    for item in _split_runs(text):
        policy, prefill, decode = item.split(":")
        specs.append(RunSpec(policy, prefill, decode))
    return specs


def _split_runs(text: str) -> list[str]:
    """'a:pp=8:tp=8,b:pp=2,tp=4:tp=8' -> runs (layouts contain commas; policies start runs)."""
    runs: list[str] = []
    for part in text.split(","):
        if ":" in part.split("=")[0]:  # "policy:..." starts a new run
            runs.append(part)
        else:
            runs[-1] += "," + part
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"default: {DEFAULT_RUNS}")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, help="fixed output length (default: lognormal)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--host-kv-tokens", type=int, help="host tier size (default: the engine's)")
    p.add_argument("--out", default="out/bench_schedulers.json")
    args = p.parse_args()
    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend

    from jaxpipe_bench.report import machine_info
    from jaxpipe_bench.schedulers import format_table, run_one
    from jaxpipe_bench.workload import (
        default_gguf_path,
        describe_workload,
        gguf_vocab,
        make_workload,
    )

    vocab, special = gguf_vocab(default_gguf_path())
    workload = make_workload(args.num_prompts, args.seed, vocab, None, args.output_len, special)
    kwargs = dict(model=args.model, dtype=args.dtype, mesh="cpu-8",
                  max_num_seqs=args.max_num_seqs, show_progress=True)
    if args.host_kv_tokens is not None:
        kwargs["host_kv_tokens"] = args.host_kv_tokens
    print(f"[workload] {describe_workload(workload)}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in parse_runs(args.runs):  # the JSON is rewritten after every run: a run that
        rows.append(run_one(spec, workload, kwargs))  # is stopped keeps the ones before it
        out.write_text(json.dumps({"args": vars(args), "machine": machine_info(),
                                   "workload": describe_workload(workload), "runs": rows},
                                  indent=1))
        print(format_table(rows), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
