#!/usr/bin/env python
"""Pipelined decode on 8 virtual CPU devices (mesh cpu-8): one GPipe pass per step (today)
against K steps per call with the micro-batches kept in flight.

  python scripts/bench_decode_pipeline.py                  # SmolLM2-135M, bf16
  python scripts/bench_decode_pipeline.py --steps 1 4 8 --layouts pp=2,tp=4 pp=8
Prints a table and writes JSON. The logic lives in `jaxpipe.bench.decode_pipeline`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe import sharding  # noqa: E402
from jaxpipe.bench import decode_pipeline  # noqa: E402


def main() -> None:
    d = decode_pipeline.DecodeBenchConfig()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--position", type=int, default=d.position)
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--steps", type=int, nargs="+", default=list(d.steps))
    p.add_argument("--layouts", nargs="+", default=list(d.layouts))
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--out", default="out/bench_decode_pipeline.json")
    args = p.parse_args()
    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend

    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    cfg, values = loading.load_weights(resolve_model(args.model))
    bench = decode_pipeline.DecodeBenchConfig(
        dtype=args.dtype, batch=args.batch, position=args.position, max_len=args.max_len,
        steps=tuple(args.steps), layouts=tuple(args.layouts), repeats=args.repeats)
    record = decode_pipeline.run(cfg, values, bench)
    print(decode_pipeline.format_table(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
