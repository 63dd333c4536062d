"""Scheduling policies and the host KV tier in the real engine on 8 devices: prefill on
pp=4,tp=2, decode on tp=8, more work than the device KV store holds (12 requests of mixed
lengths, up to 58 tokens each, on 8 rows and a pool of 96 tokens: the running sequences
outgrow it). Every policy must give the single-device engine's greedy tokens; neither tier may
overfill; seesaw must switch layouts rarely; swap-ins must overlap decode steps."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from prefix_workload import host_holds_no_sequence

from jaxpipe import Engine, EngineConfig, SamplingParams

FAST = dict(dtype="float32", max_model_len=64, warmup=False, show_progress=False)
DEVICE_KV = 96  # tokens (6 blocks of 16): 1/4 of the KV the 12 requests end with
LAYOUTS = dict(mesh="cpu-8", prefill="pp=4,tp=2", decode="tp=8", max_num_seqs=8,
               kv_cache_tokens=DEVICE_KV)
HOST_KV = 192  # tokens: about a fifth of the workload's prompt KV, so seesaw refills often
POLICIES = ["seesaw", "prefill_first", "decode_first"]


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size - 1, rng.integers(3, 40)).tolist()
               for _ in range(12)]
    lengths = rng.integers(4, 20, len(prompts))
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), min_tokens=min(int(n), 3 * i % 7),
                             ignore_eos=i % 2 == 0) for i, n in enumerate(lengths)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_orbax, workload):
    """Greedy tokens of the single-device engine, every request in its own slot, the cache
    off."""
    engine = Engine(EngineConfig(model=str(tiny_orbax), max_num_seqs=16,
                                 scheduler="prefill_first", prefix_caching=False, **FAST))
    prompts, params = workload
    return tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))


@pytest.fixture(scope="module")
def runs(tiny_orbax, workload):
    """policy -> (engine, outputs) on the two layouts."""
    prompts, params = workload
    out = {}
    for policy in POLICIES:
        engine = Engine(EngineConfig(model=str(tiny_orbax), scheduler=policy,
                                     host_kv_tokens=HOST_KV, **LAYOUTS, **FAST))
        out[policy] = engine, engine.generate(prompt_token_ids=prompts, sampling_params=params)
    return out


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_one_device(runs, reference, workload, policy):
    engine, outputs = runs[policy]
    assert tokens(outputs) == reference
    stats = engine.stats()
    assert stats["finished_requests"] == len(reference)
    # prefill_first's mixed steps stay on the decode layout: it switches there once.
    assert stats["to_decode"] >= (1 if policy == "prefill_first" else 2)
    assert stats["reshards"] == stats["transitions"]


def test_seesaw_swaps_through_the_host_and_preempts(runs, workload):
    engine, _ = runs["seesaw"]
    stats = engine.stats()
    prompts, _ = workload
    # Every prompt's KV went out to the host tier (rounded per sequence) and came back.
    rounded = sum(engine.executor.state.host_kv.size(len(p)) for p in prompts)
    per_token = stats["swap_out_bytes"] / rounded
    assert per_token >= 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4
    assert stats["swap_in_bytes"] == stats["swap_out_bytes"]
    assert stats["preemptions"] >= 1  # a running batch parked in the host to refill


def test_growing_sequences_are_preempted(runs, workload):
    """prefill_first fills the device pool with prompts; as they grow past it the newest are
    preempted (recomputed) and still give the reference tokens (checked above)."""
    final_kv = sum(len(p) + q.max_tokens for p, q in zip(*workload, strict=True))
    assert final_kv > 4 * DEVICE_KV
    stats = runs["prefill_first"][0].stats()
    assert stats["preemptions"] >= 1
    assert stats["device_kv_capacity"] == DEVICE_KV


@pytest.mark.parametrize("policy", POLICIES)
def test_tiers_never_overfill_and_every_request_ends_once(runs, workload, policy):
    engine, outputs = runs[policy]
    stats = engine.stats()
    assert 0 < stats["device_kv_peak"] <= DEVICE_KV
    # every block back in the pool
    assert engine.executor.state.device_kv.pool.num_free == DEVICE_KV // 16
    assert stats["host_kv_peak"] <= HOST_KV == stats["host_kv_capacity"]
    assert all(used <= HOST_KV for _, used in stats["host_timeline"])
    assert stats["host_timeline"][-1][1] == 0 and host_holds_no_sequence(engine)
    # each exactly once (a second finish of one sequence raises), and none kept after
    assert engine.executor.state.num_finished == len(outputs)
    assert all(o.finished and o.outputs[0].finish_reason in ("length", "stop") for o in outputs)
    assert not engine.has_unfinished() and engine.executor.kv.pending == 0


def test_seesaw_switches_rarely(runs, workload):
    prompts, _ = workload
    seesaw = runs["seesaw"][0].stats()
    state = runs["seesaw"][0].executor.state
    prompt_kv = sum(state.host_kv.size(len(p)) for p in prompts)
    assert seesaw["to_decode"] <= math.ceil(prompt_kv / HOST_KV) + 1
    # prefill_first's mixed steps all run on the decode layout: one switch, at the start.
    assert runs["prefill_first"][0].stats()["transitions"] == 1


def test_swap_ins_overlap_decode_steps(runs):
    engine, _ = runs["seesaw"]
    records = engine.executor.timeline.records
    spans = [(r.dispatch, r.fetched) for r in records if r.name == "step" and r.decode]
    arrivals = [t for t, kind, _ in engine.executor.kv.host.events if kind == "in"]
    during = [t for t in arrivals if any(a < t < b for a, b in spans)]
    assert len(during) >= 1, (len(arrivals), len(spans))


# TD-Pipe and gLLM: pp micro-batches per step on the prefill layout (pp=4,tp=2), the same
# small device KV. "tdpipe" measures its step-time table (cached in a temporary directory).
PIPELINED = {"throttle": dict(scheduler="throttle", throttle_max_prefill=48),
             "tdpipe": dict(scheduler="tdpipe"),
             "tdpipe_ratio": dict(scheduler="tdpipe", tdpipe_predictor="oracle",
                                  tdpipe_finish_ratio=0.5)}


@pytest.fixture(scope="module")
def pipelined_runs(tiny_orbax, workload, tmp_path_factory):
    prompts, params = workload
    cache, old = str(tmp_path_factory.mktemp("cache")), os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache
    try:
        out = {}
        for name, options in PIPELINED.items():
            engine = Engine(EngineConfig(model=str(tiny_orbax), host_kv_tokens=HOST_KV,
                                         **options, **LAYOUTS, **FAST))
            outputs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            out[name] = engine, outputs
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return out, cache


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_pipelined_policies_match_one_device(pipelined_runs, reference, name):
    runs, cache = pipelined_runs
    engine, outputs = runs[name]
    assert tokens(outputs) == reference
    stats = engine.stats()
    assert 0 < stats["device_kv_peak"] <= DEVICE_KV == stats["device_kv_capacity"]
    state = engine.executor.state
    assert state.device_kv.pool.num_free == DEVICE_KV // 16 and not state.busy
    assert engine.executor.state.num_finished == len(outputs)  # each exactly once
    assert stats["transitions"] == 0  # one layout: the prefill one
    policy = engine.executor.policy
    assert policy.depth == 4
    if name.startswith("tdpipe"):
        assert policy.switches >= 2
        assert list(Path(cache, "jaxpipe", "timing").glob("*.json"))  # measured once, cached
