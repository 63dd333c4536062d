"""Reproduce TD-Pipe's 4-GPU comparison (Fig. 11) and its ablations (Fig. 13-16) by
simulation (logic in jaxpipe_bench/reproduce_tdpipe.py): prints both tables beside the paper's
numbers, --json writes them.

    python scripts/reproduce_tdpipe.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench import reproduce_tdpipe as rt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--num-requests", type=int, default=rt.NUM_REQUESTS)
    args = ap.parse_args()
    n = args.num_requests // 4 if args.quick else args.num_requests
    overall = rt.overall(n)
    print(rt.format_overall(overall), flush=True)
    ablations = rt.ablations(n)
    print()
    print(rt.format_ablations(ablations))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"num_requests": n, "overall": overall,
                                               "ablations": ablations}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
