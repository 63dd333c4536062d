#!/usr/bin/env python
"""One process of 8 CPU devices against two processes of 4 (one engine over a cluster):

  python scripts/bench_multihost.py                      # 16 requests x 32 tokens, SmolLM2
  python scripts/bench_multihost.py --num-prompts 64 --prefill pp=8 --decode tp=8

Prints both runs and the leader's control-channel overhead per step (bytes, ms), checks that
how alike both runs' tokens are (float32: identical; bfloat16 may flip near ties, as the
reductions run in another order), writes JSON. The logic lives in `jaxpipe_bench.multihost`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import multihost  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, multihost.MultihostConfig, group="benchmark")
    p.add_argument("--json", default="bench_multihost.json", help="where to write the results")
    args = p.parse_args()
    cfg = config_from_args(multihost.MultihostConfig, args, p)
    with tempfile.TemporaryDirectory(prefix="jaxpipe-multihost-") as tmp:
        one = multihost.run(cfg, 1, Path(tmp))
        two = multihost.run(cfg, 2, Path(tmp))
    same = multihost.agreement(one["tokens"], two["tokens"])
    rows = {"one": multihost.summary(one), "two": multihost.summary(two)}
    print(multihost.table(rows["one"], rows["two"], same))
    Path(args.json).write_text(json.dumps({"config": dataclasses.asdict(cfg), **rows,
                                           "same_tokens": same}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
