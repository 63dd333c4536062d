#!/usr/bin/env python
"""n samples of one request against one sample, same run: 8 greedy samples of a 1,500-token
prompt with 4 new tokens each, against one (logic and flags: `SamplesBenchConfig` in
jaxpipe_bench.samples).

  python scripts/bench_samples.py --json out/bench_samples.json
  python scripts/bench_samples.py --samples 4 --input-len 512 --repeats 3
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, samples  # noqa: E402

if __name__ == "__main__":
    print(samples.format_record(samples.run(cli.parse(__doc__, samples.SamplesBenchConfig))))
