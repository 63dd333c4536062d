#!/usr/bin/env python
"""Build an engine, use it, close it, build another in the same process: the first one's memory
must come back (`Engine.close()`), so the second fits where the first did.

  python scripts/rebuild_engines.py                    # cpu-1, then cpu-8, default settings
  python scripts/rebuild_engines.py --meshes cpu-8 cpu-1 cpu-8 --requests 32
Prints the process's RSS after each stage and its peak.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe import sharding  # noqa: E402


def rss_gib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meshes", nargs="+", default=["cpu-1", "cpu-8"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    sharding.ensure_cpu_devices(max(int(m.split("-")[1]) for m in args.meshes))
    from jaxpipe import Engine, SamplingParams

    prompts = [f"Write one sentence about the number {i}." for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"{'stage':<28}{'RSS GiB':>9}{'peak GiB':>10}", flush=True)
    print(f"{'start':<28}{rss_gib():>9.2f}{peak_gib():>10.2f}", flush=True)
    for mesh in args.meshes:
        with Engine(mesh=mesh, show_progress=False) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{mesh + ' built, ' + str(tokens) + ' tokens':<28}{rss_gib():>9.2f}"
                  f"{peak_gib():>10.2f}", flush=True)
        print(f"{mesh + ' closed':<28}{rss_gib():>9.2f}{peak_gib():>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
