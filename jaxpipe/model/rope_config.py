"""HF's `rope_scaling` / `rope_parameters` dict -> `RopeScaling`, with HF's defaults
(`transformers.modeling_rope_utils`). GGUF's LongRoPE is read through the same rules."""

from __future__ import annotations

import math

from jaxpipe.config.model import RopeScaling


def rope_scaling(rope: dict, c: dict) -> RopeScaling | None:
    """`rope` (the global layers' RoPE dict of config.json `c`) -> `RopeScaling` (None:
    plain RoPE). As HF, a config-level original_max_position_embeddings wins over the RoPE
    dict's (Phi-3)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    original = c.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings") or c.get("max_position_embeddings", 4096)
    try:
        if kind == "llama3":
            return RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                               float(rope["high_freq_factor"]), int(original))
        if kind in ("linear", "dynamic"):
            return RopeScaling(float(rope["factor"]), rope_type=kind)
        if kind == "yarn":
            return yarn(rope, c, int(original))
        if kind == "longrope":
            return longrope(rope, c, int(original))
    except KeyError as missing:
        raise ValueError(f"config.json rope_scaling of type {kind!r} lacks {missing}") from None
    raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; supported: "
                     "default, llama3, linear, dynamic, yarn, longrope")


def longrope(rope: dict, c: dict, original: int) -> RopeScaling:
    """LongRoPE's parameters with HF's defaults (`_compute_longrope_parameters`)."""
    factor = rope.get("factor") or c.get("max_position_embeddings", 4096) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(float(factor), original_max_position_embeddings=original,
                       rope_type="longrope", attention_factor=float(attention),
                       short_factor=tuple(float(x) for x in rope["short_factor"]),
                       long_factor=tuple(float(x) for x in rope["long_factor"]))


def yarn(rope: dict, c: dict, original: int) -> RopeScaling:
    """YaRN's parameters with HF's defaults (`_compute_yarn_parameters`)."""
    factor = rope.get("factor") or c.get("max_position_embeddings", 4096) / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(float(factor), original_max_position_embeddings=original,
                       rope_type="yarn", beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=float(attention), truncate=bool(rope.get("truncate", True)))
