#!/usr/bin/env python
"""The engine's step timeline with each host-side technique off and on: output tok/s, the
device idle fraction during decode and host milliseconds per step by part, per variant.

Examples:
  python scripts/bench_timeline.py                                  # one device, bf16
  python scripts/bench_timeline.py --mesh cpu-8 --layout pp=2,tp=4 --num-prompts 32
  python scripts/bench_timeline.py --trace out/traces               # + Perfetto trace JSONs
The logic and the flags (`TimelineConfig`) live in `jaxpipe_bench.timeline`; this file only
parses them.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, timeline  # noqa: E402

if __name__ == "__main__":
    timeline.run(cli.parse(__doc__, timeline.TimelineConfig, group="benchmark"),
                 partial(print, flush=True))
