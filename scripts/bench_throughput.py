#!/usr/bin/env python
"""Offline throughput: jaxpipe vs its peers on a seeded ShareGPT-like workload.

Examples:
  python scripts/bench_throughput.py                              # jaxpipe vs HF
  python scripts/bench_throughput.py --peers openvino,hf          # + OpenVINO GenAI (bench extra)
  python scripts/bench_throughput.py --num-prompts 16 --hf-batch-sizes 8,16
  python scripts/bench_throughput.py --input-len 128 --output-len 128 --skip-hf
  # a rollout: 64 prompts, 8 samples each at temperature 1, against OpenVINO GenAI
  python scripts/bench_throughput.py --num-prompts 64 --input-range 256-1024 \\
      --output-len 256 --samples 8 --peers openvino
The logic and the flags (`BenchConfig`) live in `jaxpipe_bench`; this file only parses them.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: make `jaxpipe` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import BenchConfig, cli, run_benchmark  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the benchmark."""
    run_benchmark(parse_config(argv))
    return 0


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """The BenchConfig the flags describe (a usage error where the class refuses them, e.g.
    when nothing would run)."""
    return cli.parse(__doc__, BenchConfig, argv, group="benchmark")


if __name__ == "__main__":
    sys.exit(main())
