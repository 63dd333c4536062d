#!/usr/bin/env python
"""One process of 8 CPU devices against two processes of 4 (one engine over a cluster):

  python scripts/bench_multihost.py                      # 16 requests x 32 tokens, SmolLM2
  python scripts/bench_multihost.py --num-prompts 64 --prefill pp=8 --decode tp=8

Prints both runs and the leader's control-channel overhead per step (bytes, ms), checks that
how alike both runs' tokens are (float32: identical; bfloat16 may flip near ties, as the
reductions run in another order), writes JSON. The logic and the flags (`MultihostConfig`)
live in `jaxpipe_bench.multihost`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, multihost  # noqa: E402

if __name__ == "__main__":
    multihost.report(cli.parse(__doc__, multihost.MultihostConfig, group="benchmark"))
