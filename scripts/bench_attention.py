"""Attention per layer: the paged ragged-span C++ kernel (its default path, and paths asked for
by name) vs its XLA reference (logic and flags: `AttentionBenchConfig` in
jaxpipe_bench.attention).

  python scripts/bench_attention.py --json out/attention.json
  python scripts/bench_attention.py --tables identity,shuffled --repeats 10
  python scripts/bench_attention.py --heads mistral --windows 512 --paths portable \
      --cases "decode 64x2048,prefill 1x512 after 1536" --no-xla
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import attention, cli  # noqa: E402
from jaxpipe_bench.report import write_json  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, attention.AttentionBenchConfig)
    points = attention.run(config)
    print(attention.format_spans(points))
    if config.json_path:
        write_json(points, config.json_path)


if __name__ == "__main__":
    main()
