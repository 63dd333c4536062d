"""Llama (Llama 2/3, CodeLlama, SmolLM2): the base family, the others' names and rules start
from its. RoPE scaling of every HF type (`model/rope_config.py`). llama.cpp stores its Q/K
rows interleaved (pairwise RoPE), undone at load."""

from __future__ import annotations

from jaxpipe.model.family import Family, per_layer

HF_NAMES = {
    "model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
    **per_layer("model.layers.{i}.", {
        "input_layernorm.weight": "attn_norm",
        "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
        "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
        "post_attention_layernorm.weight": "mlp_norm",  # the MLP's input norm
        "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
        "mlp.down_proj.weight": "down"}),
}
GGUF_NAMES = {
    "token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head",
    **per_layer("blk.{i}.", {
        "attn_norm.weight": "attn_norm",
        "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
        "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm",
        "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
        # llama.cpp's optional q/k/v biases (a file that has them turns qkv_bias on)
        "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias"}),
}


def unpermute_qk(cfg, name: str, w):
    """Undo llama.cpp's interleaving of Q/K rows (its convert_hf_to_gguf.py turns HF's
    rotate-half RoPE into pairwise RoPE for the Llama architectures).

    w [heads * D, E]: within each head, llama.cpp stores rows as (D/2, 2); HF as (2, D/2).
    """
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}.get(name.rpartition(".")[2])
    if heads is None:
        return w
    per_head = w.shape[0] // heads
    return w.reshape(heads, per_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


FAMILY = Family(
    name="llama", hf_architectures=("LlamaForCausalLM",), hf_model_types=("llama",),
    gguf_architectures=("llama",), hf_names=HF_NAMES, gguf_names=GGUF_NAMES,
    gguf_value=unpermute_qk)
