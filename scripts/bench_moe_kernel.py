"""MoE experts on CPU: dense vs XLA ragged_dot vs the C++ grouped kernel (logic in
jaxpipe_bench.moe_kernel).

  python scripts/bench_moe_kernel.py --tokens 8,64,512 --json out/moe_kernel.json
"""

from __future__ import annotations

import argparse

from jaxpipe_bench.moe_kernel import CASES, TOKENS, format_table, measure
from jaxpipe_bench.report import write_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T")
    parser.add_argument("--cases", default=",".join("x".join(map(str, c)) for c in CASES),
                        help="comma-separated XxKxExF (experts, top-k, hidden, intermediate)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ragged-max-gflop", type=float, default=20.0,
                        help="skip ragged_dot where its CPU lowering does more work than this")
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    points = []
    for case in cases:
        for t in map(int, args.tokens.split(",")):
            points.append(measure(*case, t, args.rounds, args.ragged_max_gflop))
            print(format_table(points[-1:]).splitlines()[1], flush=True)
    print(format_table(points))
    write_points(args.json_path, points)


if __name__ == "__main__":
    main()
