"""Reproduce gLLM's throughput comparison against vLLM (PP) and SGLang (TP), with its
ablations, by simulation (logic in jaxpipe_bench/reproduce_gllm.py).

    python scripts/reproduce_gllm.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench import reproduce_gllm as rg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--num-requests", type=int, default=rg.NUM_REQUESTS)
    args = ap.parse_args()
    n = args.num_requests // 4 if args.quick else args.num_requests
    rows = rg.compare(n)
    print(rg.format_compare(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"num_requests": n, "compare": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
