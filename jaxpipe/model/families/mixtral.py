"""Mixtral: Mistral's layer with a mixture of experts as its MLP (each expert
`intermediate_size` wide; softmax over the top-k logits, the same as renormalised top-k
probabilities). llama.cpp writes it as `llama` (or `mistral`) with experts, Q/K rows permuted
as Llama's."""

from __future__ import annotations

from functools import partial

from jaxpipe.model.families import llama, qwen2_moe
from jaxpipe.model.family import Family, expert_count, gguf_experts, per_layer

# save_pretrained's names (block_sparse_moe, w1 gate, w3 up, w2 down); in memory transformers
# holds Qwen-MoE's (`qwen2_moe.HF_EXPERTS`).
HF_NAMES = {**llama.HF_NAMES, **qwen2_moe.HF_EXPERTS, **per_layer("model.layers.{i}.", {
    "block_sparse_moe.gate.weight": "router",
    "block_sparse_moe.experts.{x}.w1.weight": "experts.{x}.gate",
    "block_sparse_moe.experts.{x}.w3.weight": "experts.{x}.up",
    "block_sparse_moe.experts.{x}.w2.weight": "experts.{x}.down"})}


def hf_fields(c: dict) -> dict:
    """The experts (`intermediate_size` wide), top-k renormalised, no shared expert."""
    return dict(num_experts=expert_count(c, 8), num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c["intermediate_size"], norm_topk_prob=True,
                intermediate_size=0)


FAMILY = Family(
    name="mixtral", hf_architectures=("MixtralForCausalLM",), hf_model_types=("mixtral",),
    gguf_architectures=("llama", "mistral"), hf_names=HF_NAMES,
    gguf_names=llama.GGUF_NAMES | qwen2_moe.GGUF_EXPERTS, has_experts=True,
    hf_defaults={"num_experts_per_tok": 2}, hf_fields=hf_fields,
    gguf_fields=partial(gguf_experts, norm_topk=True), gguf_value=llama.unpermute_qk)
