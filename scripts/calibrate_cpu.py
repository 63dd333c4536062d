"""Calibrate the cost model on this machine (logic in jaxpipe_bench/calibrate.py): measure the
CPU preset's constants, then print predicted vs measured prefill and decode step times of the
real engine (SmolLM2-135M, bf16, one device) as a ratio. About 2 minutes.

    python scripts/calibrate_cpu.py [--json out/calibration.json] [--write-preset]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpipe_bench import calibrate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--write-preset", action="store_true",
                    help="set the measured constants in meshes/cpu-1.toml, and the same machine "
                         "split 8 ways in meshes/cpu-8.toml (comments kept)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per shape (median)")
    args = ap.parse_args()
    result = calibrate.calibrate(repeats=args.repeats)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.write_preset:
        hardware = result["hardware"]
        print(f"wrote {calibrate.write_preset(hardware, 'cpu-1')}")
        print(f"wrote {calibrate.write_preset(calibrate.split(hardware, 8), 'cpu-8')}")


if __name__ == "__main__":
    main()
