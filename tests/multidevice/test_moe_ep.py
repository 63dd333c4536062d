"""Expert parallelism on cpu-8, checked against HF transformers on tiny random-weight
checkpoints (`hf_moe`): Qwen3-MoE's 8 experts split evenly over ep=2 and 4, Mixtral's 5
padded with zero experts to 8 (ep=8 holds one real expert on five devices, none on three).
Prompt logits of the ragged step equal HF's within 1e-4; greedy tokens (f32) equal HF's
through an engine whose prefill and decode layouts differ in ep, re-sharding in between
(pairs with pp, whose padded identity layers route to zero experts), for models whose
layers are all MoE and for ones with dense layers among the MoE ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_families import PROMPTS, checkpoint_fixture, hf_greedy
from hf_moe import write

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.config.layout import Layout
from jaxpipe.model import hf_dir, moe
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.runner import Runner
from jaxpipe.runtime.step_inputs import Piece

NEW_TOKENS = 12
LOGITS_ATOL = 1e-4
# (model, prefill, decode): each pair changes the ep degree mid-generation.
# The mixed dense/MoE models too: Qwen2-MoE's 4 layers two per stage (dense, MoE);
# Qwen3-MoE's 3 padded to 4 for pp=2, its identity layer on the dense path.
PAIRS = [("qwen3_moe", "ep=4,tp=2", "ep=2,tp=4"), ("mixtral", "ep=8", "pp=2,ep=2,tp=2"),
         ("qwen2_moe_mixed", "pp=2,ep=2,tp=2", "ep=4,tp=2"),
         ("qwen3_moe_mixed", "ep=4,tp=2", "pp=2,ep=2,tp=2")]


checkpoints = checkpoint_fixture(write)  # name -> (name, HF model in f32, directory)


@pytest.mark.parametrize("name, layout, path", [
    ("mixtral", "ep=8", "dense"), ("qwen3_moe", "ep=2,tp=4", "dense"),
    ("qwen3_moe", "ep=4,tp=2", "ragged")])
def test_prompt_logits_match_hf(checkpoints, monkeypatch, name, layout, path):
    """Every prompt in one ragged step on `layout`: its last token's logits are HF's, on the
    CPU's dense path and on the sorted-segment one GPU and TPU take."""
    monkeypatch.setitem(moe.EXPERTS_PATH, "cpu", path)
    jax.clear_caches()  # no step traced on the other path is reused
    _, model, path = checkpoints(name)
    cfg, values = hf_dir.load_hf_dir(path)
    parsed = Layout.parse(layout)
    runner = Runner(cfg, values, Buckets.for_engine(8, 256, 256), 8, 256, jnp.float32,
                    {"prefill": parsed, "decode": parsed}, jax.devices()[:8], 32)
    pieces = [Piece(ids, 0, list(range(8 * i, 8 * i + 8))) for i, ids in enumerate(PROMPTS)]
    tokens = runner.buckets.tokens(sum(len(p.tokens) for p in pieces))
    inputs = step_inputs.build(pieces, tokens, runner.buckets.rows(tokens), runner.max_blocks)
    got = np.asarray(runner.logits(inputs, len(PROMPTS)))
    experts = runner.params["w_experts_gate_up"]  # [L, X', E, 2, F']: X' = 8 for both models
    assert experts.sharding.shard_shape(experts.shape)[1] == 8 // parsed.ep
    for i, ids in enumerate(PROMPTS):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        np.testing.assert_allclose(got[i], want, rtol=0, atol=LOGITS_ATOL, err_msg=f"prompt {i}")


@pytest.mark.parametrize("name, prefill, decode", PAIRS)
def test_ep_layout_pair_matches_hf(checkpoints, name, prefill, decode):
    _, model, path = checkpoints(name)
    engine = Engine(EngineConfig(model=str(path), mesh="cpu-8", prefill=prefill, decode=decode,
                                 dtype="float32", max_model_len=160, max_num_seqs=4,
                                 max_num_batched_tokens=32, warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert engine.stats()["reshards"] >= 1


@pytest.mark.parametrize("name", ["qwen2_moe_mixed", "mixtral"])
def test_ep2_pp4_flowing_matches_hf(checkpoints, name):
    """Both phases on pp=4,ep=2 under throttle: micro-batches flow through four stages, each
    exchanging its tokens between two expert groups, and give HF's greedy tokens."""
    _, model, path = checkpoints(name)
    engine = Engine(EngineConfig(model=str(path), mesh="cpu-8", prefill="pp=4,ep=2",
                                 decode="pp=4,ep=2", scheduler="throttle", dtype="float32",
                                 max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32,
                                 warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    counts = engine.runner.ticks.counts()
    assert counts["busy_slots"] > counts["ticks"]  # micro-batches in flight together
    engine.close()
