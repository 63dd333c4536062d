"""GGUF files of the Qwen, Gemma and Phi-3 families: written with the `gguf` package from the
weights of a tiny transformers checkpoint, under llama.cpp's keys and tensor names.
transformers' own GGUF reader, the independent reference, must rebuild the same model from the
file (so the file is what llama.cpp's conventions say); then jaxpipe's GGUF loader must give
exactly the weights and architecture its HF-directory loader gives, and HF's logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from hf_families import NEW_TOKENS, PROMPTS, assert_forward_matches_hf, hf_greedy, write, write_gguf  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.model import gguf_file, hf_dir  # noqa: E402

# What transformers' GGUF reader assumes where a file has no key, so that it can be the
# reference: head_dim hidden / heads (qwen2, phi3) or Qwen3Config's 128; Gemma's
# query_pre_attn_scalar 256 (llama.cpp: head_dim), Gemma 2's soft-caps 50 / 30, Gemma 3's
# every sixth layer global and its RoPE bases; Phi-3 rotating whole heads, no window.
GEMMA = dict(head_dim=256, query_pre_attn_scalar=256)
SHAPES = {
    "qwen2": dict(hidden_size=72, head_dim=12), "qwen3": dict(hidden_size=72, head_dim=128),
    "gemma2": dict(GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(GEMMA, num_hidden_layers=6, layer_types=None, rope_parameters=None),
    "phi3": dict(partial_rotary_factor=1.0, sliding_window=None),
    # transformers' reader ignores LongRoPE's factor tensors: this one is checked against
    # the HF directory only.
    "phi3_longrope": {},
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def gguf_pair(request, tmp_path_factory):
    """(HF model, its HF directory, the GGUF file of the same weights)."""
    path = tmp_path_factory.mktemp(request.param)
    model = write(request.param, path, **SHAPES[request.param])
    arch = request.param.split("_")[0]
    if request.param == "gemma3":  # the default layer types, as the GGUF reader builds them
        assert model.config.layer_types[4:] == ["sliding_attention", "full_attention"]
    write_gguf(model, arch, path / "model.gguf")
    return model, path, path / "model.gguf"


def test_transformers_reads_the_file_as_the_same_model(gguf_pair):
    model, path, file = gguf_pair
    if model.config.rope_parameters.get("rope_type") == "longrope":
        pytest.skip("transformers' GGUF reader ignores LongRoPE's factor tensors")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(path), gguf_file=file.name,
                                                              dtype=torch.float32)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        np.testing.assert_array_equal(again(ids).logits.numpy(), model(ids).logits.numpy())


def test_gguf_loads_the_weights_and_architecture_of_the_hf_directory(gguf_pair):
    _, path, file = gguf_pair
    hf_cfg, hf_values = hf_dir.load_hf_dir(path)
    cfg, values = gguf_file.load_gguf(file)
    # The file has no tokenizer and the HF directory no special tokens; GGUF stores the norm
    # epsilon and LongRoPE's factors as float32: compare the rest exactly.
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=hf_cfg.rms_norm_eps)
    assert dataclasses.replace(cfg, **same) == dataclasses.replace(
        hf_cfg, **same, rope_scaling=_float32_factors(hf_cfg.rope_scaling))
    assert set(values) == set(hf_values)
    for name, value in values.items():
        np.testing.assert_array_equal(value, hf_values[name], err_msg=name)


def test_engine_on_the_gguf_gives_hf_greedy_tokens(gguf_pair):
    model, _, file = gguf_pair
    engine = Engine(EngineConfig(model=str(file), dtype="float32", max_model_len=160,
                                 max_num_seqs=4, warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, i) for i in PROMPTS]


def _float32_factors(scaling):
    if scaling is None:
        return None
    return dataclasses.replace(scaling, **{
        name: tuple(float(x) for x in np.float32(getattr(scaling, name)))
        for name in ("short_factor", "long_factor") if getattr(scaling, name)})


def test_gguf_logits_match_hf(gguf_pair):
    """Within 1e-4 + 1e-5 x |logit|: on the 2-core AMD EPYC with avx512_bf16, XLA's f32
    sums in another order put 2 of gemma3's 15,060 logits (3.35 and -6.11) 1.2e-4 from
    HF's (3.6e-5 relative), where the avx2 machines stayed within 1e-4."""
    model, _, file = gguf_pair
    assert_forward_matches_hf(model, *gguf_file.load_gguf(file), rtol=1e-5)
