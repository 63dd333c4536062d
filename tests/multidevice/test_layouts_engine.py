"""The engine on 8 devices: prefill on one layout, decode on another, re-sharding between them.
Greedy outputs must equal the single-device engine's token for token (SmolLM2 and a tiny
prime-sized model), and SmolLM2's prefill logits must be within 1e-4 (f32) of one device."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import PAIRS, TINY
from prefix_workload import host_holds_no_sequence

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.config.layout import Layout
from jaxpipe.model import decoder, loading, orbax_dir
from jaxpipe.model.decoder import Decoder
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.step_inputs import Piece

FAST = dict(dtype="float32", max_model_len=128, max_num_seqs=8, warmup=False,
            show_progress=False)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_orbax):
    """Greedy tokens of the single-device engine (mesh cpu-1, in this same process)."""
    engine = Engine(EngineConfig(model=str(smollm2_orbax), **FAST))
    assert engine.stats()["reshards"] == 0
    return token_ids(engine.generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def smollm2_prefill_logits(smollm2):
    """Last-token logits of PROMPTS from the unpadded single-device whole-sequence forward."""
    cfg, values = smollm2
    tokenizer = loading.load_tokenizer(loading_source())
    ids = [tokenizer.encode(p) for p in PROMPTS]
    model = Decoder(cfg, values=values)
    return ids, np.stack([np.asarray(model.forward(jnp.asarray([i])))[0, -1] for i in ids])


def loading_source():
    from jaxpipe.model.presets import resolve_model

    return resolve_model("smollm2-135m")


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_smollm2_layout_pair_matches_one_device(smollm2_orbax, smollm2_reference,
                                                smollm2_prefill_logits, prefill, decode):
    engine = Engine(EngineConfig(model=str(smollm2_orbax), mesh="cpu-8", prefill=prefill,
                                 decode=decode, **FAST))
    assert token_ids(engine.generate(PROMPTS, GREEDY)) == smollm2_reference
    stats = engine.stats()
    assert stats["reshards"] >= 1 and stats["reshard_seconds"] > 0
    runner = engine.runner
    assert runner.phase == "decode"
    for name, place in runner.placements["decode"].params.items():
        arr = runner.params[name]
        assert arr.sharding.is_equivalent_to(place, arr.ndim), name

    runner.set_phase("prefill")
    ids, want = smollm2_prefill_logits
    blocks = np.arange(3 * runner.max_blocks).reshape(3, -1)  # a free pool: any blocks do
    pieces = [Piece(p, 0, list(b)) for p, b in zip(ids, blocks, strict=True)]
    tokens = engine.buckets.tokens(sum(map(len, ids)))
    inputs = step_inputs.build(pieces, tokens, engine.buckets.rows(tokens), runner.max_blocks)
    got = np.asarray(runner.logits(inputs, len(ids)))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4


def tiny_prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [list(rng.integers(0, TINY.vocab_size - 1, n)) for n in (5, 17, 2)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_orbax):
    engine = Engine(EngineConfig(model=str(tiny_orbax), **FAST))
    return token_ids(engine.generate(prompt_token_ids=tiny_prompts(),
                                     sampling_params=SamplingParams(temperature=0.0,
                                                                    max_tokens=12)))


@pytest.mark.parametrize("prefill, decode", [("pp=8", "tp=8"), ("pp=4,tp=2", "tp=4,pp=2")])
def test_tiny_prime_model_layout_pair_matches_one_device(tiny_orbax, tiny_reference, prefill,
                                                         decode):
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill=prefill,
                                 decode=decode, **FAST))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # Twice: the second run re-shards decode -> prefill -> decode.
    for _ in range(2):
        got = engine.generate(prompt_token_ids=tiny_prompts(), sampling_params=params)
        assert token_ids(got) == tiny_reference
    assert engine.stats()["reshards"] >= 3


def test_equal_layouts_never_reshard(tiny_orbax, tiny_reference):
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill="tp=4,pp=2",
                                 decode="pp=2,tp=4", **FAST))
    got = engine.generate(prompt_token_ids=tiny_prompts(),
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=12))
    assert token_ids(got) == tiny_reference
    assert engine.stats()["reshards"] == 0 and engine.stats()["reshard_seconds"] == 0.0


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling with logprobs, and penalties (one per tiny prompt)."""
    return [SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.5,
                           frequency_penalty=0.3)]


def mixed_outputs(engine: Engine, overlap: bool) -> list:
    engine.set_overlap(overlap)
    engine.executor.reset_stats()
    outs = engine.generate(prompt_token_ids=tiny_prompts(), sampling_params=mixed_params())
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("mesh, layout", [("cpu-1", None), ("cpu-8", "pp=2,tp=4")])
def test_overlap_and_the_host_sampler_change_no_output(tiny_orbax, tiny_reference, mesh,
                                                       layout):
    """Steps dispatched before the previous one's tokens are on the host, and tokens sampled
    on the host, give the synchronous loop's outputs: on one device (decode tokens fed on the
    device) and on a pp layout (micro-batches flowing through the stages together, each
    feeding from the one that just left the last stage)."""
    layouts = {"prefill": layout, "decode": layout} if layout else {}
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh=mesh, **layouts, **FAST))
    # The prefix cache (on by default) lets a call skip what an earlier one cached: another
    # chunking, the same tokens, logprobs ulps apart (jax 0.12's CPU dots). A first call
    # caches every prompt, so the compared calls chunk alike.
    mixed_outputs(engine, False)
    sync = mixed_outputs(engine, False)
    assert engine.stats()["fed_steps"] == 0
    overlapped = mixed_outputs(engine, True)
    assert overlapped_really(engine, layout)
    host = Engine(EngineConfig(model=str(tiny_orbax), mesh=mesh, **layouts, **FAST,
                               sampler="host"))
    mixed_outputs(host, True)
    assert mixed_outputs(host, True) == sync
    assert overlapped_really(host, layout) and host.runner.out_counts.shape[0] == 0
    host.close()
    assert overlapped == sync
    assert sync[0][0] == tiny_reference[0]


def overlapped_really(engine, layout: str | None) -> bool:
    """The last call fed tokens on the device (one stage: from the step in flight; a pp
    layout: from the micro-batch that had just left the last stage), and on a pp layout its
    micro-batches were in flight together (more stage-ticks ran one than there were ticks)."""
    fed = engine.stats()["fed_steps"] > 0
    if not layout or Layout.parse(layout).pp == 1:
        return fed
    counts = engine.runner.ticks.counts()
    return fed and counts["busy_slots"] > counts["ticks"]


def test_close_frees_the_engine_and_refuses_new_work(tiny_orbax):
    """`with Engine(...)`: on exit the unfinished request is aborted, every device array is
    freed (weights, KV pool) and the engine refuses new work; closing again is harmless."""
    import jax

    with Engine(EngineConfig(model=str(tiny_orbax), **FAST)) as engine:
        rid = engine.add_request(prompt_token_ids=tiny_prompts()[1],
                                 params=SamplingParams(temperature=0.0, max_tokens=60))
        engine.step()
        engine.step()  # prefilled, a decode step in flight
        seq = engine._requests[rid]
        arrays = jax.tree.leaves((engine.runner.params, engine.runner.cache))
        assert not seq.is_finished and not any(a.is_deleted() for a in arrays)
    assert engine.closed and seq.finish_reason == "abort"
    assert all(a.is_deleted() for a in arrays)
    assert host_holds_no_sequence(engine)
    with pytest.raises(RuntimeError, match="Engine is closed"):
        engine.generate(prompt_token_ids=tiny_prompts(), sampling_params=GREEDY)
    engine.close()


def test_a_kv_pool_larger_than_free_memory_fails_at_construction(tiny_orbax, monkeypatch):
    """The budget is checked against the memory the devices have free (CPU: MemAvailable,
    pretended small here) before the pool is allocated, naming the setting and the bytes."""
    from jaxpipe.runtime import memory

    assert memory.host_available_bytes() > 2**20  # this machine's real figure is read
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 4096)
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_tokens=512: the device KV "
                                         r"pool needs [\d,]+ bytes and the weights [\d,]+, "
                                         r"but only 4,096 bytes are free on cpu"):
        Engine(EngineConfig(model=str(tiny_orbax), **FAST, kv_cache_tokens=512))


@pytest.fixture(scope="module")
def tiny_qwen_orbax(tmp_path_factory):
    """TINY with the family switches: q/k/v biases (sharded with their heads, zero on padded
    query heads), per-head q/k norms, and a 7-key sliding window on three of the five layers
    (pp=8 pads them to 8: each stage must find its own layers' windows)."""
    cfg = dataclasses.replace(TINY, qkv_bias=True, qk_norm=True, sliding_window=7,
                              sliding_layers=(1, 3, 4))
    path = tmp_path_factory.mktemp("tiny_qwen") / "ckpt"
    orbax_dir.save_orbax(path, cfg, decoder.numpy_random_values(cfg, seed=4), "float32")
    return path


@pytest.mark.parametrize("prefill, decode", [("pp=4,tp=2", "tp=8"), ("pp=8", "pp=2,tp=4")])
def test_family_parameters_layout_pair_match_one_device(tiny_qwen_orbax, prefill, decode):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    one = Engine(EngineConfig(model=str(tiny_qwen_orbax), **FAST))
    want = token_ids(one.generate(prompt_token_ids=tiny_prompts(), sampling_params=params))
    engine = Engine(EngineConfig(model=str(tiny_qwen_orbax), mesh="cpu-8", prefill=prefill,
                                 decode=decode, **FAST))
    for _ in range(2):  # the second run re-shards decode -> prefill -> decode
        got = engine.generate(prompt_token_ids=tiny_prompts(), sampling_params=params)
        assert token_ids(got) == want
    assert engine.stats()["reshards"] >= 3
