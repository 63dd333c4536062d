"""quantization="int8" on 8 virtual devices (the tiny prime-sized model, restored from orbax
straight into a layout and quantized there): a pipeline layout runs the single-device int8
arithmetic exactly (each layer's weights whole on a stage; the padded layers' zero codes add
nothing), so its greedy tokens equal the single-device int8 engine's; layout pairs with tp,
re-sharding codes and scales between prefill and decode, quantize each device's share of a
row-split matmul's activations per row on their own (another rounding of the same values),
so they are held to the bf16-vs-int8 bar of tests/engine/test_quantization.py against the
single-device int8 engine, teacher-forced: >= 90% of top-1 tokens agree."""

from __future__ import annotations

import pytest
from conftest import PAIRS, greedy_workload, one_device_tokens, one_layout_engine
from prefix_workload import tokens
from quant_agreement import agreement, scores

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


@pytest.mark.parametrize("prefill, decode", PAIRS[:2])
def test_tp_layout_pairs_agree_with_one_device(tiny_orbax, workload, one_device, prefill,
                                               decode):
    seqs = [p + t for p, t in zip(workload[0], one_device, strict=True)]
    reference = Engine(EngineConfig(model=str(tiny_orbax), prefix_caching=False, **INT8))
    try:
        want = scores(reference, seqs)
    finally:
        reference.close()
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill=prefill,
                                 decode=decode, prefix_caching=False, **INT8))
    try:
        prompts, params = workload
        greedy = tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))
        same, _ = agreement(want, scores(engine, seqs), seqs)
        assert engine.stats()["reshards"] >= 1
    finally:
        engine.close()
    assert same >= 0.9 and len(greedy) == len(one_device)
