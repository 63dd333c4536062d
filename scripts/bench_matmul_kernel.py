"""bf16 matmul: the C++ kernel vs XLA's dot per row count (logic in jaxpipe_bench.matmul_kernel).

  python scripts/bench_matmul_kernel.py --rows 1,8,16,32,64,128,256 --json out/matmul_kernel.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench.matmul_kernel import ROWS, SHAPES, format_table, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M")
    parser.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES),
                        help="comma-separated KxN weight shapes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    points = []
    for k, n in shapes:
        for m in map(int, args.rows.split(",")):
            points.append(measure(k, n, m, repeats=args.repeats))
            print(format_table(points[-1:]).splitlines()[1], flush=True)
    print(format_table(points))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
