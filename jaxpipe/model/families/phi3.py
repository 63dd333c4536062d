"""Phi-3 / 3.5 / 4-mini: Llama's layer with fused projections (`qkv_proj`, `gate_up_proj`,
split at load), RoPE on `partial_rotary_factor` of each head, LongRoPE (HF's older types
"su" and "yarn" read as it; in GGUF the factors are tensors), a window on every layer."""

from __future__ import annotations

from jaxpipe.model import rope_config
from jaxpipe.model.families import llama
from jaxpipe.model.family import Family, one_rope, per_layer

HF_NAMES = {**llama.HF_NAMES, **per_layer("model.layers.{i}.", {
    "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"})}
# llama.cpp's ffn_up holds Phi-3's fused gate and up.
GGUF_NAMES = {**llama.GGUF_NAMES, **per_layer("blk.{i}.", {
    "attn_qkv.weight": "qkv", "ffn_up.weight": "gate_up"})}
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def hf_rope(c: dict) -> dict:
    """One RoPE; HF's Phi-3 reads the older types "su" and "yarn" as LongRoPE."""
    rope = one_rope(c)
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope = {**rope, "rope_type": "longrope"}
    return rope


def gguf_fields(meta) -> dict:
    """A window on every layer where the file has one; LongRoPE as llama.cpp stores it (the
    factors as tensors, the original context length and attention factor as keys)."""
    fields = {}
    window = meta.key("attention.sliding_window")
    if window is not None:
        fields |= dict(sliding_window=int(window), sliding_layers=tuple(range(meta.layers)))
    if LONGROPE_TENSORS[1] in meta.tensor_names:
        original = int(meta.key("rope.scaling.original_context_length"))
        rope = {"attention_factor": meta.key("rope.scaling.attn_factor"),
                "short_factor": meta.tensor_values("rope_factors_short.weight"),
                "long_factor": meta.tensor_values("rope_factors_long.weight")}
        fields["rope_scaling"] = rope_config.longrope(
            rope, {"max_position_embeddings": int(meta.key("context_length", original))},
            original)
    return fields


FAMILY = Family(
    name="phi3", hf_architectures=("Phi3ForCausalLM",), hf_model_types=("phi3",),
    gguf_architectures=("phi3",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES, hf_rope=hf_rope,
    gguf_fields=gguf_fields, gguf_config_tensors=LONGROPE_TENSORS)
