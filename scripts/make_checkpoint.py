#!/usr/bin/env python
"""Write a ~1.1B-parameter Llama of seeded random weights as an HF checkpoint (config.json,
bf16 model.safetensors, SmolLM2's tokenizer) that jaxpipe, OpenVINO GenAI and HF transformers
all load (needs the bench extra's transformers; logic in `jaxpipe.bench.checkpoint`).

  python scripts/make_checkpoint.py out/llama-1b
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

from jaxpipe.bench.checkpoint import LLAMA_1B, tensor_shapes, write_checkpoint  # noqa: E402
from jaxpipe.bench.workload import default_gguf_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.perf_counter()
    gguf = default_gguf_path()
    out = write_checkpoint(args.out, LLAMA_1B, args.seed, gguf)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    params = sum(math.prod(shape) for shape in tensor_shapes(LLAMA_1B, vocab).values())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters in "
          f"{time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
