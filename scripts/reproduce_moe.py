"""The planner's (pp, tp, ep) choice for MoE models against every static layout, by simulation
(logic in jaxpipe_bench/reproduce_moe.py): prints the table and writes it as JSON.

    python scripts/reproduce_moe.py [--json out/reproduce_moe.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench import reproduce_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", metavar="PATH", default="out/reproduce_moe.json",
                    help="where to write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = ap.parse_args()
    num_requests = reproduce_moe.NUM_REQUESTS // (4 if args.quick else 1)
    rows = reproduce_moe.run(num_requests)
    print(reproduce_moe.format_table(rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
