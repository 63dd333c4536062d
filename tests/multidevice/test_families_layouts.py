"""The families whose layers have parameters or attention Llama's has not (q/k/v biases, q/k
norms, Gemma's four norms, sliding windows, soft-caps, per-layer RoPE, Phi's fused weights
and partial LongRoPE) on cpu-8 layout
pairs, re-sharding between prefill and decode: greedy tokens (f32) equal HF transformers' on
the same tiny checkpoint (`hf_families`). One pair has pp > 1 over 3 layers (padded), both
have a tp degree (4, 8) that divides neither the 6 query heads nor the 2 kv heads."""

from __future__ import annotations

import pytest
from hf_families import NEW_TOKENS, PROMPTS, hf_greedy, write

from jaxpipe import Engine, EngineConfig, SamplingParams

FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3_longrope")
PAIRS = [("pp=2,tp=4", "tp=8"), ("pp=8", "pp=2,tp=4")]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(checkpoint directory, HF's greedy tokens of each prompt)."""
    path = tmp_path_factory.mktemp(request.param)
    model = write(request.param, path)
    return path, [hf_greedy(model, ids) for ids in PROMPTS]


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_family_layout_pair_matches_hf(family, prefill, decode):
    path, want = family
    engine = Engine(EngineConfig(model=str(path), mesh="cpu-8", prefill=prefill, decode=decode,
                                 dtype="float32", max_model_len=160, max_num_seqs=4,
                                 max_num_batched_tokens=32, warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert engine.stats()["reshards"] >= 1
