"""Command-line flags for the engine, shared by `python -m jaxpipe.serve` and
`python -m jaxpipe.batch`. Each flag maps to one `EngineConfig` field and is passed on only when
given, so EngineConfig's own defaults and validation apply."""

from __future__ import annotations

import argparse
import dataclasses

from jaxpipe.config import DTYPES, EngineConfig

# flag dest -> (EngineConfig field, help). A field this EngineConfig lacks is refused with a
# clear message when its flag is used.
ENGINE_FLAGS = {
    "model": ("model", "model preset in models/ (e.g. smollm2-135m), a .gguf file, an HF "
                       "directory or an orbax checkpoint (default: smollm2-135m)"),
    "dtype": ("dtype", f"weights dtype, one of {', '.join(DTYPES)} (default: bfloat16)"),
    "max_model_len": ("max_model_len", "longest prompt + output in tokens "
                                       "(default: min(model limit, 2048))"),
    "max_num_seqs": ("max_num_seqs", "sequences on the device at once (default: as many as "
                                     "fit in --kv-cache-gb at --max-model-len each)"),
    "max_num_batched_tokens": ("max_num_batched_tokens", "token budget of one prefill batch "
                                                         "(default: 4096)"),
    "kv_cache_gb": ("kv_cache_gb", "device KV store size in GiB (default: 8)"),
    "kv_cache_tokens": ("kv_cache_tokens", "device KV store size in tokens (overrides "
                                           "--kv-cache-gb)"),
    "seed": ("seed", "seed for requests that give none (default: 0)"),
    "compilation_cache_dir": ("compilation_cache_dir", "JAX persistent compilation cache "
                                                       "(default: ~/.cache/jaxpipe/xla)"),
    "mesh": ("mesh", "device mesh preset in meshes/ (e.g. cpu-8)"),
    "prefill": ("prefill", "prefill layout, e.g. 'pp=8'"),
    "decode": ("decode", "decode layout, e.g. 'tp=4,pp=2'"),
    "scheduler": ("scheduler", "scheduling policy: auto (default: seesaw over two layouts, "
                               "else prefill_first), seesaw, prefill_first, decode_first, "
                               "tdpipe (TD-Pipe) or throttle (gLLM)"),
    "throttle_iterations": ("throttle_iterations", "throttle: gLLM's #T (default: 8)"),
    "throttle_max_prefill": ("throttle_max_prefill", "throttle: gLLM's #MaxP (default: 2048)"),
    "throttle_min_prefill": ("throttle_min_prefill", "throttle: gLLM's #MinP (default: 32)"),
    "throttle_kv_thresh": ("throttle_kv_thresh", "throttle: gLLM's KV_thresh (default: 0.05)"),
    "tdpipe_predictor": ("tdpipe_predictor", "tdpipe: output-length predictor, learned "
                                             "(default) or oracle"),
    "tdpipe_finish_ratio": ("tdpipe_finish_ratio", "tdpipe: switch decode -> prefill once this "
                                                   "fraction finished (default: by TD-Pipe's "
                                                   "intensity comparison)"),
    "host_kv_gb": ("host_kv_gb", "host KV tier size in GiB (default: 4)"),
    "host_kv_tokens": ("host_kv_tokens", "host KV tier size in tokens (overrides --host-kv-gb)"),
}
_TYPES = {"max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
          "kv_cache_gb": float, "kv_cache_tokens": int, "seed": int, "host_kv_gb": float,
          "host_kv_tokens": int, "throttle_iterations": int, "throttle_max_prefill": int,
          "throttle_min_prefill": int, "throttle_kv_thresh": float,
          "tdpipe_finish_ratio": float}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (one per EngineConfig field) to `parser`."""
    group = parser.add_argument_group("engine")
    for dest, (_, help_text) in ENGINE_FLAGS.items():
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, type=_TYPES.get(dest, str),
                           default=None, help=help_text)
    group.add_argument("--random-weights", action="store_true",
                       help="seeded random weights (architecture-only presets, benchmarks)")
    group.add_argument("--no-warmup", action="store_true",
                       help="skip compiling every decode shape at start (faster start, slower "
                            "first requests)")


def engine_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """EngineConfig fields from parsed flags (only those given); validated by EngineConfig."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {"model": "smollm2-135m"}
    for dest, (name, _) in ENGINE_FLAGS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if name not in known:
            parser.error(f"--{dest.replace('_', '-')} needs EngineConfig.{name}, which this "
                         "jaxpipe version does not have yet")
        kwargs[name] = value
    if args.random_weights:
        kwargs["random_weights"] = True
    if args.no_warmup:
        kwargs["warmup"] = False
    try:
        EngineConfig(**kwargs)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return kwargs
