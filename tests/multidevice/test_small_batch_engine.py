"""Every policy on 8 devices with prefill and decode both on pp=4,tp=2, few rows (16) and a
KV pool that holds many more prompts than that (2048 tokens): a few dozen requests of mixed
lengths give the single-device engine's greedy tokens, with the prefix cache on (one engine
for all policies: under the later ones the pool evicts the earlier ones' cached blocks and
the host tier copies them back; that once raised a KeyError, see
tests/scheduler/test_prefix_cache.py). With a fresh step-time cache, tdpipe
used to fail at start: its measured prefill steps took 32 prompts into a 16-row step."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY

from jaxpipe import Engine, EngineConfig, SamplingParams

FAST = dict(dtype="float32", max_model_len=192, warmup=False, show_progress=False)
SMALL_BATCH = dict(mesh="cpu-8", prefill="pp=4,tp=2", decode="pp=4,tp=2", max_num_seqs=16,
                   kv_cache_tokens=2048, max_num_batched_tokens=2048, host_kv_tokens=1024,
                   prefix_caching=True)
POLICIES = ["tdpipe", "throttle", "seesaw", "prefill_first", "decode_first"]


@pytest.fixture(scope="module")
def workload():
    """32 greedy requests: prompts of 20-160 tokens, 4-24 new tokens."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, TINY.vocab_size - 1, rng.integers(20, 161)).tolist()
               for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(4, 25, len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_orbax, workload):
    """Greedy tokens of the single-device engine, every request in its own slot, the cache
    off."""
    engine = Engine(EngineConfig(model=str(tiny_orbax), max_num_seqs=32,
                                 scheduler="prefill_first", prefix_caching=False, **FAST))
    return tokens(engine.generate(prompt_token_ids=workload[0], sampling_params=workload[1]))


@pytest.fixture(scope="module")
def engine(tiny_orbax, tmp_path_factory):
    """One engine for every policy (`set_scheduler`), started as tdpipe with no step-time
    table cached (an empty cache directory), as a new user starts it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield Engine(EngineConfig(model=str(tiny_orbax), scheduler="tdpipe", **SMALL_BATCH,
                                  **FAST))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


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
