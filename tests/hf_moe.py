"""Tiny mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral) written by transformers with every parameter drawn, routers included: the independent
reference of tests/model/test_moe_hf.py and tests/multidevice/test_moe_layouts.py."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from hf_families import VOCAB, draw_every_parameter

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
}
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
