"""Reproduce SiPipe's throughput gain over vLLM under the same PP configuration (Fig. 8a, 8x
H100) by simulation (logic in jaxpipe_bench/reproduce_sipipe.py; flags: `ReproduceConfig` in
jaxpipe_bench/reproduce.py).

    python scripts/reproduce_sipipe.py [--json out.json] [--quick] [--num-requests N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, reproduce, reproduce_sipipe  # noqa: E402

if __name__ == "__main__":
    reproduce_sipipe.report(cli.parse(__doc__, reproduce.ReproduceConfig))
