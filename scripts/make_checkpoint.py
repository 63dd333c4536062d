#!/usr/bin/env python
"""Write a model of seeded random weights as an HF checkpoint (config.json, bf16
model.safetensors, SmolLM2's tokenizer) that jaxpipe, OpenVINO GenAI and HF transformers all
load (needs the bench extra's transformers; logic in `jaxpipe_bench.checkpoint`): --family
llama (default) is TinyLlama-1.1B's shape, qwen2 Qwen2.5-0.5B's (q/k/v biases, tied head),
qwen3_moe a ~1.0B-total Qwen3-MoE (8 experts, 2 per token, ~0.32B active).

  python scripts/make_checkpoint.py out/llama-1b
  python scripts/make_checkpoint.py out/qwen2-05b --family qwen2
  python scripts/make_checkpoint.py out/moe-1b --family qwen3_moe
  python scripts/bench_throughput.py --model out/llama-1b --peer-model out/llama-1b \\
      --peers openvino --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench.checkpoint import FAMILIES, tensor_shapes, write_checkpoint  # noqa: E402
from jaxpipe_bench.workload import default_gguf_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                   help="the architecture's family and shape (default: llama)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a GGUF file or a directory of HF tokenizer files to take the "
                        "tokenizer from (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="fewer (or more) layers than the family's shape (a quick smoke run)")
    args = p.parse_args()
    start = time.perf_counter()
    arch = FAMILIES[args.family]
    if args.num_layers is not None:
        if args.num_layers < 1:
            p.error(f"--num-layers must be >= 1, got {args.num_layers}")
        arch = {**arch, "num_layers": args.num_layers}
    out = write_checkpoint(args.out, arch, args.seed, args.tokenizer or default_gguf_path())
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    params = sum(math.prod(shape) for shape in tensor_shapes(arch, vocab).values())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters in "
          f"{time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
