"""The planner's (pp, tp, ep) choice for MoE models against every static layout, by simulation
(logic in jaxpipe_bench/reproduce_moe.py; flags: `ReproduceConfig` in
jaxpipe_bench/reproduce.py): prints the table and writes it as JSON.

    python scripts/reproduce_moe.py [--json out/reproduce_moe.json] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, reproduce, reproduce_moe  # noqa: E402

if __name__ == "__main__":
    reproduce_moe.report(cli.parse(__doc__, reproduce.ReproduceConfig,
                                   defaults={"json_path": reproduce_moe.JSON_PATH}))
