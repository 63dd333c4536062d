"""quantization="int8" on 8 virtual devices (the tiny prime-sized model, restored from orbax
straight into a layout and quantized there): a pipeline layout runs the single-device int8
arithmetic exactly (each layer's weights whole on a stage; the padded layers' zero codes add
nothing), so its greedy tokens equal the single-device int8 engine's. (Layout pairs with
tp, re-sharding codes and scales, are not checked here yet: run after other int8 engines in
one process, a tp engine's scoring finds a bf16 parameter deleted; see the branch's notes.)"""

from __future__ import annotations

import pytest
from conftest import greedy_workload, one_device_tokens, one_layout_engine
from prefix_workload import tokens

from jaxpipe import Engine, EngineConfig

INT8 = dict(quantization="int8", dtype="bfloat16", max_model_len=96, max_num_seqs=4,
            max_num_batched_tokens=32, warmup=False, show_progress=False)


@pytest.fixture(scope="module")
def workload():
    return greedy_workload(seed=5, count=4, prompt_tokens=(3, 40), new_tokens=(8, 16))


@pytest.fixture(scope="module")
def one_device(tiny_orbax, workload):
    return one_device_tokens(tiny_orbax, workload, **INT8)


def test_a_pipeline_layout_gives_the_single_device_int8_tokens(tiny_orbax, workload,
                                                               one_device):
    engine = one_layout_engine(tiny_orbax, "pp=8", prefix_caching=False, **INT8)
    try:
        prompts, params = workload
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) \
            == one_device
    finally:
        engine.close()


def test_a_kept_layouts_weights_survive_the_switches(tiny_orbax, workload):
    """With the int8 kernel's portable path forced, both layouts of a pair pack their
    weights, so every re-shard goes through a donating pack; the weights kept for the layout
    left (its replicated norms are the same arrays in both layouts) must come out of it
    whole: a second round of switches, onto the kept weights, gives the first round's
    tokens."""
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill="pp=8",
                                 decode="tp=8", prefix_caching=False, matmul="portable",
                                 **INT8))
    try:
        prompts, params = workload
        first = tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))
        second = tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))
        assert engine.runner.keep_weights and engine.stats()["reshards"] >= 3
    finally:
        engine.close()
    assert second == first
