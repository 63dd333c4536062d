"""The resident memory a model's load takes, before it and at its peak, one fresh process per
quantization (logic and flags: `LoadPeakConfig` in jaxpipe_bench.load_peak).

  python scripts/bench_load.py --quantization none gguf      # the default model, bf16
  python scripts/bench_load.py --model PATH/TO/HF_DIR --json out/load.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, load_peak  # noqa: E402
from jaxpipe_bench.report import write_json  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, load_peak.LoadPeakConfig)
    points = load_peak.measure(config)
    print(load_peak.render(points, config))
    if config.json_path:
        write_json(points, config.json_path)


if __name__ == "__main__":
    main()
