"""bf16, int8 (W8A8) and GGUF block matmuls: the C++ kernels vs XLA's dots per row count (logic and
flags: `MatmulKernelConfig` in jaxpipe_bench.matmul_kernel).

  python scripts/bench_matmul_kernel.py --rows 1,8,16,32,64,128,256 --json out/matmul_kernel.json
  python scripts/bench_matmul_kernel.py --gguf-formats q4_1,q8_0,q4_0 --gguf-paths avx512_vnni
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, matmul_kernel  # noqa: E402
from jaxpipe_bench.report import write_json  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, matmul_kernel.MatmulKernelConfig)
    points = matmul_kernel.run(config, partial(print, flush=True))
    print(matmul_kernel.format_table(points))
    if config.json_path:
        write_json(points, config.json_path)


if __name__ == "__main__":
    main()
