"""Gemma 3 (text): Gemma 2's layer plus q/k norms, every sixth layer global, no soft-caps by
default, and the sliding layers' own plain RoPE (`rope_local_theta`): HF's
`rope_parameters` per layer type or the older `rope_local_base_freq`; llama.cpp's 10000."""

from __future__ import annotations

from jaxpipe.config import RopeScaling
from jaxpipe.model.families import gemma2
from jaxpipe.model.family import Family, per_layer

HF_NAMES = {**gemma2.HF_NAMES, **per_layer("model.layers.{i}.", {
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"})}
GGUF_NAMES = {**gemma2.GGUF_NAMES, **per_layer("blk.{i}.", {
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"})}
HF_DEFAULTS = {**gemma2.HF_DEFAULTS, "rope_theta": 1e6, "attn_logit_softcapping": None,
               "final_logit_softcapping": None}
LOCAL_THETA = 10000.0  # Gemma3TextConfig's rope_local_base_freq, llama.cpp's


def hf_rope(c: dict) -> tuple[dict, float]:
    """(the global layers' RoPE, the sliding layers' base): `rope_parameters` nested by layer
    type, or one dict for the global layers and `rope_local_base_freq`. The sliding layers'
    must be plain RoPE."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    nested = {k: v for k, v in rope.items() if isinstance(v, dict)}
    local = nested.get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention {local} is not "
                         "supported; supported: plain RoPE (rope_type default)")
    rope = nested.get("full_attention", rope if not nested else {})
    return rope, float(local.get("rope_theta") or c.get("rope_local_base_freq", LOCAL_THETA))


def gguf_fields(meta) -> dict:
    """Gemma's, every `attention.sliding_window_pattern`-th layer global (default 6), the
    sliding layers' RoPE base 10000, linear RoPE scaling where the file says so."""
    pattern = int(meta.key("attention.sliding_window_pattern", 6))
    fields = gemma2.gguf_gemma(meta, pattern=pattern, caps=(None, None), big_layers=62)
    if fields.get("sliding_layers"):
        fields["rope_local_theta"] = LOCAL_THETA
    if meta.key("rope.scaling.type") == "linear":
        fields["rope_scaling"] = RopeScaling(float(meta.key("rope.scaling.factor")),
                                             rope_type="linear")
    return fields


FAMILY = Family(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES,
    features={"sandwich_norms": True, "qk_norm": True}, hf_defaults=HF_DEFAULTS,
    hf_act_key="hidden_activation", hf_rope=hf_rope, hf_window=gemma2.window(6),
    hf_fields=gemma2.hf_fields, gguf_fields=gguf_fields, hf_value=gemma2.norms_plus_one)
