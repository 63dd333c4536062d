"""Model presets (`models/*.toml`): each resolves; the architecture-only ones match the public HF
`config.json` of the model they are named after, and their parameter counts match the published
totals."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxpipe import Engine, EngineConfig
from jaxpipe.model.hf_dir import hf_config
from jaxpipe.model.presets import preset_names, resolve_model

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
PRESET_FILES = sorted(MODELS_DIR.glob("*.toml"))

# The public config.json of each model (independent reference, copied from the HF hub pages).
_LLAMA2 = dict(vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, hidden_act="silu", model_type="llama")
PUBLIC_CONFIGS = {
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=4096, rope_theta=10000.0),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40,
                       max_position_embeddings=4096, rope_theta=10000.0),
    "codellama-34b": dict(_LLAMA2, hidden_size=8192, intermediate_size=22016,
                          num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                          max_position_embeddings=16384, rope_theta=1000000.0),
    # The other families (model/families/).
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                       bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=4096,
                       intermediate_size=14336, max_position_embeddings=32768,
                       num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
                       rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False, vocab_size=32000),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                     attention_bias=False, bos_token_id=151643, eos_token_id=151645,
                     head_dim=128, hidden_act="silu", hidden_size=4096, intermediate_size=12288,
                     max_position_embeddings=40960, max_window_layers=36,
                     num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8,
                     rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
                     sliding_window=None, tie_word_embeddings=False, use_sliding_window=False,
                     vocab_size=151936),
    "gemma2-9b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                      attn_logit_softcapping=50.0, bos_token_id=2, eos_token_id=1,
                      final_logit_softcapping=30.0, head_dim=256, hidden_act="gelu_pytorch_tanh",
                      hidden_activation="gelu_pytorch_tanh", hidden_size=3584,
                      intermediate_size=14336, max_position_embeddings=8192,
                      num_attention_heads=16, num_hidden_layers=42, num_key_value_heads=8,
                      query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_theta=10000.0,
                      sliding_window=4096, vocab_size=256000),
    "gemma3-1b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                      attn_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106],
                      final_logit_softcapping=None, head_dim=256,
                      hidden_activation="gelu_pytorch_tanh", hidden_size=1152,
                      intermediate_size=6912, max_position_embeddings=32768,
                      num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
                      query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_local_base_freq=10000,
                      rope_scaling=None, rope_theta=1000000, sliding_window=512,
                      sliding_window_pattern=6, vocab_size=262144),
    "phi3-mini": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", bos_token_id=1,
                      eos_token_id=32000, hidden_act="silu", hidden_size=3072,
                      intermediate_size=8192, max_position_embeddings=4096,
                      num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
                      original_max_position_embeddings=4096, rms_norm_eps=1e-05,
                      rope_scaling=None, rope_theta=10000.0, sliding_window=2047,
                      tie_word_embeddings=False, vocab_size=32064),
    # Mixtures of experts (model/moe.py).
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          attention_bias=False, bos_token_id=151643, decoder_sparse_step=1,
                          eos_token_id=151645, head_dim=128, hidden_act="silu",
                          hidden_size=2048, intermediate_size=6144,
                          max_position_embeddings=40960, max_window_layers=48,
                          mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True,
                          num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06,
                          rope_scaling=None, rope_theta=1000000.0, sliding_window=None,
                          tie_word_embeddings=False, use_sliding_window=False,
                          vocab_size=151936),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                         bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=4096,
                         intermediate_size=14336, max_position_embeddings=32768,
                         num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32,
                         num_key_value_heads=8, num_local_experts=8, rms_norm_eps=1e-05,
                         rope_theta=1e6, sliding_window=None, tie_word_embeddings=False,
                         vocab_size=32000),
}
# Parameter totals as published (the sizes of the released safetensors checkpoints; Gemma 3
# 1B's is its text-only checkpoint's).
PUBLIC_PARAM_COUNTS = {
    "llama2-70b": 68_976_648_192,
    "llama2-13b": 13_015_864_320,
    "codellama-34b": 33_743_970_304,
    "mistral-7b": 7_241_732_096,
    "qwen3-8b": 8_190_735_360,
    "gemma2-9b": 9_241_705_984,
    "gemma3-1b": 999_885_952,
    "phi3-mini": 3_821_079_552,
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
}


def test_preset_names_are_the_toml_files():
    assert preset_names() == [p.stem for p in PRESET_FILES]
    assert {"smollm2-135m", *PUBLIC_CONFIGS} <= set(preset_names())


@pytest.mark.parametrize("name", [p.stem for p in PRESET_FILES])
def test_every_preset_resolves(name):
    source = resolve_model(name)
    assert source.name == name
    if source.kind == "architecture":
        assert source.config is not None and source.path is None
    else:
        assert source.kind in ("gguf", "hf", "orbax") and source.path.exists()


def test_smollm2_preset_points_at_the_wheel_gguf(gguf_path):
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.path == gguf_path


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_architecture_preset_matches_public_config(name):
    source = resolve_model(name)
    assert source.kind == "architecture"
    assert source.config == hf_config(PUBLIC_CONFIGS[name])


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_architecture_preset_parameter_count(name):
    assert resolve_model(name).config.num_params() == PUBLIC_PARAM_COUNTS[name]


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="llama2-7000b") as err:
        resolve_model("llama2-7000b")
    for name in preset_names():
        assert name in str(err.value)


def test_architecture_preset_without_random_weights_is_refused():
    config = EngineConfig(model="llama2-70b", warmup=False, show_progress=False)
    with pytest.raises(ValueError, match="random_weights"):
        Engine(config)
