"""Tiny mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral; Qwen2/3-MoE with dense layers among the MoE ones) written by transformers with every
parameter drawn, routers included: the independent reference of tests/model/test_moe_hf.py,
tests/model/test_moe_gguf.py and tests/multidevice/test_moe_layouts.py, test_moe_ep.py; and
the same weights as a GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from hf_families import VOCAB, draw_every_parameter, finish_gguf, gguf_writer

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
# name -> (config class, fields beyond SMALL): odd expert widths so a swapped axis fails.
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=23, intermediate_size=50,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=19, intermediate_size=50,
                                         shared_expert_intermediate_size=37)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2,
                                      intermediate_size=29)),
    # Dense layers among the MoE ones: 0 and 2 dense (mlp_only_layers, decoder_sparse_step),
    # their MLP (50) wider than the shared expert (37); Qwen3-MoE's layer 1 dense.
    "qwen2_moe_mixed": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=3,
                                               moe_intermediate_size=19, intermediate_size=50,
                                               shared_expert_intermediate_size=37,
                                               num_hidden_layers=4, mlp_only_layers=[0],
                                               decoder_sparse_step=2)),
    "qwen3_moe_mixed": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=23, intermediate_size=41,
                                               norm_topk_prob=True, num_hidden_layers=3,
                                               mlp_only_layers=[1])),
}
# name -> its GGUF architecture (llama.cpp writes Mixtral as `llama` with experts).
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
# HF's per-expert loop (its reference; the grouped-mm kernel needs 16-byte strides).
EAGER = dict(experts_implementation="eager")


def write(name: str, path: Path):
    """The HF model `name` of MODELS in f32 (HF's eager experts), saved (safetensors) to
    `path`."""
    cls, extra = MODELS[name]
    config = getattr(transformers, cls)(**{**SMALL, **extra}, **EAGER)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    draw_every_parameter(model, seed=sorted(MODELS).index(name))
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_gguf(model, name: str, path: Path) -> None:
    """`model` (of MODELS' `name`) in f32 as a GGUF of its GGUF_ARCH, as llama.cpp's
    convert_hf_to_gguf.py writes a mixture of experts: the expert keys, each layer's experts
    stacked under gguf's names for `mlp.experts.{gate,up,down}_proj` (gate/up [X, F, E],
    down [X, E, F]), Qwen2-MoE's shared-expert gate as a vector, and for `llama` the Q/K rows
    permuted by its `LlamaModel.permute`."""
    c, arch = model.config, GGUF_ARCH[name]
    w = gguf_writer(model, arch, path)
    w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    tensors = {}
    for key, tensor in model.state_dict().items():
        value = tensor.float().numpy()
        if key.endswith("experts.gate_up_proj"):  # [X, 2F, E], gate first
            pre, f = key.removesuffix("gate_up_proj"), value.shape[1] // 2
            tensors[pre + "gate_proj.weight"], tensors[pre + "up_proj.weight"] = (
                value[:, :f], value[:, f:])
            continue
        if key.endswith("experts.down_proj"):  # [X, E, F]
            key += ".weight"
        elif key.endswith("shared_expert_gate.weight"):  # llama.cpp's {E}, HF's [1, E]
            value = value.reshape(-1)
        elif arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
            value = _llama_cpp_permute(value, heads)
        tensors[key] = value
    finish_gguf(w, arch, c.num_hidden_layers, tensors)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from HF's rotate-half
    order (2, D/2) to llama.cpp's pairwise order (D/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)
