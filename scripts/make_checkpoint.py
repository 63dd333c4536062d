#!/usr/bin/env python
"""Write a model of seeded random weights as an HF checkpoint (config.json, bf16
model.safetensors, SmolLM2's tokenizer) that jaxpipe, OpenVINO GenAI and HF transformers all
load (needs the bench extra's transformers; logic and arguments: `CheckpointConfig` in
`jaxpipe_bench.checkpoint`): --family llama (default) is TinyLlama-1.1B's shape, qwen2
Qwen2.5-0.5B's (q/k/v biases, tied head), qwen3_moe a ~1.0B-total Qwen3-MoE (8 experts, 2 per
token, ~0.32B active).

  python scripts/make_checkpoint.py out/llama-1b
  python scripts/make_checkpoint.py out/qwen2-05b --family qwen2
  python scripts/make_checkpoint.py out/moe-1b --family qwen3_moe
  python scripts/bench_throughput.py --model out/llama-1b --peer-model out/llama-1b \\
      --peers openvino --num-prompts 64
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import checkpoint, cli  # noqa: E402

if __name__ == "__main__":
    checkpoint.make_checkpoint(cli.parse(__doc__, checkpoint.CheckpointConfig))
