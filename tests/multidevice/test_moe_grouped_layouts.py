"""The grouped MoE path (the C++ grouped kernel inside each device's `shard_map`) on a
cpu-8 layout pair, re-sharding between prefill and decode: bf16 greedy tokens equal the dense
path's on the same layouts (which tests/multidevice/test_moe_layouts.py checks against
HF). Expert width 48: 12 and 6 columns per device at tp=4 and 8, even, as the kernel needs.
Under ep each device's grouped kernel skips the other shards' choices (the out-of-range id
`decoder.local_experts` gives them)."""

from __future__ import annotations

import jax
import pytest
import transformers
from hf_families import PROMPTS, draw_every_parameter
from hf_moe import EAGER, SMALL

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.model import moe
from jaxpipe.runtime import sizing


# The last two pairs change ep: a replicated weight's shards are where both layouts put them,
# and it must still be named after the new layout's mesh for the pack program (`sharding.reshard`
# relabels it; before, `Runner.pack` failed with an IndivisibleError).
@pytest.mark.parametrize("prefill, decode", [("pp=2,tp=4", "tp=8"),
                                             ("pp=2,ep=2,tp=2", "ep=2,tp=4"),
                                             ("ep=2,tp=4", "ep=4,tp=2"),
                                             ("pp=2,ep=4", "ep=2,tp=4")])
def test_grouped_path_on_a_layout_pair_gives_the_dense_tokens(tmp_path, monkeypatch,
                                                                  prefill, decode):
    config = transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=48, intermediate_size=50,
                                         norm_topk_prob=True, **EAGER)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    draw_every_parameter(model, seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    # As off CPU: no copy kept per layout, so each switch unpacks, re-shards and packs.
    monkeypatch.setattr(sizing, "weight_copies", lambda layouts, devices: 1)
    tokens = {}
    for path in ("dense", "grouped"):
        monkeypatch.setitem(moe.EXPERTS_PATH, "cpu", path)
        jax.clear_caches()  # no step traced on the other path is reused
        engine = Engine(EngineConfig(model=str(tmp_path), mesh="cpu-8", prefill=prefill,
                                     decode=decode, dtype="bfloat16", max_model_len=160,
                                     max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                     show_progress=False))
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        outs = [o for prompts in (PROMPTS[:2], PROMPTS[2:])  # the second from decode's layout
                for o in engine.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        tokens[path] = [list(o.outputs[0].token_ids) for o in outs]
        stats = engine.stats()  # prefill -> decode -> prefill -> decode, weights moved each time
        assert stats["reshards"] >= 3 and stats["reshard_weights_seconds"] > 0
        engine.close()
    jax.clear_caches()
    assert len({t for row in tokens["dense"] for t in row}) > 4  # not one repeated token
    assert tokens["grouped"] == tokens["dense"]
