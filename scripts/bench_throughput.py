#!/usr/bin/env python
"""Offline throughput: jaxpipe vs its peers on a seeded ShareGPT-like workload.

Examples:
  python scripts/bench_throughput.py                              # jaxpipe vs HF
  python scripts/bench_throughput.py --peers openvino,hf          # + OpenVINO GenAI (bench extra)
  python scripts/bench_throughput.py --num-prompts 16 --hf-batch-sizes 8,16
  python scripts/bench_throughput.py --input-len 128 --output-len 128 --skip-hf
The logic lives in `jaxpipe_bench`; this file only parses flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: make `jaxpipe` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import (  # noqa: E402
    PEER_NAMES,
    BenchConfig,
    parse_peers,
    run_benchmark,
)


def _int_list(text: str) -> tuple[int, ...]:
    """Parse '16,32,64' into (16, 32, 64)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _peers(text: str) -> tuple[str, ...]:
    """Parse 'openvino,hf' for argparse."""
    try:
        return parse_peers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags, one per `BenchConfig` field."""
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=d.num_prompts)
    w.add_argument("--seed", type=int, default=d.seed)
    w.add_argument("--input-len", type=int, help="fixed prompt length (default: lognormal)")
    w.add_argument("--output-len", type=int, help="fixed output length (default: lognormal)")
    e = p.add_argument_group("engines")
    e.add_argument("--dtype", choices=("bfloat16", "float32"), default=d.dtype)
    e.add_argument("--model", default=d.model, help="jaxpipe model name")
    e.add_argument("--peer-model", "--gguf", dest="peer_model",
                   help="the peers' model and the workload's vocabulary: a GGUF file or an HF "
                        "directory (default: SmolLM2's GGUF; pass the same to --model)")
    e.add_argument("--max-num-seqs", type=int, help="jaxpipe batch limit (default: engine's)")
    e.add_argument("--max-num-batched-tokens", type=int, help="jaxpipe prefill token budget")
    e.add_argument("--max-model-len", type=int, help="default: longest request, rounded to 128")
    e.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb,
                   help="jaxpipe's device KV pool in GB (default: the engine's own, sized "
                        "from the free RAM, as a user's Engine() gets)")
    e.add_argument("--warmup-prompts", type=int, default=d.warmup_prompts)
    e.add_argument("--no-overlap", action="store_true",
                   help="jaxpipe lands each step before dispatching the next (ablation)")
    e.add_argument("--sampler", choices=("device", "host"), default=d.sampler,
                   help="jaxpipe's sampler: the device program or NumPy on host threads")
    e.add_argument("--mesh", default=d.mesh, help="jaxpipe's mesh preset, e.g. cpu-8")
    e.add_argument("--layout", help="jaxpipe's layout for prefill and decode, e.g. pp=2,tp=4")
    e.add_argument("--hf-batch-sizes", type=_int_list, default=d.hf_batch_sizes)
    e.add_argument("--hf-num-prompts", type=int, help="run HF on only the first N prompts")
    e.add_argument("--hf-max-seconds", type=float, help="stop each HF sweep point after ~N s")
    e.add_argument("--peers", type=_peers, default=d.peers,
                   help=f"comma list from {{{','.join(PEER_NAMES)}}}; '' for none (default: hf)")
    e.add_argument("--ov-batched-tokens", type=_int_list, default=d.ov_batched_tokens,
                   help="OpenVINO max_num_batched_tokens sweep (best point kept)")
    e.add_argument("--ov-kv-cache-precision", choices=("bf16", "f32", "u8"),
                   help="OpenVINO KV cache precision (default: same as --dtype)")
    e.add_argument("--skip-hf", action="store_true", help="no hf, whatever --peers says")
    e.add_argument("--skip-jaxpipe", action="store_true")
    e.add_argument("--skip-matmul", action="store_true", help="no matmul peak / FLOP/s line")
    e.add_argument("--matmul-repeats", type=int, default=d.matmul_repeats)
    p.add_argument("--json", dest="json_path", default=d.json_path, help="output JSON path")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the benchmark."""
    cfg = parse_config(argv)
    run_benchmark(cfg)
    return 0


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """The BenchConfig the flags describe; exits with a usage error when nothing would run."""
    parser = build_parser()
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    if cfg.skip_jaxpipe and not cfg.active_peers:
        parser.error("--skip-jaxpipe with no peers (--peers '' or --skip-hf) measures nothing")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
