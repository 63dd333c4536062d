#!/usr/bin/env python
"""Re-shard cost and pipeline bubble on 8 virtual CPU devices (mesh cpu-8).

  python scripts/bench_reshard.py                      # SmolLM2-135M, bf16
  python scripts/bench_reshard.py --dtype float32 --repeats 5 --out out/reshard.json
Prints two tables and writes JSON. The logic and the flags (`LayoutBenchConfig`) live in
`jaxpipe_bench.layouts`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, layouts  # noqa: E402

if __name__ == "__main__":
    cli.run_model_bench(__doc__, layouts.LayoutBenchConfig, layouts.run, layouts.format_tables)
