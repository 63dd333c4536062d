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
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe import sharding  # noqa: E402
from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench.schedulers import SchedulersConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench_schedulers.json", help="where the JSON goes")
    add_flags(p, SchedulersConfig, group="benchmark")
    args = p.parse_args()
    config = config_from_args(SchedulersConfig, args, p)
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
    workload = make_workload(config.num_prompts, config.seed, vocab, None, config.output_len,
                             special)
    print(f"[workload] {describe_workload(workload)}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    # the JSON is rewritten after every run: a run that is stopped keeps the ones before it
    for spec in config.run_specs():
        rows.append(run_one(spec, workload, config.engine_kwargs()))
        out.write_text(json.dumps({"args": {**asdict(config), "out": args.out},
                                   "machine": machine_info(),
                                   "workload": describe_workload(workload), "runs": rows},
                                  indent=1))
        print(format_table(rows), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
