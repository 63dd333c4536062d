"""Reproduce TD-Pipe's 4-GPU comparison (Fig. 11) and its ablations (Fig. 13-16) by
simulation (logic in jaxpipe_bench/reproduce_tdpipe.py; flags: `ReproduceConfig` in
jaxpipe_bench/reproduce.py): prints both tables beside the paper's numbers, --json writes them.

    python scripts/reproduce_tdpipe.py [--json out.json] [--quick] [--num-requests N]
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, reproduce, reproduce_tdpipe  # noqa: E402

if __name__ == "__main__":
    reproduce_tdpipe.report(cli.parse(__doc__, reproduce.ReproduceConfig),
                            partial(print, flush=True))
