"""Attention per layer: the paged ragged-span C++ kernel vs its XLA reference (logic in
jaxpipe_bench.attention).

  python scripts/bench_attention.py --json out/attention.json
  python scripts/bench_attention.py --tables identity,shuffled --repeats 10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench.attention import SPAN_CASES, format_spans, measure_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(SPAN_CASES),
                        help=f"comma-separated span cases, of: {', '.join(SPAN_CASES)}")
    parser.add_argument("--tables", default="shuffled",
                        help="comma-separated block tables: identity, shuffled")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per pool block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    points = [measure_spans(c, *SPAN_CASES[c], block_size=args.block_size, table=t,
                            repeats=args.repeats)
              for c in args.cases.split(",") for t in args.tables.split(",")]
    print(format_spans(points))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
