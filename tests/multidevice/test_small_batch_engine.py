"""Every policy on 8 devices with prefill and decode both on pp=4,tp=2, few rows (16) and a
KV pool that holds many more prompts than that (2048 tokens): a few dozen requests of mixed
lengths give the single-device engine's greedy tokens, with the prefix cache on (one engine
for all policies: under the later ones the pool evicts the earlier ones' cached blocks and
the host tier copies them back; that once raised a KeyError, see
tests/scheduler/test_prefix_cache.py). With a fresh step-time cache, tdpipe
used to fail at start: its measured prefill steps took 32 prompts into a 16-row step."""

from __future__ import annotations

import pytest
from conftest import greedy_workload, one_device_tokens, one_layout_engine
from prefix_workload import tokens

FAST = dict(dtype="float32", max_model_len=192, warmup=False, show_progress=False)
SMALL_BATCH = dict(max_num_seqs=16, kv_cache_tokens=2048, max_num_batched_tokens=2048,
                   host_kv_tokens=1024, prefix_caching=True)  # on pp=4,tp=2
POLICIES = ["tdpipe", "throttle", "seesaw", "prefill_first", "decode_first"]


@pytest.fixture(scope="module")
def workload():
    """32 greedy requests: prompts of 20-160 tokens, 4-24 new tokens."""
    return greedy_workload(7, 32, prompt_tokens=(20, 161), new_tokens=(4, 25))


@pytest.fixture(scope="module")
def reference(tiny_orbax, workload):
    """Greedy tokens of the single-device engine, every request in its own slot."""
    return one_device_tokens(tiny_orbax, workload, max_num_seqs=32, scheduler="prefill_first",
                             **FAST)


@pytest.fixture(scope="module")
def engine(tiny_orbax, tmp_path_factory):
    """One engine for every policy (`set_scheduler`), started as tdpipe with no step-time
    table cached (an empty cache directory), as a new user starts it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield one_layout_engine(tiny_orbax, "pp=4,tp=2", scheduler="tdpipe", **SMALL_BATCH,
                                **FAST)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_one_device_on_a_small_batch(engine, reference, workload, policy):
    engine.set_scheduler(policy)
    engine.reset_stats()
    outputs = engine.generate(prompt_token_ids=workload[0], sampling_params=workload[1])
    assert tokens(outputs) == reference
    stats = engine.stats()
    assert stats["finished_requests"] == len(reference)
    assert 0 < stats["max_step_tokens"] <= SMALL_BATCH["max_num_batched_tokens"]
    assert engine.executor.state.device_kv.pool.num_free == SMALL_BATCH["kv_cache_tokens"] // 16
    assert engine.executor.policy.depth == (4 if policy in ("tdpipe", "throttle") else 1)
