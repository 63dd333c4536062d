#!/usr/bin/env python
"""Pipelined decode on 8 virtual CPU devices (mesh cpu-8): one GPipe pass per step (today)
against K steps per call with the micro-batches kept in flight.

  python scripts/bench_decode_pipeline.py                  # SmolLM2-135M, bf16
  python scripts/bench_decode_pipeline.py --steps 1 4 8 --layouts pp=2,tp=4 pp=8
Prints a table and writes JSON. The logic lives in `jaxpipe.bench.decode_pipeline`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.bench import cli, decode_pipeline  # noqa: E402

if __name__ == "__main__":
    cli.run_model_bench(__doc__, decode_pipeline.DecodeBenchConfig, decode_pipeline.run,
                        decode_pipeline.format_table, "out/bench_decode_pipeline.json")
