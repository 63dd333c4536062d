"""Automatic prefix caching on 8 devices with a re-shard between the phases (prefill on
pp=4,tp=2, decode on tp=8): cached blocks are read in the layout that wrote them or after
they moved with the live ones (a switch moves both), and blocks the small pool (8 blocks)
evicts go to the host tier and are copied back into the current layout's shards. Every policy
run here must give the single-device engine's tokens with the cache off
(tests/prefix_workload.py's two waves), with hits, and release every block; so must every
policy with prefill and decode both on pp=4,tp=2, through the host tier and back."""

from __future__ import annotations

import pytest
from conftest import TINY
from prefix_workload import assert_all_released, check_waves, run_waves, tokens

from jaxpipe import Engine, EngineConfig
from jaxpipe.kv.device_cache import BLOCK

FAST = dict(dtype="float32", max_model_len=96, max_num_seqs=3, max_num_batched_tokens=64,
            host_kv_tokens=256, warmup=False, show_progress=False)
LAYOUTS = dict(mesh="cpu-8", prefill="pp=4,tp=2", decode="tp=8")


@pytest.fixture(scope="module")
def reference(tiny_orbax):
    """The two waves on one device, the cache off."""
    engine = Engine(EngineConfig(model=str(tiny_orbax), scheduler="prefill_first",
                                 prefix_caching=False, **FAST))
    reference = run_waves(engine, TINY.vocab_size - 1)
    engine.close()
    return reference


@pytest.fixture(scope="module")
def cached(tiny_orbax):
    engine = Engine(EngineConfig(model=str(tiny_orbax), prefix_caching=True,
                                 kv_cache_tokens=8 * 16, **LAYOUTS, **FAST))
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", ["seesaw", "prefill_first", "throttle"])
def test_two_layouts_give_the_uncached_tokens(cached, reference, policy):
    """seesaw prefills on pp=4,tp=2 and decodes on tp=8; prefill_first's mixed steps run on
    tp=8 after one switch; throttle's micro-batches flow through pp=4,tp=2's stages (a
    sequence reads no block a micro-batch still in flight writes)."""
    cached.set_scheduler(policy)
    first, second = check_waves(cached, reference)
    assert first["prefix_cache_hit_tokens"] > 0 and second["prefix_cache_hit_tokens"] > 0
    if policy == "seesaw":
        assert first["reshards"] > 0 and second["reshards"] > 0
    elif policy == "prefill_first":
        assert cached.executor.state.phase.value == "decode"


def one(engine, prompt: list[int], params) -> list[int]:
    """The tokens of `prompt` run alone."""
    return tokens(engine.generate(prompt_token_ids=[prompt], sampling_params=[params]))[0]


def evicted_and_sent_again(engine, reference) -> dict:
    """The first wave's shared prefix hit for sure, evicted, then sent again, in separate
    `generate` calls so that no queue order decides which blocks are hit or evicted: its
    prompt 5 (the 48-token stem) alone writes the stem's blocks, its prompt 0 alone hits
    the first two (blocks hit once are the ones the pool spills); then three prompts that
    share nothing, one at a time, each writing 6 of the 8 blocks, evict every block cached
    before them (the hit ones to the host tier); then the whole first wave again, which
    copies them back. Every call gives the reference's tokens, every block is released.
    Returns the stats of the last wave."""
    (prompts, want), _, params = reference
    assert one(engine, prompts[5], params[5]) == want[5]
    engine.reset_stats()
    assert one(engine, prompts[0], params[0]) == want[0]
    assert engine.stats()["prefix_cache_hit_tokens"] >= 2 * BLOCK
    vocab = TINY.vocab_size - 1
    for i in range(3):
        engine.generate(prompt_token_ids=[[(7 * i + 3 * j + 1) % vocab for j in range(80)]],
                        sampling_params=params[0])
    engine.reset_stats()
    assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) == want
    assert_all_released(engine)
    return engine.stats()


def test_a_prefix_evicted_to_the_host_tier_comes_back_after_a_reshard(cached, reference):
    """seesaw: the first wave's blocks, written on pp=4,tp=2, are evicted by prompts that
    share nothing with them, while the phases switch back and forth; the first wave sent
    again copies them back from the host tier and gives the uncached tokens."""
    cached.set_scheduler("seesaw")
    stats = evicted_and_sent_again(cached, reference)
    assert stats["prefix_cache_host_hit_tokens"] > 0 and stats["reshards"] > 0


@pytest.fixture(scope="module")
def one_layout(tiny_orbax):
    """Prefill and decode both on pp=4,tp=2 (no re-shard), the same small pool."""
    engine = Engine(EngineConfig(model=str(tiny_orbax), prefix_caching=True,
                                 kv_cache_tokens=8 * 16, mesh="cpu-8", prefill="pp=4,tp=2",
                                 decode="pp=4,tp=2", **FAST))
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", ["seesaw", "prefill_first", "tdpipe", "throttle",
                                    "decode_first"])
def test_every_policy_on_pp4_tp2_gives_the_uncached_tokens_through_the_host_tier(
        one_layout, reference, policy):
    """Every policy on one engine (`set_scheduler`, as test_small_batch_engine): the two
    waves hit on the device, and the first wave, evicted to the host tier, comes back."""
    one_layout.set_scheduler(policy, **({"tdpipe_finish_ratio": 0.5} if policy == "tdpipe"
                                        else {}))
    first, second = check_waves(one_layout, reference)
    assert first["prefix_cache_hit_tokens"] > 0 and second["prefix_cache_hit_tokens"] > 0
    stats = evicted_and_sent_again(one_layout, reference)
    assert stats["prefix_cache_host_hit_tokens"] > 0
