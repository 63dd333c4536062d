#!/usr/bin/env python
"""Scheduling policies end to end on 8 virtual CPU devices (mesh cpu-8).

  python scripts/bench_schedulers.py                   # 256 ShareGPT-like requests, SmolLM2
  python scripts/bench_schedulers.py --num-prompts 32 --runs seesaw:pp=8:tp=8
Each run is policy:prefill-layout:decode-layout; the default compares seesaw (pp-heavy prefill
-> tp-heavy decode) with prefill_first on single layouts. Prints a table, writes JSON.
The logic and the flags (`SchedulersConfig`) live in `jaxpipe_bench.schedulers`.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, schedulers  # noqa: E402

if __name__ == "__main__":
    schedulers.run_all(cli.parse(__doc__, schedulers.SchedulersConfig, group="benchmark"),
                       partial(print, flush=True))
