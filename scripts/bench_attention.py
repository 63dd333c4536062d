"""Decode attention per layer: the paged C++ kernel vs XLA (logic in jaxpipe.bench.attention).

  python scripts/bench_attention.py --tables identity,shuffled --json out/attention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe.bench.attention import format_table, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,128,224", help="comma-separated batch sizes")
    parser.add_argument("--mean-lens", default="128,512", help="comma-separated mean lengths")
    parser.add_argument("--tables", default="identity",
                        help="comma-separated block tables: identity, shuffled")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per pool block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    points = [measure(int(r), int(n), block_size=args.block_size, table=t, repeats=args.repeats)
              for r in args.rows.split(",") for n in args.mean_lens.split(",")
              for t in args.tables.split(",")]
    print(format_table(points))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
