"""Automatic prefix caching on 8 devices with a re-shard between the phases (prefill on
pp=4,tp=2, decode on tp=8): cached blocks are read in the layout that wrote them or after the
live ones moved, and a switch forgets those nobody holds. Every policy run here must give the
single-device engine's tokens with the cache off (tests/prefix_workload.py's two waves), with
hits, and release every block."""

from __future__ import annotations

import pytest
from conftest import TINY
from prefix_workload import check_waves, run_waves

from jaxpipe import Engine, EngineConfig

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
    engine = Engine(EngineConfig(model=str(tiny_orbax), prefix_caching=True, **LAYOUTS, **FAST))
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", ["seesaw", "prefill_first", "throttle"])
def test_two_layouts_give_the_uncached_tokens(cached, reference, policy):
    """seesaw prefills on pp=4,tp=2 and decodes on tp=8; prefill_first's mixed steps run on
    tp=8 after one switch; throttle runs 4 micro-batches a step on pp=4,tp=2 (sequences of
    one step share nothing written in it)."""
    cached.set_scheduler(policy)
    first, second = check_waves(cached, reference)
    assert first["prefix_cache_hit_tokens"] > 0 and second["prefix_cache_hit_tokens"] > 0
    if policy == "seesaw":
        assert first["reshards"] > 0 and second["reshards"] > 0
    elif policy == "prefill_first":
        assert cached.executor.state.phase.value == "decode"
