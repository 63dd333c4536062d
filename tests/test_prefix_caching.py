"""Automatic prefix caching in the engine (`EngineConfig.prefix_caching`): requests that share
a prefix of their prompt with earlier ones (inside a block, exactly on a block boundary, the
whole prompt, a prompt that replays an earlier request and its output) start their prefill
after the cached blocks, and their f32 greedy tokens (penalised ones too: the penalty state
of a sequence that starts past a prefix must still be set) equal those of the same engine with
the cache off, which equal HF transformers'. Under every policy on one device, with the host
tier, recompute and swap preemption, and the host sampler; the multi-device layouts are in
tests/multidevice/test_prefix_caching_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import VOCAB, hf_greedy, write  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.kv.device_cache import BLOCK  # noqa: E402

NEW = 8  # tokens each request generates
FAST = dict(dtype="float32", max_model_len=96, max_num_seqs=3, max_num_batched_tokens=64,
            host_kv_tokens=256, warmup=False, show_progress=False)
POLICIES = ["prefill_first", "seesaw", "tdpipe", "throttle", "decode_first"]
KNOBS = {"tdpipe": {"tdpipe_finish_ratio": 0.5}}  # no step timing measured
assert BLOCK == 16  # the prompts below are cut at these block edges


def draw(rng, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def workload() -> tuple[list[list[int]], list[list[int]], list[SamplingParams]]:
    """(first wave, second wave, params of each request of a wave). A shared 48-token stem;
    in the first wave the prompts share 40 of it (a hit stops at the block before: 32), 32
    (exactly two blocks), all of another prompt, 48 (three full blocks: the last recomputed);
    the second wave, sent once the first ended, shares them again and replays the first
    prompt with its outputs (the stem's blocks, and decode-written ones)."""
    rng = np.random.default_rng(7)
    stem = draw(rng, 48)
    first = [stem[:40] + draw(rng, 6), stem[:40] + draw(rng, 9), stem[:32] + draw(rng, 12),
             draw(rng, 20), None, stem[:48], stem[:40] + draw(rng, 5)]
    first[4] = list(first[0])
    second = [stem[:48] + draw(rng, 3), stem[:32] + draw(rng, 21), list(first[2]),
              stem[:16] + draw(rng, 30), draw(rng, 17), None, stem[:40] + draw(rng, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                               repetition_penalty=1.5, presence_penalty=0.7,
                               frequency_penalty=0.5)
    params = [greedy, greedy, penalised, greedy, greedy, penalised, penalised]
    return first, second, params


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A two-layer Llama of random weights written by transformers: (HF model, directory)."""
    path = tmp_path_factory.mktemp("llama")
    model = write("llama_linear", path, rope_scaling=None, num_hidden_layers=2)
    return model, path


def engine_of(path, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(path), **{**FAST, **overrides}))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The waves' tokens with the cache off (prefill_first, each wave in turn; the second
    wave's replay is the first prompt and its output); its greedy ones checked against HF."""
    model, path = checkpoint
    first, second, params = workload()
    engine = engine_of(path, scheduler="prefill_first")
    out_first = tokens(engine.generate(prompt_token_ids=first, sampling_params=params))
    second[5] = first[0] + out_first[0] + [3, 1, 4]
    out_second = tokens(engine.generate(prompt_token_ids=second, sampling_params=params))
    assert engine.stats()["prefix_cache_queried_tokens"] == 0
    engine.close()
    for prompts, outs in ((first, out_first), (second, out_second)):
        for prompt, out, p in zip(prompts, outs, params, strict=True):
            if p.repetition_penalty == 1.0:
                assert out == hf_greedy(model, prompt, NEW)
    return (first, out_first), (second, out_second), params


@pytest.fixture(scope="module")
def cached(checkpoint):
    """The engine under test: the cache on, a policy set by each test (idle between tests)."""
    engine = engine_of(checkpoint[1], prefix_caching=True)
    yield engine
    engine.close()


def both_waves(engine, reference) -> list[dict]:
    """Run the two waves, each checked against the reference; the stats of each."""
    *waves, params = reference
    stats = []
    for prompts, expected in waves:
        engine.reset_stats()
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) \
            == expected
        stats.append(engine.stats())
    assert_all_released(engine)
    return stats


def assert_all_released(engine) -> None:
    """Every request ended: no block has a reference, none is lost."""
    state = engine.executor.state
    pool = state.block_pool
    assert pool.num_held == 0 and state.device_used == 0
    assert state.free_blocks == state.num_blocks
    assert not engine.executor.kv.host.entries and state.host_used == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_uncached_tokens(cached, reference, policy):
    cached.set_scheduler(policy, **KNOBS.get(policy, {}))
    first, second = both_waves(cached, reference)
    for stats in (first, second):
        assert stats["prefix_cache_hit_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert first["prefix_cache_queried_tokens"] >= sum(len(p) for p in reference[0][0])
    if policy == "seesaw":
        assert first["swap_out_bytes"] > 0  # prefills went through the host tier


def test_without_overlap_and_with_the_host_sampler(cached, reference):
    cached.set_scheduler("prefill_first")
    cached.set_overlap(False)
    try:
        assert both_waves(cached, reference)[1]["prefix_cache_hit_tokens"] > 0
    finally:
        cached.set_overlap(True)
    cached.runner.set_sampler("host")
    try:
        assert both_waves(cached, reference)[1]["prefix_cache_hit_tokens"] > 0
    finally:
        cached.runner.set_sampler("device")


@pytest.fixture(scope="module")
def tight(checkpoint):
    """A pool of 8 blocks for 3 rows of up to 5 blocks: the running sequences outgrow it."""
    engine = engine_of(checkpoint[1], prefix_caching=True, kv_cache_tokens=8 * BLOCK)
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", ["prefill_first", "seesaw"])
def test_preemption_releases_references_only(tight, reference, policy):
    """prefill_first recomputes preempted sequences, which find their own blocks cached;
    seesaw parks them in the host tier, whose copy of shared blocks leaves them to the
    others. Cached blocks nobody holds are evicted for new ones."""
    tight.set_scheduler(policy)
    first, second = both_waves(tight, reference)
    assert first["preemptions"] + second["preemptions"] > 0
    assert first["prefix_cache_hit_tokens"] > 0
    assert first["prefix_cache_evictions"] + second["prefix_cache_evictions"] > 0


def test_reset_stats_zeroes_the_prefix_cache_counters(cached, reference):
    cached.set_scheduler("prefill_first")
    both_waves(cached, reference)
    cached.reset_stats()
    stats = cached.stats()
    assert stats["prefix_cache_hit_tokens"] == stats["prefix_cache_queried_tokens"] == 0
    assert stats["prefix_cache_evictions"] == 0 and stats["prefix_cache_hit_rate"] == 0.0
