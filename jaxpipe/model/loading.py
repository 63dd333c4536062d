"""Weights into the model: GGUF (dequantized), HF safetensors directories, orbax checkpoints.

Every loader produces `(ModelConfig, {param name: array})` in the layout `param_decls` declares.
GGUF and HF share one conversion: GGUF tensor names are mapped to HF names (a GGUF's stacked
experts split into HF's per-expert ones) and llama.cpp's Q/K row permutation is undone first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxpipe.config import ModelConfig, RopeScaling
from jaxpipe.model.presets import ORBAX_MARKER

GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    # Mixtures of experts: the router [X, E]; Qwen2-MoE's shared expert, which jaxpipe runs as
    # the dense MLP, and its gate [E] or [1, E].
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# A GGUF's experts, stacked: gate/up [X, F', E], down [X, E, F'] -> HF's per-expert names.
_GGUF_EXPERTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                 "ffn_down_exps.weight": "down"}
# GGUF architectures. llama.cpp interleaves Q/K rows (pairwise RoPE) for the Llama ones only;
# Qwen's, Gemma's and Phi's use rotate-half ("neox") RoPE, stored as HF has them.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                      "qwen2moe", "qwen3moe")
_GGUF_PERMUTED_QK = ("llama", "mistral")
# Whether llama.cpp renormalises the top-k router weights (its build_moe_ffn's norm_w, fixed
# per architecture, not read from the file): Mixtral (as `llama`) and Qwen3-MoE do,
# Qwen2-MoE does not.
_GGUF_NORM_TOPK = {"llama": True, "mistral": True, "qwen3moe": True, "qwen2moe": False}
# Where an architecture's names differ from GGUF_TO_HF: Gemma's sandwich norms (its MLP input
# norm is ffn_norm), Phi-3's fused projections (split by `_split_fused`).
_GGUF_NAMES_BY_ARCH = {
    **dict.fromkeys(("gemma2", "gemma3"), {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}),
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# llama.cpp's Gemma 27B models scale q.k by 1/sqrt(hidden / heads), the others by
# 1/sqrt(head_dim) (GGUF has no query_pre_attn_scalar); (arch, layers) of the 27B ones.
_GGUF_GEMMA_27B = {("gemma2", 46), ("gemma3", 62)}


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> ModelConfig:
    """Architecture from GGUF metadata (`{arch}.*` keys as llama.cpp writes them)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")

    def key(name, default=None):
        return _gguf_field(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if (
        "tokenizer.ggml.tokens" in reader.fields) else int(key("vocab_size"))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    switches = _gguf_switches(arch, key, names, hidden, heads) | _gguf_moe(reader, arch, key)
    if "rope_factors_short.weight" in names:
        switches["rope_scaling"] = _gguf_longrope(reader, key)
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_layers=int(key("block_count")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=switches.pop("head_dim"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        **switches)


def _gguf_moe(reader, arch: str, key) -> dict:
    """The dense MLP's width, and the experts' fields where the file has experts
    (`{arch}.expert_count`): their width is `expert_feed_forward_length` (Mixtral as `llama`:
    `feed_forward_length`), Qwen2-MoE's shared expert `expert_shared_feed_forward_length`."""
    experts = int(key("expert_count", 0))
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF {arch} has no {arch}.expert_count (or 0); a {arch} file "
                             "needs its expert count")
        return {"intermediate_size": int(key("feed_forward_length"))}
    if arch not in _GGUF_NORM_TOPK:
        raise ValueError(f"GGUF {arch} with {arch}.expert_count={experts} is not supported; "
                         f"experts are supported in: {', '.join(_GGUF_NORM_TOPK)}")
    names = {t.name for t in reader.tensors}
    dense = [i for i in range(int(key("block_count"))) if f"blk.{i}.ffn_gate_exps.weight"
             not in names]
    if dense:  # gguf's qwen2moe/qwen3moe tensor maps have no dense ffn_gate/up/down either
        raise ValueError(f"GGUF {arch} layer {dense[0]} has no experts (no blk.{dense[0]}."
                         "ffn_gate_exps.weight): dense layers among the MoE ones are not "
                         "supported from GGUF (llama.cpp's MoE architectures need experts in "
                         "every layer); load the HF checkpoint instead")
    width = key("expert_feed_forward_length") or key("feed_forward_length")
    shared = 0
    if any(t.name == "blk.0.ffn_gate_shexp.weight" for t in reader.tensors):
        shared = int(key("expert_shared_feed_forward_length", 0)) or next(
            int(t.shape[1]) for t in reader.tensors if t.name == "blk.0.ffn_gate_shexp.weight")
    return dict(num_experts=experts, num_experts_per_tok=int(key("expert_used_count")),
                moe_intermediate_size=int(width), norm_topk_prob=_GGUF_NORM_TOPK[arch],
                intermediate_size=shared)


def _gguf_longrope(reader, key) -> RopeScaling:
    """Phi-3.5/4's LongRoPE as llama.cpp stores it (the factors as tensors, the original
    context length and the attention factor as keys), read through `_longrope`."""
    factors = {t.name: np.asarray(t.data, np.float32).reshape(-1) for t in reader.tensors
               if t.name.startswith("rope_factors_")}
    original = int(key("rope.scaling.original_context_length"))
    rope = {"attention_factor": key("rope.scaling.attn_factor"),
            "short_factor": factors["rope_factors_short.weight"],
            "long_factor": factors["rope_factors_long.weight"]}
    return _longrope(rope, {"max_position_embeddings": int(key("context_length", original))},
                     original)


def _gguf_switches(arch: str, key, names: set, hidden: int, heads: int) -> dict:
    """The family switches of a GGUF's metadata, with llama.cpp's rules where the file has
    no key: Gemma 2 soft-caps 50 / 30 and slides every other layer, Gemma 3 every sixth layer
    is global and its sliding layers' RoPE base is 10000, Phi's window covers every layer."""
    head_dim = int(key("attention.key_length", hidden // heads))
    out = {"head_dim": head_dim}
    layers, window = int(key("block_count")), key("attention.sliding_window")
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        out["rotary_dim"] = int(rotary)
    if arch not in ("gemma2", "gemma3", "phi3") or window is None:
        return out
    pattern = {"gemma2": 2, "gemma3": int(key("attention.sliding_window_pattern", 6))}.get(
        arch, 0)
    out |= {"sliding_window": int(window),
            "sliding_layers": tuple(i for i in range(layers) if not pattern or (i + 1) % pattern)}
    if arch == "phi3":
        return out
    scalar = hidden // heads if (arch, layers) in _GGUF_GEMMA_27B else head_dim
    caps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    out |= {"embed_scale": hidden ** 0.5, "sandwich_norms": True, "mlp_act": "gelu_tanh",
            "attn_scale": scalar ** -0.5,
            "attn_softcap": key("attn_logit_softcapping", caps[0]),
            "final_softcap": key("final_logit_softcapping", caps[1])}
    if arch == "gemma3":
        out["rope_local_theta"] = 10000.0
        if key("rope.scaling.type") == "linear":
            out["rope_scaling"] = RopeScaling(float(key("rope.scaling.factor")),
                                              rope_type="linear")
    return out


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (it converts rotate-half RoPE to pairwise).

    w [n_heads * D, E]: within each head, llama.cpp stores rows as (D/2, 2); HF as (2, D/2).
    """
    per_head = w.shape[0] // n_heads
    return w.reshape(n_heads, per_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read and dequantize a GGUF file."""
    from gguf import GGUFReader, quants

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    arch = _gguf_field(reader, "general.architecture")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: GGUF with rope_freqs (Llama-3.1 scaling) is not supported yet")
    hf: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.startswith("rope_factors_"):  # LongRoPE's, read by gguf_config
            continue
        value = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        value = value.reshape([int(n) for n in reversed(t.shape)])
        if t.name.startswith("blk."):
            hf |= _gguf_block_tensor(path, cfg, arch, t.name, value)
        else:
            hf[GGUF_TO_HF[t.name]] = value
    _split_fused(cfg, hf)  # Gemma's norms are stored as 1 + w already: no offset
    return cfg, from_hf_names(cfg, hf.__getitem__)


def _gguf_block_tensor(path: Path, cfg: ModelConfig, arch: str, name: str,
                       value: np.ndarray) -> dict[str, np.ndarray]:
    """One `blk.{i}.*` tensor under its HF name(s): Llama's Q/K rows un-permuted, stacked
    experts split into one matrix per expert, Qwen2-MoE's shared-expert gate as [1, E]."""
    _, idx, rest = name.split(".", 2)
    pre, renames = f"model.layers.{idx}.", GGUF_TO_HF | _GGUF_NAMES_BY_ARCH.get(arch, {})
    if arch in _GGUF_PERMUTED_QK and rest in ("attn_q.weight", "attn_k.weight"):
        value = _unpermute_qk(value, cfg.num_heads if rest == "attn_q.weight"
                              else cfg.num_kv_heads)
    if rest in _GGUF_EXPERTS:
        return {f"{pre}mlp.experts.{x}.{_GGUF_EXPERTS[rest]}_proj.weight": w
                for x, w in enumerate(value)}
    if rest not in renames:
        raise ValueError(f"{path}: GGUF tensor {name!r} is not supported (a part of "
                         f"the {cfg.num_layers}-layer model jaxpipe does not run)")
    if rest == "ffn_gate_inp_shexp.weight":
        value = value.reshape(1, -1)
    return {pre + renames[rest]: value}


# HF architectures -> the family switches they set (model/decoder.py's config fields).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_MOE = ("qwen2_moe", "qwen3_moe", "mixtral")
# HF's default expert count where config.json leaves it out (its config classes').
_DEFAULT_EXPERTS = {"qwen2_moe": 60, "qwen3_moe": 128, "mixtral": 8}
_GEMMA = ("gemma2", "gemma3")
# HF's default when config.json leaves `sliding_window` out (MistralConfig, Gemma2Config).
_DEFAULT_WINDOW = {"mistral": 4096, "gemma2": 4096, "gemma3": 4096}
# config.json's activation names -> ModelConfig.mlp_act.
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Families whose RMSNorms multiply by (1 + w): the loader stores 1 + w.
_NORM_PLUS_ONE = _GEMMA


def hf_config(config_json: dict) -> ModelConfig:
    """Architecture from an HF `config.json` of one of `HF_ARCHITECTURES`; any value of a
    field jaxpipe does not implement fails, naming the field and what is supported."""
    c = config_json
    family = _hf_family(c)
    heads = c["num_attention_heads"]
    act = (c.get("hidden_activation") or "gelu_pytorch_tanh" if family in _GEMMA
           else c.get("hidden_act", "silu"))
    if act not in _ACTS:
        raise ValueError(f"config.json hidden_act={act!r} is not supported; supported: "
                         f"{sorted(_ACTS)}")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag) and not (family == "qwen2" and flag == "attention_bias"):
            raise ValueError(f"config.json {flag}=true is not supported for {family} "
                             "(biases only on Qwen2's q/k/v projections)")
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window, sliding = _hf_sliding_layers(c, family)
    if c.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true is not supported; "
                         "supported: causal attention")
    rope, local_theta = _hf_rope(c, family)
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rotary = int(head_dim * float(rope.get("partial_rotary_factor")
                                   or c.get("partial_rotary_factor") or 1.0))
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        **({} if family in _MOE else {"intermediate_size": c["intermediate_size"]}),
        num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=head_dim, rotary_dim=rotary if rotary != head_dim else None,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta") or c.get("rope_theta")
                         or (1e6 if family == "gemma3" else 10000.0)),
        rope_scaling=_rope_scaling(rope, c, family), max_position_embeddings=c.get(
            "max_position_embeddings", 4096),
        tie_embeddings=bool(c.get("tie_word_embeddings", family in _GEMMA)),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids,
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and c.get("qkv_bias", True)),
        qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
        sliding_window=window, sliding_layers=sliding, mlp_act=_ACTS[act],
        rope_local_theta=local_theta if sliding else None,
        **(_gemma(c, family) if family in _GEMMA else {}),
        **(_hf_moe(c, family) if family in _MOE else {}))


def _hf_moe(c: dict, family: str) -> dict:
    """The experts' fields of Qwen2-MoE, Qwen3-MoE and Mixtral (HF's defaults for what
    config.json leaves out). Qwen2-MoE's shared expert is the dense MLP (intermediate_size);
    Mixtral renormalises its top-k. The dense layers among the MoE ones by HF's rule
    (Qwen2/3-MoE's decoder layer: MoE unless in mlp_only_layers or (i + 1) %
    decoder_sparse_step != 0), whose MLP is intermediate_size wide."""
    layers = c["num_hidden_layers"]
    step, only = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step!r} must be a positive integer")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:
        raise ValueError(f"config.json decoder_sparse_step={step}, mlp_only_layers={only} "
                         "leave no MoE layer; a dense model is supported as its dense family")
    experts = c.get("num_experts") or c.get("num_local_experts") or _DEFAULT_EXPERTS[family]
    mixtral = family == "mixtral"
    return dict(
        num_experts=experts, num_experts_per_tok=c.get("num_experts_per_tok", 2),
        moe_intermediate_size=c["intermediate_size" if mixtral else "moe_intermediate_size"],
        norm_topk_prob=mixtral or bool(c.get("norm_topk_prob", False)),
        intermediate_size=(c.get("shared_expert_intermediate_size") or 0
                           if family == "qwen2_moe" else 0),
        dense_layers=dense, dense_intermediate_size=c["intermediate_size"] if dense else 0)


def _gemma(c: dict, family: str) -> dict:
    """Gemma 2/3's switches, with Gemma2Config's / Gemma3TextConfig's defaults for what
    config.json leaves out (Gemma 3 soft-caps nothing by default)."""
    caps = (50.0, 30.0) if family == "gemma2" else (None, None)
    return dict(embed_scale=c["hidden_size"] ** 0.5, sandwich_norms=True,
                attn_scale=c.get("query_pre_attn_scalar", 256) ** -0.5,
                attn_softcap=c.get("attn_logit_softcapping", caps[0]),
                final_softcap=c.get("final_logit_softcapping", caps[1]))


def _hf_family(c: dict) -> str:
    archs = c.get("architectures") or []
    known = [HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES]
    if known:
        return known[0]
    by_type = {f: f for f in HF_ARCHITECTURES.values()}
    if not archs and c.get("model_type") in by_type:
        return by_type[c["model_type"]]
    raise ValueError(f"config.json architectures={archs} (model_type={c.get('model_type')!r}) "
                     f"is not supported; supported: {sorted(HF_ARCHITECTURES)}")


def _hf_sliding_layers(c: dict, family: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to) as HF builds `layer_types`: every layer for Mistral,
    Qwen2/3's layers from `max_window_layers` on when `use_sliding_window`, or `layer_types`
    as given."""
    layers = c["num_hidden_layers"]
    window = c.get("sliding_window", _DEFAULT_WINDOW.get(family))
    types = c.get("layer_types")
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not c.get(
            "use_sliding_window", False):
        window = None
    elif family in ("qwen2_moe", "qwen3_moe"):
        raise ValueError(f"config.json use_sliding_window=true is not supported for {family}; "
                         "supported: full attention on every layer")
    if window is None:
        return None, ()
    if types is None and family in _GEMMA:  # every pattern-th layer global, the rest sliding
        pattern = c.get("sliding_window_pattern", 2 if family == "gemma2" else 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if types is None:
        first = c.get("max_window_layers", 28) if family in ("qwen2", "qwen3") else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ValueError(f"config.json layer_types {bad} are not supported; supported: "
                         "'full_attention', 'sliding_attention'")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window) if sliding else None), sliding


def _hf_rope(c: dict, family: str) -> tuple[dict, float | None]:
    """(the global layers' RoPE parameters, the sliding layers' own RoPE base or None).
    Gemma 3 gives each layer type its own (`rope_parameters` nested by layer type, or the
    older `rope_local_base_freq`); the sliding layers' must be plain RoPE."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    nested = {k: v for k, v in rope.items() if isinstance(v, dict)}
    local = None
    if family == "gemma3":
        local = nested.get("sliding_attention") or {}
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"config.json rope_parameters.sliding_attention {local} is not "
                             "supported; supported: plain RoPE (rope_type default)")
        rope = nested.get("full_attention", rope if not nested else {})
        return rope, float(local.get("rope_theta") or c.get("rope_local_base_freq", 10000.0))
    if nested:
        raise ValueError(f"config.json rope_parameters per layer type {sorted(nested)} are not "
                         f"supported for {family}; supported: one RoPE for every layer")
    return rope, local


def _rope_scaling(rope: dict, c: dict, family: str) -> RopeScaling | None:
    """HF's `rope_scaling` / `rope_parameters` -> `RopeScaling` (None: plain RoPE). As HF,
    a config-level original_max_position_embeddings wins over the RoPE dict's (Phi-3), and
    Phi-3 reads its older types "su" and "yarn" as LongRoPE."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"
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
            return _yarn(rope, c, int(original))
        if kind == "longrope":
            return _longrope(rope, c, int(original))
    except KeyError as missing:
        raise ValueError(f"config.json rope_scaling of type {kind!r} lacks {missing}") from None
    raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; supported: "
                     "default, llama3, linear, dynamic, yarn, longrope")


def _longrope(rope: dict, c: dict, original: int) -> RopeScaling:
    """LongRoPE's parameters with HF's defaults (`_compute_longrope_parameters`)."""
    factor = rope.get("factor") or c.get("max_position_embeddings", 4096) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(float(factor), original_max_position_embeddings=original,
                       rope_type="longrope", attention_factor=float(attention),
                       short_factor=tuple(float(x) for x in rope["short_factor"]),
                       long_factor=tuple(float(x) for x in rope["long_factor"]))


def _yarn(rope: dict, c: dict, original: int) -> RopeScaling:
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


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read config.json and every *.safetensors file of an HF checkpoint directory."""
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    cfg = hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has config.json but no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    _split_fused(cfg, tensors)
    _moe_names(cfg, tensors)
    norm_offset = 1.0 if _hf_family(config) in _NORM_PLUS_ONE else 0.0
    return cfg, from_hf_names(cfg, tensors.__getitem__, norm_offset)


def _split_fused(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
    """Phi-3's fused projections into the unfused names, in place: qkv_proj [(H + 2 Hkv) D,
    E] into q/k/v_proj, gate_up_proj [2F, E] into gate_proj (first half) and up_proj."""
    q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f = cfg.intermediate_size
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        qkv = tensors.pop(pre + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            for name, part in zip("qkv", np.split(qkv, [q, q + k]), strict=True):
                tensors[f"{pre}self_attn.{name}_proj.weight"] = part
        gate_up = tensors.pop(pre + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            tensors[pre + "mlp.gate_proj.weight"] = gate_up[:f]
            tensors[pre + "mlp.up_proj.weight"] = gate_up[f:]


# Per-expert weights under Mixtral's names -> Qwen's (w1 gate, w3 up, w2 down).
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _moe_names(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
    """An MoE checkpoint's expert names as `from_hf_names` reads them, in place:
    `mlp.experts.{x}.{gate,up,down}_proj.weight` per expert (Mixtral's block_sparse_moe and
    w1/w3/w2 renamed; transformers' fused `experts.gate_up_proj` [X, 2F, E] and
    `experts.down_proj` [X, E, F] split), and Qwen2-MoE's shared expert as the dense MLP."""
    if not cfg.is_moe:
        return
    for name in [n for n in tensors if ".block_sparse_moe." in n]:
        new = name.replace(".block_sparse_moe.", ".mlp.")
        for old, hf in _MIXTRAL_EXPERT.items():
            new = new.replace(f".{old}.weight", f".{hf}.weight")
        tensors[new] = tensors.pop(name)
    f = cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp."
        gate_up, down = (tensors.pop(pre + f"experts.{n}_proj", None) for n in ("gate_up", "down"))
        for x in range(cfg.num_experts if gate_up is not None else 0):
            tensors[f"{pre}experts.{x}.gate_proj.weight"] = gate_up[x, :f]
            tensors[f"{pre}experts.{x}.up_proj.weight"] = gate_up[x, f:]
            tensors[f"{pre}experts.{x}.down_proj.weight"] = down[x]
        for n in ("gate", "up", "down"):
            shared = tensors.pop(f"{pre}shared_expert.{n}_proj.weight", None)
            if shared is not None:
                tensors[f"{pre}{n}_proj.weight"] = shared


def _hf_experts(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """The router [L, E, X], the experts' gate/up [L, X, E, 2, F'] and down [L, X, F', E],
    and the shared expert's gate [L, E] (see `decoder.moe_decls`) from `_moe_names`'s names;
    zeros in `cfg.dense_layers`, which have none."""
    experts = range(cfg.num_experts)

    def expert(i: int, x: int, n: str) -> np.ndarray:
        return get(f"model.layers.{i}.mlp.experts.{x}.{n}_proj.weight").T

    def layers(fn) -> np.ndarray:  # [L, ...]: fn(i) in the MoE layers, zeros in the others
        got = {i: np.asarray(fn(i)) for i in range(cfg.num_layers) if i not in cfg.dense_layers}
        zero = np.zeros_like(next(iter(got.values())))
        return np.stack([got.get(i, zero) for i in range(cfg.num_layers)])

    values = {
        "router": layers(lambda i: get(f"model.layers.{i}.mlp.gate.weight").T),
        "w_experts_gate_up": layers(lambda i: [np.stack([expert(i, x, "gate"),
                                                         expert(i, x, "up")], axis=1)
                                               for x in experts]),
        "w_experts_down": layers(lambda i: [expert(i, x, "down") for x in experts]),
    }
    if cfg.intermediate_size:
        values["shared_gate"] = layers(
            lambda i: get(f"model.layers.{i}.mlp.shared_expert_gate.weight").reshape(-1))
    return values


def _hf_mixed_mlp(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """A mixed dense/MoE model's dense MLP, gate/up [L, E, 2, F] and down [L, F, E] with
    F = `cfg.mlp_width`: each layer's (a dense layer's MLP, an MoE layer's shared expert)
    zero-padded to F, and zeros in an MoE layer without a shared expert (Qwen3-MoE)."""
    E, F = cfg.hidden_size, cfg.mlp_width
    gate_up, down = None, None
    for i in range(cfg.num_layers):
        if not (cfg.intermediate_size or i in cfg.dense_layers):
            continue
        pre = f"model.layers.{i}.mlp."
        gate, up, w_down = (get(f"{pre}{n}_proj.weight").T for n in ("gate", "up", "down"))
        if gate_up is None:
            gate_up = np.zeros((cfg.num_layers, E, 2, F), gate.dtype)
            down = np.zeros((cfg.num_layers, F, E), gate.dtype)
        gate_up[i, :, 0, :gate.shape[1]], gate_up[i, :, 1, :up.shape[1]] = gate, up
        down[i, :w_down.shape[0]] = w_down
    return {"w_gate_up": gate_up, "w_down": down}


def from_hf_names(cfg: ModelConfig, get: Callable[[str], np.ndarray],
                  norm_offset: float = 0.0) -> dict[str, np.ndarray]:
    """HF tensor names and [out, in] matrices -> our stacked parameters (see `param_decls`).
    `norm_offset` is added to every RMSNorm weight (1: Gemma's x * (1 + w) norms)."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def stack(suffix: str, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        return np.stack([fn(get(f"model.layers.{i}.{suffix}")) for i in range(cfg.num_layers)])

    def norm(suffix: str) -> np.ndarray:
        return stack(suffix, lambda w: w + norm_offset)

    # Gemma's sandwich names the MLP's input norm pre_feedforward_layernorm; Llama calls it
    # post_attention_layernorm, which in Gemma normalises the attention's output.
    mlp_norm = ("pre_feedforward_layernorm" if cfg.sandwich_norms
                else "post_attention_layernorm")
    values = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight") + norm_offset,
        "attn_norm": norm("input_layernorm.weight"),
        "mlp_norm": norm(f"{mlp_norm}.weight"),
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(E, H, D)),
        "wkv": np.stack([stack(f"self_attn.{n}_proj.weight", lambda w: w.T.reshape(E, K, D))
                         for n in "kv"], axis=2),  # [L, E, 2, Hkv, D]
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(H, D, E)),
    }
    if cfg.dense_layers:  # a mixed dense/MoE model's, zero-padded
        values |= _hf_mixed_mlp(cfg, get)
    elif cfg.intermediate_size:  # the dense MLP (Qwen2-MoE: the shared expert)
        values["w_gate_up"] = np.stack([stack(f"mlp.{n}_proj.weight", lambda w: w.T)
                                        for n in ("gate", "up")], axis=2)  # [L, E, 2, F]
        values["w_down"] = stack("mlp.down_proj.weight", lambda w: w.T)
    if cfg.is_moe:
        values |= _hf_experts(cfg, get)
    if cfg.qkv_bias:
        values["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(H, D))
        values["bkv"] = np.stack([stack(f"self_attn.{n}_proj.bias", lambda b: b.reshape(K, D))
                                  for n in "kv"], axis=1)  # [L, 2, Hkv, D]
    if cfg.qk_norm:
        values["q_norm"] = norm("self_attn.q_norm.weight")
        values["k_norm"] = norm("self_attn.k_norm.weight")
    if cfg.sandwich_norms:
        values["post_attn_norm"] = norm("post_attention_layernorm.weight")
        values["post_mlp_norm"] = norm("post_feedforward_layernorm.weight")
    if not cfg.tie_embeddings:
        values["lm_head"] = get("lm_head.weight").T
    return values


def save_orbax(path: Path, cfg: ModelConfig, values: dict, dtype: str) -> None:
    """Write converted weights as an orbax checkpoint plus the architecture as JSON."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", values, force=True)
    meta = {"config": cfg.to_dict(), "dtype": dtype}
    (path / ORBAX_MARKER).write_text(json.dumps(meta, indent=2))


def orbax_config(path: Path) -> ModelConfig:
    """The architecture saved beside an orbax checkpoint (no weights read)."""
    meta = json.loads((Path(path) / ORBAX_MARKER).read_text())
    return ModelConfig.from_dict(meta["config"])


def load_orbax(path: Path, target: dict | None = None) -> tuple[ModelConfig, dict]:
    """Restore an orbax checkpoint. `target` (name -> ShapeDtypeStruct with sharding) restores
    straight into those shardings; without it, arrays land on the default device."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    cfg = orbax_config(path)
    with ocp.StandardCheckpointer() as ckptr:
        values = ckptr.restore(path / "params", target)
    return cfg, dict(values)


def load_weights(source) -> tuple[ModelConfig, dict]:
    """Dispatch on a resolved `ModelSource`."""
    loaders = {"gguf": load_gguf, "hf": load_hf_dir, "orbax": load_orbax}
    if source.kind not in loaders:
        raise ValueError(f"model {source.name!r} has no weights (architecture-only preset); "
                         "use EngineConfig(random_weights=True) for benchmarks")
    return loaders[source.kind](source.path)


def source_config(source) -> ModelConfig:
    """A resolved `ModelSource`'s architecture from its metadata alone (the preset's table,
    the GGUF header, config.json, or the orbax checkpoint's description): no weights read."""
    if source.config is not None:
        return source.config
    if source.kind == "gguf":
        from gguf import GGUFReader

        return gguf_config(GGUFReader(str(source.path)))
    if source.kind == "hf":
        return hf_config(json.loads((source.path / "config.json").read_text()))
    if source.kind == "orbax":
        return orbax_config(source.path)
    raise ValueError(f"model {source.name!r} ({source.kind}) has no architecture to read")


def load_tokenizer(source):
    """The tokenizer that goes with a resolved `ModelSource`, or None (architecture-only)."""
    from jaxpipe.tokenizer import Tokenizer

    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    if source.kind in ("hf", "orbax") and (source.path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(source.path)
    return None
