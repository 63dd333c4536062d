"""Reproduce the Seesaw paper's Fig. 13 and Fig. 10 by simulation (logic and flags:
`ReproduceConfig` in jaxpipe_bench/reproduce.py): prints both tables beside the paper's numbers,
--json writes them.

    python scripts/reproduce_seesaw.py [--json out.json] [--quick]
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, reproduce  # noqa: E402

if __name__ == "__main__":  # two figures of their own request counts: no --num-requests
    reproduce.report(cli.parse(__doc__, reproduce.ReproduceConfig, skip=("num_requests",)),
                     partial(print, flush=True))
