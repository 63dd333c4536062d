"""Attention per layer: the paged C++ kernels vs XLA (logic in jaxpipe.bench.attention).

  python scripts/bench_attention.py --json out/attention.json          # ragged-span kernel
  python scripts/bench_attention.py --decode-sweep --tables identity,shuffled   # old sweep
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe.bench.attention import SPAN_CASES, format_spans, format_table, measure, measure_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(SPAN_CASES),
                        help=f"comma-separated span cases, of: {', '.join(SPAN_CASES)}")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="time the old decode kernel over --rows x --mean-lens x --tables")
    parser.add_argument("--rows", default="32,128,224", help="comma-separated batch sizes")
    parser.add_argument("--mean-lens", default="128,512", help="comma-separated mean lengths")
    parser.add_argument("--tables", default="shuffled",
                        help="comma-separated block tables: identity, shuffled")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per pool block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    tables = args.tables.split(",")
    if args.decode_sweep:
        points = [measure(int(r), int(n), block_size=args.block_size, table=t,
                          repeats=args.repeats)
                  for r in args.rows.split(",") for n in args.mean_lens.split(",") for t in tables]
        print(format_table(points))
    else:
        points = [measure_spans(c, *SPAN_CASES[c], block_size=args.block_size, table=t,
                                repeats=args.repeats)
                  for c in args.cases.split(",") for t in tables]
        print(format_spans(points))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
