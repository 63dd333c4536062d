#!/usr/bin/env python
"""The Pallas ragged attention kernel's tiles (queries per tile, Triton's warps and stages)
swept over decode rows x contexts and prefill chunks on the GPU JAX sees: ms, GB/s against the
measured memory bandwidth, TFLOP/s, the XLA path beside it, the best tiles per shape and per
kind. Logic in `jaxpipe_bench.pallas_tiles`.

  python scripts/bench_pallas_tiles.py --json out/pallas_tiles.json
  JAX_PLATFORMS=cpu python scripts/bench_pallas_tiles.py --interpret --decode-rows 1,4 \\
      --contexts 32,64 --prefill-chunks 24 --tq 4,16 --num-warps 0 --repeats 1  # CPU smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import pallas_tiles  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the record here (rewritten after every point)")
    add_flags(p, pallas_tiles.SweepConfig, group="sweep")
    args = p.parse_args()
    cfg = config_from_args(pallas_tiles.SweepConfig, args, p)
    save = (lambda record: pallas_tiles.write(record, args.json)) if args.json else None
    record = pallas_tiles.sweep(cfg, **({"save": save} if save else {}))
    print(pallas_tiles.format_table(record))


if __name__ == "__main__":
    main()
