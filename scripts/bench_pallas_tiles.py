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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, pallas_tiles  # noqa: E402

if __name__ == "__main__":
    pallas_tiles.run(cli.parse(__doc__, pallas_tiles.SweepConfig))
