"""One step's sampling: the device sampler against the host sampler (sampler="host") on the
same logits, per batch rows and kind of request (logic and flags: `SamplerBenchConfig` in
jaxpipe_bench.sampler).

  python scripts/bench_sampler.py --json out/sampler.json
  python scripts/bench_sampler.py --rows 64 256 --threads 2 --repeats 9
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, sampler  # noqa: E402
from jaxpipe_bench.report import write_json  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, sampler.SamplerBenchConfig)
    points = sampler.measure(config.rows, config.threads, config.repeats)
    print(sampler.render(points, config.threads))
    if config.json_path:
        write_json(points, config.json_path)


if __name__ == "__main__":
    main()
