#!/usr/bin/env python
"""Perplexity of the shipped English text (jaxpipe_bench/data/gpl-3.0.txt, 7,658 SmolLM2
tokens) through the engine's prompt_logprobs, per engine configuration, beside HF
transformers' float32 reading of the same GGUF on the same windows.

Examples:
  python scripts/perplexity.py                                   # bf16 vs HF float32
  python scripts/perplexity.py --dtype float32,bfloat16 --max-model-len 512
  python scripts/perplexity.py --engine-field quantization=none,int8 --no-hf-reference
  python scripts/perplexity.py --engine-field kv_cache_dtype=auto,int8 --num-tokens 2000
The logic and the flags (`PerplexityConfig`) live in `jaxpipe_bench.perplexity`; this file
only parses them.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: make `jaxpipe` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import perplexity  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse flags and score the text."""
    perplexity.run(perplexity.parse(__doc__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
