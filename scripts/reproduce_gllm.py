"""Reproduce gLLM's throughput comparison against vLLM (PP) and SGLang (TP), with its
ablations, by simulation (logic in jaxpipe_bench/reproduce_gllm.py; flags: `ReproduceConfig`
in jaxpipe_bench/reproduce.py).

    python scripts/reproduce_gllm.py [--json out.json] [--quick] [--num-requests N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, reproduce, reproduce_gllm  # noqa: E402

if __name__ == "__main__":
    reproduce_gllm.report(cli.parse(__doc__, reproduce.ReproduceConfig))
