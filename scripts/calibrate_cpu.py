"""Calibrate the cost model on this machine (logic and flags: `CalibrateConfig` in
jaxpipe_bench/calibrate.py): measure the CPU preset's constants, then print predicted vs measured
prefill and decode step times of the real engine (SmolLM2-135M, bf16, one device) as a ratio.
About 2 minutes.

    python scripts/calibrate_cpu.py [--json out/calibration.json] [--write-preset]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import calibrate, cli  # noqa: E402

if __name__ == "__main__":
    calibrate.run(cli.parse(__doc__, calibrate.CalibrateConfig))
