"""Gemma 3 (text): Gemma 2's layer plus q/k norms, every sixth layer global, no soft-caps by
default, and the sliding layers' own plain RoPE (`rope_local_theta`): HF's
`rope_parameters` per layer type or the older `rope_local_base_freq`; llama.cpp's 10000."""

from __future__ import annotations

from jaxpipe.config.model import RopeScaling
from jaxpipe.model.families import gemma2
from jaxpipe.model.family import Family, per_layer

HF_NAMES = {**gemma2.HF_NAMES, **per_layer("model.layers.{i}.", {
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"})}
GGUF_NAMES = {**gemma2.GGUF_NAMES, **per_layer("blk.{i}.", {
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"})}
HF_DEFAULTS = {**gemma2.HF_DEFAULTS, "rope_theta": 1e6, "attn_logit_softcapping": None,
               "final_logit_softcapping": None}
LOCAL_THETA = 10000.0  # Gemma3TextConfig's rope_local_base_freq, llama.cpp's
window = gemma2.window(6)


def _ropes(c: dict) -> tuple[dict, dict]:
    """(the global layers' RoPE dict, the sliding layers'): `rope_parameters` nested by layer
    type, or one dict (the global layers') beside `rope_local_base_freq`."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    nested = {k: v for k, v in rope.items() if isinstance(v, dict)}
    return nested.get("full_attention", rope if not nested else {}), (
        nested.get("sliding_attention") or {})


def hf_rope(c: dict) -> dict:
    """The global layers' RoPE."""
    return _ropes(c)[0]


def hf_fields(c: dict) -> dict:
    """Gemma 2's, and where there are sliding layers their own base (`rope_local_theta`),
    which must be plain RoPE."""
    local = _ropes(c)[1]
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention {local} is not "
                         "supported; supported: plain RoPE (rope_type default)")
    _, sliding = window(c)
    theta = float(local.get("rope_theta") or c.get("rope_local_base_freq", LOCAL_THETA))
    return gemma2.hf_fields(c) | ({"rope_local_theta": theta} if sliding else {})


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
    hf_act_key="hidden_activation", hf_rope=hf_rope, hf_window=window, hf_fields=hf_fields,
    gguf_fields=gguf_fields, hf_value=gemma2.norms_plus_one)
