"""`kv_cache_dtype="int8"` on 8 virtual devices: layout pairs that re-shard between prefill and
decode (the int8 pool's codes and scales moving between layouts and through the host tier)
give the single-device int8 engine's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, one_device_tokens

from jaxpipe import Engine, EngineConfig, SamplingParams

FAST = dict(dtype="float32", max_model_len=128, max_num_seqs=8, warmup=False,
            show_progress=False, kv_cache_dtype="int8")


def workload():
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, TINY.vocab_size - 1, n).tolist() for n in (5, 17, 2, 40)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4


@pytest.fixture(scope="module")
def reference(tiny_orbax):
    return one_device_tokens(tiny_orbax, workload(), **FAST)


@pytest.mark.parametrize("prefill, decode", [("pp=8", "tp=8"), ("pp=4,tp=2", "tp=4,pp=2")])
def test_int8_kv_layout_pair_matches_one_device(tiny_orbax, reference, prefill, decode):
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill=prefill,
                                 decode=decode, prefix_caching=False, **FAST))
    try:
        assert engine.runner.cache.k.dtype == np.int8
        assert engine.runner.cache.k.shape[-1] == TINY.head_dim + 2
        for _ in range(2):  # the second run re-shards decode -> prefill -> decode
            prompts, params = workload()
            got = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            assert [list(o.outputs[0].token_ids) for o in got] == reference
        assert engine.stats()["reshards"] >= 3
    finally:
        engine.close()
