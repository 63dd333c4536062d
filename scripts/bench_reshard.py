#!/usr/bin/env python
"""Re-shard cost and pipeline bubble on 8 virtual CPU devices (mesh cpu-8).

  python scripts/bench_reshard.py                      # SmolLM2-135M, bf16
  python scripts/bench_reshard.py --dtype float32 --repeats 5 --out out/reshard.json
Prints two tables and writes JSON. The logic lives in `jaxpipe.bench.layouts`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe import sharding  # noqa: E402
from jaxpipe.bench import layouts  # noqa: E402


def main() -> None:
    d = layouts.LayoutBenchConfig()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"])
    p.add_argument("--decode-batch", type=int, default=d.decode_batch)
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--prefill-batch", type=int, default=d.prefill_batch)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--out", default="out/bench_reshard.json")
    args = p.parse_args()
    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend

    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    cfg, values = loading.load_weights(resolve_model(args.model))
    bench = layouts.LayoutBenchConfig(
        dtype=args.dtype, decode_batch=args.decode_batch, context=args.context,
        prefill_batch=args.prefill_batch, prompt_len=args.prompt_len, repeats=args.repeats)
    record = layouts.run(cfg, values, bench)
    print(layouts.format_tables(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
