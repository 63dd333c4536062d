"""EngineConfig and ModelConfig validation: every bad value fails at construction, naming the
field (and for ModelConfig the offending numbers). No model is loaded here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxpipe import Engine, EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig, RopeScaling

FAST = dict(warmup=False, show_progress=False)

BAD_ENGINE_CONFIGS = [
    (dict(attention="triton"), "attention"),  # (kwargs, the field the message must name)
    (dict(dtype="float16"), "dtype"),
    (dict(dtype="f32"), "dtype"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(max_num_seqs=True), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"),
    (dict(kv_cache_gb=-1), "kv_cache_gb"),
    (dict(kv_cache_gb=0), "kv_cache_gb"),
    (dict(kv_cache_gb="big"), "kv_cache_gb"),
    (dict(model=""), "model"),
    (dict(model=None), "model"),
    (dict(mesh="cpu-9"), "mesh"),
    (dict(mesh="cpu-8", prefill="pp=3"), "prefill"),
    (dict(mesh="cpu-8", decode="tp=4"), "decode"),
    (dict(mesh="cpu-8", prefill="xx=8"), "prefill"),
    (dict(mesh="cpu-1", decode="tp=2"), "decode"),
    (dict(scheduler="gllm"), "scheduler"),
    (dict(throttle_iterations=0), "throttle_iterations"),
    (dict(throttle_min_prefill=-1), "throttle_min_prefill"),
    (dict(throttle_max_prefill=16, throttle_min_prefill=32), "throttle_max_prefill"),
    (dict(throttle_kv_thresh=1.0), "throttle_kv_thresh"),
    (dict(tdpipe_predictor="bert"), "tdpipe_predictor"),
    (dict(tdpipe_finish_ratio=0.0), "tdpipe_finish_ratio"),
    (dict(tdpipe_finish_ratio=True), "tdpipe_finish_ratio"),
    (dict(overlap="yes"), "overlap"),
    (dict(detok_worker=1), "detok_worker"),
    (dict(prefix_caching="on"), "prefix_caching"),
    (dict(sampler="cpu"), "sampler must be one of"),
    (dict(sampler_threads=0), "sampler_threads"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="bfloat16"), "kv_cache_dtype"),
]


@pytest.mark.parametrize("kwargs, field", BAD_ENGINE_CONFIGS,
                         ids=[repr(k) for k, _ in BAD_ENGINE_CONFIGS])
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}\b"):
        EngineConfig(**kwargs)


def test_engine_config_defaults_are_valid():
    config = EngineConfig()
    assert config.dtype in ("float32", "bfloat16")
    assert config.max_num_seqs is None or config.max_num_seqs >= 1


def test_layouts_default_to_the_mesh_preset_and_can_be_overridden():
    from jaxpipe.config.layout import Layout

    config = EngineConfig(mesh="cpu-8")
    assert (config.prefill, config.decode) == (Layout(pp=4, tp=2), Layout(tp=8))
    config = EngineConfig(mesh="cpu-8", prefill="pp=8", decode="tp=4,pp=2")
    assert (config.prefill, config.decode) == (Layout(pp=8), Layout(pp=2, tp=4))
    assert EngineConfig().prefill == EngineConfig().decode == Layout()


def test_bad_layout_message_gives_the_device_count():
    with pytest.raises(ValueError, match=r"pp=2,tp=2.*4 devices.*mesh has 8"):
        EngineConfig(mesh="cpu-8", decode="tp=2,pp=2")


def test_engine_config_is_read_only_after_validation():
    """Runtime switches are the engine's (set_overlap, set_scheduler), not config fields."""
    config = EngineConfig(model=Path("smollm2-135m"), prefill="pp=1,tp=1")
    assert config.model == "smollm2-135m" and config.prefill == Layout()  # normalised once
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.overlap = False


def test_engine_config_accepts_path_objects(tmp_path):
    config = EngineConfig(model=tmp_path, compilation_cache_dir="~/somewhere")
    assert config.model == str(tmp_path)
    assert config.compilation_cache_dir == str(Path("~/somewhere").expanduser())


def test_engine_rejects_unknown_preset_listing_presets():
    with pytest.raises(ValueError, match="no-such-model") as err:
        Engine(EngineConfig(model="no-such-model", **FAST))
    assert "smollm2-135m" in str(err.value) and "llama2-70b" in str(err.value)


def test_engine_rejects_missing_path_naming_it(tmp_path):
    missing = tmp_path / "absent" / "model.gguf"
    with pytest.raises(ValueError, match="absent"):
        Engine(EngineConfig(model=str(missing), **FAST))


# ---- ModelConfig ------------------------------------------------------------------------------

SMALL = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_layers=2, num_heads=6,
             num_kv_heads=2, head_dim=8)


def test_num_heads_must_be_a_multiple_of_num_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads \(9\).*num_kv_heads \(4\)"):
        ModelConfig(**{**SMALL, "num_heads": 9, "num_kv_heads": 4})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size",
                                   "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                   "max_position_embeddings"])
@pytest.mark.parametrize("value", [0, -3, 2.0])
def test_model_dimensions_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        ModelConfig(**{**SMALL, field: value})


def test_head_dim_must_be_even():
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(**{**SMALL, "head_dim": 7})


def test_model_config_is_frozen_and_hashable():
    a, b = ModelConfig(**SMALL), ModelConfig(**SMALL)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_layers = 3


def test_model_config_dict_round_trip():
    cfg = ModelConfig(**SMALL, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                      eos_token_ids=(2, 7), bos_token_id=1, tie_embeddings=True)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_model_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_dict({**SMALL, "num_hidden_layers": 2})


def test_group_size_and_kv_bytes():
    cfg = ModelConfig(**SMALL)
    assert cfg.group_size == 3
    assert cfg.kv_bytes_per_token(2) == 2 * 2 * 2 * 8 * 2  # K and V x layers x heads x dim x B


def test_auto_layouts_are_the_planners_choice():
    from jaxpipe.config.meshes import load_mesh
    from jaxpipe.engine.builder import _resolve_layouts
    from jaxpipe.planner import choose_layouts

    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64)
    c_p, c_d = choose_layouts(smol, load_mesh("cpu-8"), "sharegpt")
    both = _resolve_layouts(EngineConfig(mesh="cpu-8", prefill="auto", decode="auto"), smol, 8)
    assert both == {"prefill": c_p, "decode": c_d}
    one = _resolve_layouts(EngineConfig(mesh="cpu-8", prefill="auto", decode="tp=8"), smol, 8)
    assert one == {"prefill": c_p, "decode": Layout(tp=8)}


def test_matmul_names_xla_or_a_kernel_path():
    from jaxpipe.config.engine import MATMULS
    from jaxpipe.kernels import int8_matmul
    from jaxpipe.kernels.matmul import PATHS

    assert MATMULS == ("auto", "xla", *dict.fromkeys((*PATHS, *int8_matmul.PATHS)))
    with pytest.raises(ValueError, match=r"EngineConfig.matmul must be one of \('auto', 'xla', "
                                         r"'portable', 'avx2', 'avx512_bf16', 'amx', 'avx_vnni', "
                                         r"'avx512_vnni', 'amx_int8'\), got 'amx2'"):
        EngineConfig(matmul="amx2")


def test_quantization_none_is_vllms_spelling_of_none():
    assert EngineConfig(quantization=None).quantization == "none"


@pytest.mark.parametrize("value", ["int4", "INT8", "", 8])
def test_quantization_names_the_accepted_values(value):
    with pytest.raises(ValueError, match=r"EngineConfig.quantization must be one of \('none', "
                                         rf"'int8', 'fp8', 'gguf'\), got {value!r}"):
        EngineConfig(quantization=value)


def test_quantize_lm_head_must_be_a_bool():
    assert EngineConfig(quantization="int8", quantize_lm_head=False).quantize_lm_head is False
    with pytest.raises(ValueError, match="EngineConfig.quantize_lm_head must be True or False, "
                                         "got 'no'"):
        EngineConfig(quantize_lm_head="no")
