#!/usr/bin/env python
"""The engine's step timeline with each host-side technique off and on: output tok/s, the
device idle fraction during decode and host milliseconds per step by part, per variant.

Examples:
  python scripts/bench_timeline.py                                  # one device, bf16
  python scripts/bench_timeline.py --mesh cpu-8 --layout pp=2,tp=4 --num-prompts 32
  python scripts/bench_timeline.py --trace out/traces               # + Perfetto trace JSONs
The logic lives in `jaxpipe_bench.timeline`; this file only parses flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import timeline  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--mesh", default="cpu-1")
    p.add_argument("--layout", help="one layout for prefill and decode, e.g. pp=2,tp=4")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(timeline.DEFAULT_VARIANTS),
                   choices=list(timeline.VARIANTS))
    p.add_argument("--stop", help="a stop string for every request (one that never matches, "
                   "e.g. '<<never>>', makes every request detokenize as it runs)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace JSON per run into this folder")
    p.add_argument("--json", default="out/bench_timeline.json")
    args = p.parse_args()

    from jaxpipe import Engine, EngineConfig
    from jaxpipe_bench import default_max_model_len, describe_workload
    from jaxpipe_bench.workload import default_gguf_path, gguf_vocab, make_workload

    vocab, special = gguf_vocab(default_gguf_path())
    workload = make_workload(args.num_prompts, args.seed, vocab, special_ids=special)
    layouts = {"prefill": args.layout, "decode": args.layout} if args.layout else {}
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, mesh=args.mesh,
                                 max_model_len=default_max_model_len(workload),
                                 kv_cache_gb=8.0, show_progress=False, **layouts))
    title = (f"{args.model} {args.dtype} on {args.mesh} ({engine.runner.layouts['decode']}), "
             f"{args.num_prompts} requests, median of {args.repeats}"
             + (f", stop={args.stop!r}" if args.stop else ""))
    results = timeline.run_variants(engine, workload, args.variants, args.repeats, args.trace,
                                    args.stop)
    print(timeline.render(title, results))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"title": title, "workload": describe_workload(workload),
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
