"""quantization="int8" on 8 virtual devices (the tiny prime-sized model, restored from orbax
straight into a layout and quantized there): a pipeline layout runs the single-device int8
arithmetic exactly (each layer's weights whole on a stage; the padded layers' zero codes add
nothing), so its greedy tokens equal the single-device int8 engine's. A tied model's
quantized head is its embedding too (`Quantization.tied`): on pp=8 its tokens are the
single device's; under tp (tp=2, pp=2,tp=4) each device reads the tokens of its vocab shard
from its own panels and the shards' rows are summed, exactly the natural head's rows
(`pipeline.embedding_rows`).
Layout pairs with tp quantize each device's share of a row-split matmul's activations per
row on their own (another rounding of the same values), so they are held to the
bf16-vs-int8 bar of tests/engine/test_quantization.py against the single-device int8
engine, teacher-forced: >= 90% of top-1 tokens agree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PAIRS, TINY, greedy_workload, one_device_tokens, one_layout_engine
from prefix_workload import tokens
from quant_agreement import agreement, scores

from jaxpipe import Engine, EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.model import decoder, orbax_dir, quantized
from jaxpipe.model.quantized import Quantization
from jaxpipe.runtime import pipeline, sharding

INT8 = dict(quantization="int8", dtype="bfloat16", max_model_len=96, max_num_seqs=4,
            max_num_batched_tokens=32, warmup=False, show_progress=False)
TIED = dataclasses.replace(TINY, tie_embeddings=True)


@pytest.fixture(scope="module")
def workload():
    return greedy_workload(seed=5, count=4, prompt_tokens=(3, 40), new_tokens=(8, 16))


@pytest.fixture(scope="module")
def one_device(tiny_orbax, workload):
    return one_device_tokens(tiny_orbax, workload, **INT8)


@pytest.fixture(scope="module")
def tied_orbax(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "ckpt"
    orbax_dir.save_orbax(path, TIED, decoder.numpy_random_values(TIED, seed=4), "float32")
    return path


def test_a_pipeline_layout_gives_the_single_device_int8_tokens(tiny_orbax, workload,
                                                               one_device):
    engine = one_layout_engine(tiny_orbax, "pp=8", prefix_caching=False, **INT8)
    try:
        prompts, params = workload
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) \
            == one_device
    finally:
        engine.close()


@pytest.mark.parametrize("matmul", ["xla", "portable"])
def test_a_tied_int8_head_read_as_the_embedding_on_pp8_gives_one_devices_tokens(
        tied_orbax, workload, matmul):
    """The tied head quantized (no bf16 embedding kept) on pp=8 (the first stage's
    lookup reads the head every stage holds: it has no layers axis), the head in natural order
    (XLA's dot) or in int8 panel order (the kernel's portable path forced): the single
    device's tokens."""
    want = one_device_tokens(tied_orbax, workload, matmul="xla", **INT8)
    engine = one_layout_engine(tied_orbax, "pp=8", prefix_caching=False, matmul=matmul,
                               **INT8)
    try:
        assert "embed" not in engine.runner.params
        prompts, params = workload
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) \
            == want
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["tp=2", "pp=2,tp=4"])
def test_the_packed_heads_rows_under_tp_are_the_natural_heads(layout):
    """Each device's vocab shard of a tied int8 head in panel order, its tokens read in
    place and summed over tp: exactly the rows of the whole natural head."""
    lo = Layout.parse(layout)
    quant = Quantization("int8")
    padding = sharding.padding_for(TIED, [lo])
    mesh = sharding.make_mesh(lo, jax.devices())
    v = padding.size("vocab", TIED.vocab_size)
    table = np.random.default_rng(7).standard_normal((TIED.hidden_size, v)).astype(np.float32)
    head = quantized.quantize(jnp.asarray(table), "lm_head", ("embed", "vocab"), "int8")
    place = sharding.param_shardings(TIED, padding, lo, mesh, quant)["lm_head"]
    pack = pipeline.pack_program(TIED, lo, mesh, (), True, quant)  # the head's panel order
    packed = pack({"lm_head": jax.device_put(head, place)})["lm_head"]
    assert not np.array_equal(np.asarray(packed.codes), np.asarray(head.codes))
    ids = jnp.asarray([0, v - 1, v // 2, 1, TIED.vocab_size - 1, 5, v // 2 + 1], jnp.int32)
    got = jax.jit(pipeline.embedding_rows(TIED, lo, mesh, quant))(packed, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(head.rows(ids)))


@pytest.mark.parametrize("prefill, decode", PAIRS[:2])
def test_tp_layout_pairs_agree_with_one_device(tiny_orbax, workload, one_device, prefill,
                                               decode):
    """Teacher-forced prompt scores after a greedy run (a switch to decode and back): >= 90%
    of top-1 tokens agree with the single-device int8 engine. (Where the timings packed only
    the tp layout's weights, the pp=8 final norm kept for the switch back was deleted by
    the tp pack's donation; tests/multidevice/test_sharding.py forces that case.)"""
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


def test_a_tied_int8_engine_on_pp2_tp4_agrees_with_one_device(tied_orbax, workload):
    """The tied head read as the embedding under pp=2,tp=4 (vocab-sharded head, panel order):
    teacher-forced, >= 90% of top-1 tokens agree with the single-device int8 engine."""
    want_tokens = one_device_tokens(tied_orbax, workload, **INT8)
    seqs = [p + t for p, t in zip(workload[0], want_tokens, strict=True)]
    reference = Engine(EngineConfig(model=str(tied_orbax), prefix_caching=False, **INT8))
    try:
        want = scores(reference, seqs)
    finally:
        reference.close()
    engine = one_layout_engine(tied_orbax, "pp=2,tp=4", prefix_caching=False, matmul="portable",
                               **INT8)
    try:
        assert "embed" not in engine.runner.params
        same, _ = agreement(want, scores(engine, seqs), seqs)
    finally:
        engine.close()
    assert same >= 0.9
