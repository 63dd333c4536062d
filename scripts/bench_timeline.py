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

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import timeline  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="out/bench_timeline.json", help="where the JSON goes")
    add_flags(p, timeline.TimelineConfig, group="benchmark")
    args = p.parse_args()
    config = config_from_args(timeline.TimelineConfig, args, p)

    from jaxpipe import Engine, EngineConfig
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
    results = timeline.run_variants(engine, workload, config.variants, config.repeats,
                                    config.trace, config.stop)
    print(timeline.render(title, results))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"title": title, "workload": describe_workload(workload),
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
