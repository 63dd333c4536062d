#!/usr/bin/env python
"""Structured outputs' throughput: the default workload shape with every request held to a
JSON schema, against the same requests unconstrained, in one run, on an engine with
constrained_steps "skip" and then one with "land" (logic and flags: `StructuredBenchConfig`
in jaxpipe_bench.structured).

  python scripts/bench_structured.py --json-path out/bench_structured.json
  python scripts/bench_structured.py --num-prompts 512      # 256 constrained rows a step
  python scripts/bench_structured.py --match-lengths        # unconstrained: the same lengths
  python scripts/bench_structured.py --num-prompts 4 --output-len 32 --repeats 1   # a check
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, structured  # noqa: E402

if __name__ == "__main__":
    config = cli.parse(__doc__, structured.StructuredBenchConfig)
    print(structured.format_record(structured.run(config)))
