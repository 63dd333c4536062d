"""Mixtures of experts on cpu-8 layout pairs, re-sharding between prefill and decode: greedy
tokens (f32) equal HF transformers' on the same tiny checkpoint (`hf_moe`). Tensor
parallelism splits each expert's hidden columns (`moe_mlp`, 19 / 29 wide: padded for tp=4
and 8) and the shared expert's; pp > 1 pads the 2 layers with identity layers, whose
all-zero routers tie every expert."""

from __future__ import annotations

import pytest
from hf_families import PROMPTS, hf_greedy
from hf_moe import write

from jaxpipe import Engine, EngineConfig, SamplingParams

NEW_TOKENS = 16
PAIRS = [("pp=2,tp=4", "tp=8"), ("pp=8", "pp=2,tp=4")]


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def model(request, tmp_path_factory):
    """(checkpoint directory, HF's greedy tokens of each prompt)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = write(request.param, path)
    return path, [hf_greedy(hf, ids, NEW_TOKENS) for ids in PROMPTS]


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_moe_layout_pair_matches_hf(model, prefill, decode):
    path, want = model
    engine = Engine(EngineConfig(model=str(path), mesh="cpu-8", prefill=prefill, decode=decode,
                                 dtype="float32", max_model_len=160, max_num_seqs=4,
                                 max_num_batched_tokens=32, warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert engine.stats()["reshards"] >= 1
