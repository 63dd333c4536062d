"""One step's sampling: the device sampler against the host sampler (sampler="host") on the
same logits, per batch rows and kind of request (logic in jaxpipe_bench.sampler).

  python scripts/bench_sampler.py --json out/sampler.json
  python scripts/bench_sampler.py --rows 64 256 --threads 2 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench.sampler import measure, render  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2, help="host sampler threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", dest="json_path", help="write the points here")
    args = parser.parse_args()
    points = measure(args.rows, args.threads, args.repeats)
    print(render(points, args.threads))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(points, indent=2))


if __name__ == "__main__":
    main()
