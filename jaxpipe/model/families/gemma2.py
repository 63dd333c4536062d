"""Gemma 2: Llama's layer with `x * (1 + w)` RMSNorms (stored as 1 + w at load; GGUF stores
them so), four norms per layer (the attention's and the MLP's outputs normalised before their
residual adds: `sandwich_norms`), embeddings times sqrt(hidden), a GELU-tanh MLP, q.k scaled by
`query_pre_attn_scalar` ** -0.5, attention and final-logit soft-capping, windows on every
other layer. llama.cpp's rules where a GGUF has no key: soft-caps 50 / 30, q.k scaled by
1/sqrt(head_dim), 1/sqrt(hidden / heads) for the 27B model."""

from __future__ import annotations

from jaxpipe.model.families import llama
from jaxpipe.model.family import Family, per_layer, sliding_layers

# Gemma's sandwich names the MLP's input norm pre_feedforward_layernorm (GGUF: ffn_norm, as
# Llama's); its post_attention_layernorm normalises the attention's output.
HF_NAMES = {**llama.HF_NAMES, **per_layer("model.layers.{i}.", {
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm"})}
GGUF_NAMES = {**llama.GGUF_NAMES, **per_layer("blk.{i}.", {
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm"})}
HF_DEFAULTS = {"tie_word_embeddings": True, "sliding_window": 4096,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def norms_plus_one(_cfg, name: str, w):
    """HF stores Gemma's norms as w of `x * (1 + w)`: jaxpipe's norms multiply by 1 + w."""
    return w + 1.0 if name.endswith("norm") else w


def window(pattern: int):
    """HF's Gemma rule: every `sliding_window_pattern`-th layer (default `pattern`) global,
    the others sliding (or config.json's `layer_types`)."""

    def hf_window(c: dict) -> tuple[int | None, tuple[int, ...]]:
        every = c.get("sliding_window_pattern", pattern)
        return sliding_layers(c, c.get("sliding_window"), lambda layers: [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)])

    return hf_window


def hf_fields(c: dict) -> dict:
    """Gemma's scales and soft-caps (HF's defaults in HF_DEFAULTS)."""
    return dict(embed_scale=c["hidden_size"] ** 0.5, attn_scale=c["query_pre_attn_scalar"] ** -0.5,
                attn_softcap=c["attn_logit_softcapping"],
                final_softcap=c["final_logit_softcapping"])


def gguf_gemma(meta, pattern: int, caps: tuple, big_layers: int) -> dict:
    """Gemma's fields from GGUF metadata, with llama.cpp's rules where the file has no key:
    windows on all but every `pattern`-th layer, soft-caps `caps`, q.k scaled by
    1/sqrt(head_dim), 1/sqrt(hidden / heads) in the 27B model (`big_layers` layers)."""
    scalar = meta.hidden // meta.heads if meta.layers == big_layers else meta.head_dim
    fields = dict(embed_scale=meta.hidden ** 0.5, mlp_act="gelu_tanh", attn_scale=scalar ** -0.5,
                  attn_softcap=meta.key("attn_logit_softcapping", caps[0]),
                  final_softcap=meta.key("final_logit_softcapping", caps[1]))
    window = meta.key("attention.sliding_window")
    if window is not None:
        fields |= dict(sliding_window=int(window), sliding_layers=tuple(
            i for i in range(meta.layers) if (i + 1) % pattern))
    return fields


def gguf_fields(meta) -> dict:
    """Gemma's, a window on every other layer, soft-caps 50 / 30 where the file has none."""
    return gguf_gemma(meta, pattern=2, caps=(50.0, 30.0), big_layers=46)


FAMILY = Family(
    name="gemma2", hf_architectures=("Gemma2ForCausalLM",), hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES,
    features={"sandwich_norms": True}, hf_defaults=HF_DEFAULTS,
    hf_act_key="hidden_activation", hf_window=window(2), hf_fields=hf_fields,
    gguf_fields=gguf_fields, hf_value=norms_plus_one)
