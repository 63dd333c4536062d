"""The random Llama checkpoint writer: safetensors that the safetensors library and jaxpipe's
HF loader read back, with the seeded values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxpipe.model.hf_dir import load_hf_dir
from jaxpipe_bench.checkpoint import bf16_bits, hf_config, tensor_shapes, write_safetensors

TINY = {"hidden_size": 12, "intermediate_size": 20, "num_layers": 3, "num_heads": 3,
        "num_kv_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 64, "tie_embeddings": False}


def test_bf16_bits_round_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 0.0], np.float32)
    np.testing.assert_array_equal(bf16_bits(x), [0x3F80, 0x3F80, 0x3F82, 0xC020, 0])


def test_written_checkpoint_loads_with_the_seeded_values(tmp_path):
    from safetensors import safe_open

    vocab = 17
    shapes = tensor_shapes(TINY, vocab)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TINY, vocab, 1, 2)))
    write_safetensors(tmp_path / "model.safetensors", shapes, seed=5)
    rng = np.random.default_rng(5)
    with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as f:
        assert list(f.keys()) == sorted(shapes)
        for name, shape in shapes.items():  # drawn in file order
            want = np.ones(shape, np.float32) if name.endswith("norm.weight") else (
                0.02 * rng.standard_normal(shape, dtype=np.float32))
            got = np.asarray(f.get_tensor(name), np.float32)
            assert got.shape == shape
            np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
    cfg, values = load_hf_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (12, 3, 1, 17)
    assert values["wq"].shape == (3, 12, 3, 4) and values["lm_head"].shape == (12, 17)
    assert (values["attn_norm"] == 1).all() and 0.01 < values["w_down"].std() < 0.03


def test_qwen2_checkpoint_is_what_transformers_and_jaxpipe_read_as_qwen2(tmp_path):
    """--family qwen2: the q/k/v biases are in the file and transformers builds the same
    model from it as jaxpipe's loader reads (the biases drawn, not zero)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    arch = {**TINY, "family": "qwen2", "tie_embeddings": True}
    vocab = 17
    (tmp_path / "config.json").write_text(json.dumps(hf_config(arch, vocab, 1, 2)))
    write_safetensors(tmp_path / "model.safetensors", tensor_shapes(arch, vocab), seed=6)
    cfg, values = load_hf_dir(tmp_path)
    assert cfg.qkv_bias and cfg.tie_embeddings and "lm_head" not in values
    assert 0.01 < values["bq"].std() < 0.03
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    bias = hf.model.layers[1].self_attn.k_proj.bias.detach().numpy()
    np.testing.assert_array_equal(values["bkv"][1, 0].reshape(-1), bias)


def test_qwen3_moe_checkpoint_is_what_transformers_and_jaxpipe_read_as_qwen3_moe(tmp_path):
    """--family qwen3_moe: the router, every expert and the q/k norms are in the file, and
    transformers builds the same experts from it as jaxpipe's loader reads (drawn, not zero)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    arch = {**TINY, "family": "qwen3_moe", "intermediate_size": 0, "qk_norm": True,
            "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 7,
            "norm_topk_prob": True}
    vocab = 17
    (tmp_path / "config.json").write_text(json.dumps(hf_config(arch, vocab, 1, 2)))
    write_safetensors(tmp_path / "model.safetensors", tensor_shapes(arch, vocab), seed=7)
    cfg, values = load_hf_dir(tmp_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.intermediate_size, cfg.qk_norm) == (5, 2, 7, True, 0, True)
    assert 0.01 < values["w_experts_down"].std() < 0.03 and 0.01 < values["router"].std() < 0.03
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    mlp = hf.model.layers[2].mlp
    np.testing.assert_array_equal(values["router"][2], mlp.gate.weight.detach().numpy().T)
    down = mlp.experts.down_proj.detach().numpy()  # [X, E, F]
    np.testing.assert_array_equal(values["w_experts_down"][2], down.transpose(0, 2, 1))
    gate_up = mlp.experts.gate_up_proj.detach().numpy()  # [X, 2F, E], gate first
    np.testing.assert_array_equal(values["w_experts_gate_up"][2, :, :, 1],
                                  gate_up[:, 7:].transpose(0, 2, 1))
