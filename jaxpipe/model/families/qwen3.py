"""Qwen3: Llama's layer with a per-head RMSNorm of q and k before RoPE (no biases), an
explicit `head_dim`; Qwen2's window rule."""

from __future__ import annotations

from jaxpipe.model.families import llama, qwen2
from jaxpipe.model.family import Family, per_layer

HF_NAMES = {**llama.HF_NAMES, **per_layer("model.layers.{i}.", {
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"})}
GGUF_NAMES = {**llama.GGUF_NAMES, **per_layer("blk.{i}.", {
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"})}

FAMILY = Family(
    name="qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES,
    features={"qk_norm": True}, hf_defaults=qwen2.HF_DEFAULTS, hf_window=qwen2.window)
