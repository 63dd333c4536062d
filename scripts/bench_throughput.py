#!/usr/bin/env python
"""Offline throughput: jaxpipe vs its peers on a seeded ShareGPT-like workload.

Examples:
  python scripts/bench_throughput.py                              # jaxpipe vs HF
  python scripts/bench_throughput.py --peers openvino,hf          # + OpenVINO GenAI (bench extra)
  python scripts/bench_throughput.py --num-prompts 16 --hf-batch-sizes 8,16
  python scripts/bench_throughput.py --input-len 128 --output-len 128 --skip-hf
The logic lives in `jaxpipe_bench`; this file only parses flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: make `jaxpipe` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import BenchConfig, run_benchmark  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags, one per `BenchConfig` field (jaxpipe.config_flags)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_flags(p, BenchConfig, group="benchmark")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the benchmark."""
    cfg = parse_config(argv)
    run_benchmark(cfg)
    return 0


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """The BenchConfig the flags describe; exits with a usage error when nothing would run."""
    parser = build_parser()
    cfg = config_from_args(BenchConfig, parser.parse_args(argv), parser)
    if cfg.skip_jaxpipe and not cfg.active_peers:
        parser.error("--skip-jaxpipe with no peers (--peers '' or --skip-hf) measures nothing")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
