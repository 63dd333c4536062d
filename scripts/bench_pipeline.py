#!/usr/bin/env python
"""The flowing pipeline against one device: a decode-heavy workload (128 requests of 32 + 96
tokens by default, f32) under throttle and tdpipe on cpu-1 and on cpu-8's pp=8 and pp=4,tp=2,
each run in its own process of this invocation; output tok/s, each pipelined run over cpu-1,
the pipeline's bubble fraction, and whether every layout gave the same tokens (logic and
flags: `FlowBenchConfig` in jaxpipe_bench.pipeline_flow).

  python scripts/bench_pipeline.py --json out/bench_pipeline.json --trace out/pipeline_trace.json
  python scripts/bench_pipeline.py --num-prompts 16 --output-len 8 --schedulers throttle
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, pipeline_flow  # noqa: E402

if __name__ == "__main__":
    record = pipeline_flow.run(cli.parse(__doc__, pipeline_flow.FlowBenchConfig))
    print(pipeline_flow.format_ratios(record))
