#!/usr/bin/env python
"""Build an engine, use it, close it, build another in the same process: the first one's memory
must come back (`Engine.close()`), so the second fits where the first did (logic and flags:
`RebuildConfig` in jaxpipe_bench.rebuild).

  python scripts/rebuild_engines.py                    # cpu-1, then cpu-8, default settings
  python scripts/rebuild_engines.py --meshes cpu-8 cpu-1 cpu-8 --requests 32
Prints the process's RSS after each stage and its peak.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, rebuild  # noqa: E402

if __name__ == "__main__":
    rebuild.run(cli.parse(__doc__, rebuild.RebuildConfig), partial(print, flush=True))
