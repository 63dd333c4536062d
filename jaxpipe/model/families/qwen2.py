"""Qwen2 / Qwen2.5: Llama's layer with q/k/v projection biases; sliding windows on the layers
from `max_window_layers` on when `use_sliding_window` (HF's rule). RoPE rotate-half, as
llama.cpp stores it too (no Q/K permutation)."""

from __future__ import annotations

from jaxpipe.model.families import llama
from jaxpipe.model.family import Family, per_layer, sliding_layers

HF_NAMES = {**llama.HF_NAMES, **per_layer("model.layers.{i}.", {
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias"})}
# Qwen2Config's, and Qwen3Config's.
HF_DEFAULTS = {"use_sliding_window": False, "max_window_layers": 28}


def window(c: dict) -> tuple[int | None, tuple[int, ...]]:
    """HF's Qwen2/3 rule: no window unless `use_sliding_window`; then the layers from
    `max_window_layers` on (or config.json's `layer_types`)."""
    if not c["use_sliding_window"]:
        return None, ()
    first = c["max_window_layers"]
    return sliding_layers(c, c.get("sliding_window"), lambda layers: [
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)])


FAMILY = Family(
    name="qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",), hf_names=HF_NAMES, gguf_names=llama.GGUF_NAMES,
    features={"qkv_bias": True}, hf_defaults=HF_DEFAULTS, hf_window=window)
