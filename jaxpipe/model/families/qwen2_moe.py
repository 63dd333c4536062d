"""Qwen2-MoE: Qwen2's layer (q/k/v biases) with a mixture of experts as its MLP
(`model/moe.py`: a softmax router, each token's `num_experts_per_tok` most probable experts,
`norm_topk_prob`) plus a shared expert, a dense MLP gated by sigmoid(x . shared_expert_gate)
that jaxpipe runs as the dense MLP. Dense layers among the MoE ones by HF's rule
(`mlp_only_layers`, `decoder_sparse_step`). No sliding windows. llama.cpp does not renormalise
its top-k."""

from __future__ import annotations

from functools import partial

from jaxpipe.model.families import llama, qwen2
from jaxpipe.model.family import Family, expert_count, gguf_experts, per_layer

# The experts as save_pretrained writes them (one matrix each) and as transformers holds
# them in memory (fused: gate_up [X, 2F', E], down [X, E, F']).
HF_EXPERTS = per_layer("model.layers.{i}.", {
    "mlp.gate.weight": "router",
    "mlp.experts.{x}.gate_proj.weight": "experts.{x}.gate",
    "mlp.experts.{x}.up_proj.weight": "experts.{x}.up",
    "mlp.experts.{x}.down_proj.weight": "experts.{x}.down",
    "mlp.experts.gate_up_proj": "experts.gate_up", "mlp.experts.down_proj": "experts.down"})
# llama.cpp's router and experts, stacked: gate/up [X, F', E], down [X, E, F'].
GGUF_EXPERTS = per_layer("blk.{i}.", {
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate",
    "ffn_up_exps.weight": "experts.up", "ffn_down_exps.weight": "experts.down"})
HF_NAMES = {**qwen2.HF_NAMES, **HF_EXPERTS, **per_layer("model.layers.{i}.", {
    "mlp.shared_expert.gate_proj.weight": "gate", "mlp.shared_expert.up_proj.weight": "up",
    "mlp.shared_expert.down_proj.weight": "down",
    "mlp.shared_expert_gate.weight": "shared_gate"})}
GGUF_NAMES = {**llama.GGUF_NAMES, **GGUF_EXPERTS, **per_layer("blk.{i}.", {
    "ffn_gate_shexp.weight": "gate", "ffn_up_shexp.weight": "up",
    "ffn_down_shexp.weight": "down", "ffn_gate_inp_shexp.weight": "shared_gate"})}
HF_DEFAULTS = {"num_experts_per_tok": 4, "norm_topk_prob": False,
               "decoder_sparse_step": 1, "qkv_bias": True,
               "shared_expert_intermediate_size": 5632}


def no_window(name: str, c: dict) -> tuple[None, tuple[()]]:
    """Qwen2/3-MoE run full attention on every layer: a window is refused."""
    if c.get("use_sliding_window"):
        raise ValueError(f"config.json use_sliding_window=true is not supported for {name}; "
                         "supported: full attention on every layer")
    return None, ()


def experts(default_count: int, c: dict) -> dict:
    """Qwen2/3-MoE's experts (`default_count` of them where config.json does not say), and
    the dense layers among the MoE ones by HF's rule (MoE
    unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0), whose MLP is
    intermediate_size wide."""
    layers = c["num_hidden_layers"]
    step, only = c["decoder_sparse_step"], c.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step!r} must be a positive integer")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:
        raise ValueError(f"config.json decoder_sparse_step={step}, mlp_only_layers={only} "
                         "leave no MoE layer; a dense model is supported as its dense family")
    return dict(num_experts=expert_count(c, default_count),
                num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c["moe_intermediate_size"],
                norm_topk_prob=bool(c["norm_topk_prob"]), intermediate_size=0,
                dense_layers=dense, dense_intermediate_size=c["intermediate_size"] if dense else 0)


def hf_fields(c: dict) -> dict:
    """The experts, the shared expert's width (the dense MLP's), and the q/k/v biases
    (Qwen2MoeConfig's qkv_bias)."""
    return experts(60, c) | dict(intermediate_size=c["shared_expert_intermediate_size"] or 0,
                             qkv_bias=bool(c["qkv_bias"]))


FAMILY = Family(
    name="qwen2_moe", hf_architectures=("Qwen2MoeForCausalLM",), hf_model_types=("qwen2_moe",),
    gguf_architectures=("qwen2moe",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES,
    has_experts=True, hf_defaults=HF_DEFAULTS, hf_window=partial(no_window, "qwen2_moe"),
    hf_fields=hf_fields, gguf_fields=partial(gguf_experts, norm_topk=False))
