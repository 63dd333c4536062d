"""Reproduce the Seesaw paper's Fig. 13 and Fig. 10 by simulation (logic in
jaxpipe_bench/reproduce.py): prints both tables beside the paper's numbers, --json writes them.

    python scripts/reproduce_seesaw.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench import reproduce


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = ap.parse_args()
    scale = 4 if args.quick else 1
    fig13 = reproduce.fig13(reproduce.FIG13_REQUESTS // scale)
    print(reproduce.format_fig13(fig13), flush=True)
    fig10 = reproduce.fig10(reproduce.FIG10_REQUESTS // scale)
    print()
    print(reproduce.format_fig10(fig10))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"fig13": fig13, "fig10": fig10}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
