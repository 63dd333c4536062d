"""MoE experts on CPU: dense vs XLA ragged_dot vs the C++ grouped kernel (logic and flags:
`MoeKernelConfig` in jaxpipe_bench.moe_kernel).

  python scripts/bench_moe_kernel.py --tokens 8,64,512 --json out/moe_kernel.json
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, moe_kernel  # noqa: E402
from jaxpipe_bench.report import write_points  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, moe_kernel.MoeKernelConfig)
    points = moe_kernel.run(config, partial(print, flush=True))
    print(moe_kernel.format_table(points))
    write_points(config.json_path, points)


if __name__ == "__main__":
    main()
