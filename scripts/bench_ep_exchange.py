"""One MoE layer's expert-parallel exchange two ways on virtual CPU devices: the engine's psum
of [T, E] over ep against an all-to-all dispatch and combine (logic in
jaxpipe_bench.ep_exchange). The 1B Qwen3-MoE checkpoint's layer shapes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python scripts/bench_ep_exchange.py --ep 8 --tokens 8,64,512 --json out/ep_exchange.json
"""

from __future__ import annotations

import argparse

import jax

from jaxpipe.kernels import matmul
from jaxpipe_bench.ep_exchange import EP, SHAPE, TOKENS, capacity_for, format_table, measure
from jaxpipe_bench.report import write_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T")
    parser.add_argument("--ep", type=int, default=EP, help="expert shards (devices used)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dispatch", choices=("grouped", "dense", "ragged"),
                        help="the experts' dispatch (default: grouped where its kernel "
                             "builds, else dense)")
    parser.add_argument("--capacity-factor", type=float,
                        help="all-to-all buffer rows at this multiple of the balanced share "
                             "(pairs past it dropped); default: no drop")
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    dispatch = args.dispatch or ("grouped" if matmul.available() else "dense")
    points = []
    for t in map(int, args.tokens.split(",")):
        cap = capacity_for(t, args.ep, SHAPE["k"], args.capacity_factor)
        points.append(measure(t, args.ep, args.rounds, dispatch, cap))
        print(format_table(points[-1:]).splitlines()[1], flush=True)
    print(f"dispatch {dispatch}, {len(jax.devices())} devices, median of {args.rounds} "
          "interleaved rounds")
    print(format_table(points))
    write_points(args.json_path, points)


if __name__ == "__main__":
    main()
