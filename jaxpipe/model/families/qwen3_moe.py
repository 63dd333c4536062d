"""Qwen3-MoE: Qwen3's layer (q/k norms) with Qwen2-MoE's experts and dense-layer rule, no
shared expert. llama.cpp renormalises its top-k."""

from __future__ import annotations

from functools import partial

from jaxpipe.model.families import qwen2_moe, qwen3
from jaxpipe.model.family import Family, gguf_experts

FAMILY = Family(
    name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",), hf_names=qwen3.HF_NAMES | qwen2_moe.HF_EXPERTS,
    gguf_names=qwen3.GGUF_NAMES | qwen2_moe.GGUF_EXPERTS, features={"qk_norm": True},
    has_experts=True,
    hf_defaults={"num_experts_per_tok": 8, "norm_topk_prob": False,
                 "decoder_sparse_step": 1},
    hf_window=partial(qwen2_moe.no_window, "qwen3_moe"), hf_fields=partial(qwen2_moe.experts, 128),
    gguf_fields=partial(gguf_experts, norm_topk=True))
