"""A real generation run on the default model: chat prompts, greedy and sampled, then a
throughput line. `make demo` runs this (logic and flags: `DemoConfig` in jaxpipe_bench.demo)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, demo  # noqa: E402

if __name__ == "__main__":
    demo.run(cli.parse(__doc__, demo.DemoConfig))
