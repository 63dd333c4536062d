"""One MoE layer's expert-parallel exchange two ways on virtual CPU devices: the engine's psum
of [T, E] over ep against an all-to-all exchange there and back (logic and flags:
`EpExchangeConfig` in jaxpipe_bench.ep_exchange). The 1B Qwen3-MoE checkpoint's layer shapes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python scripts/bench_ep_exchange.py --ep 8 --tokens 8,64,512 --json out/ep_exchange.json
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jaxpipe_bench import cli, ep_exchange  # noqa: E402
from jaxpipe_bench.report import write_points  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, ep_exchange.EpExchangeConfig)
    path, points = ep_exchange.run(config, partial(print, flush=True))
    print(f"experts' path {path}, {len(jax.devices())} devices, median of {config.rounds} "
          "interleaved rounds")
    print(ep_exchange.format_table(points))
    write_points(config.json_path, points)


if __name__ == "__main__":
    main()
