"""The flowing pipeline in the engine on 8 devices (`runtime/flow.py`): micro-batches enter
stage 0 as the driver forms them, up to pp in flight, and never drain between steps.

Every policy on pp=8, pp=4,tp=2 and pp=2,tp=4 gives the single-device engine's greedy tokens,
in a device pool small enough that sequences are preempted (seesaw through its host tier);
aborts mid-flight spare the others; no stage runs an empty micro-batch between the fill at the
start and the drain at the end; the trace has one track per stage, no slices overlapping."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import TINY, greedy_workload, one_device_tokens, one_layout_engine
from prefix_workload import tokens

from jaxpipe import Engine, EngineConfig, SamplingParams

FAST = dict(dtype="float32", max_model_len=64, warmup=False, show_progress=False)
LAYOUTS = ["pp=8", "pp=4,tp=2", "pp=2,tp=4"]
POLICIES = ["tdpipe", "throttle", "prefill_first", "decode_first", "seesaw"]
DEVICE_KV = 128  # tokens (8 blocks): less than the 12 requests end with
HOST_KV = 256


@pytest.fixture(scope="module")
def workload():
    return greedy_workload(3, 12, prompt_tokens=(3, 30), new_tokens=(3, 16))


@pytest.fixture(scope="module")
def reference(tiny_orbax, workload):
    return one_device_tokens(tiny_orbax, workload, max_num_seqs=16, **FAST)


@pytest.fixture(scope="module")
def engines(tiny_orbax):
    """layout -> an engine on cpu-8 with both phases on it (its policy set per test)."""
    out = {layout: one_layout_engine(tiny_orbax, layout, max_num_seqs=8,
                                     kv_cache_tokens=DEVICE_KV, host_kv_tokens=HOST_KV,
                                     tdpipe_finish_ratio=0.5, **FAST)
           for layout in LAYOUTS}
    yield out
    for engine in out.values():
        engine.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_on_every_pipelined_layout_matches_one_device(engines, reference,
                                                                   workload, layout, policy):
    engine = engines[layout]
    engine.set_scheduler(policy)
    engine.reset_stats()
    prompts, params = workload
    assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) == reference
    counts, stats = engine.runner.ticks.counts(), engine.stats()
    assert counts["busy_slots"] > counts["ticks"]  # micro-batches were in flight together
    state = engine.executor.state
    assert not state.busy and state.device_kv.pool.num_free == DEVICE_KV // 16
    assert engine.runner.ticks.in_flight() == 0
    assert stats["fed_steps"] > 0  # micro-batches took tokens from one not yet landed
    if policy in ("throttle", "prefill_first", "seesaw"):  # they admit more than fits
        assert stats["preemptions"] > 0


def test_aborts_while_in_flight_spare_the_others(engines, reference, workload):
    """Two requests aborted while their micro-batches are in the pipeline end "abort"; the
    others give the reference tokens; every block comes back."""
    engine = engines["pp=4,tp=2"]
    engine.set_scheduler("throttle")
    prompts, params = workload
    ids = [engine.add_request(prompt_token_ids=p, params=q)
           for p, q in zip(prompts, params, strict=True)]
    state = engine.executor.state
    while engine.runner.ticks.in_flight() < 2 or len(state.busy) < 2:
        engine.step()
    victims = sorted(state.busy)[:2]
    for rid in victims:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    for i, rid in enumerate(ids):
        out = engine.pop_output(rid).outputs[0]
        if rid in victims:
            assert out.finish_reason == "abort"
        else:
            assert list(out.token_ids) == reference[i]
    assert not state.busy and state.device_kv.pool.num_free == DEVICE_KV // 16


@pytest.mark.parametrize("layout", ["pp=8", "pp=2,tp=4"])
@pytest.mark.parametrize("policy", ["throttle", "prefill_first", "seesaw"])
def test_samples_fork_when_their_prompt_leaves_the_pipeline(engines, layout, policy):
    """n=3 greedy samples of three prompts (the last blocks partly filled: copied on write)
    in the small pool: they fork once the prompt's micro-batch has left the last stage (its
    KV whole in every stage; seesaw: once the prompt comes back from the host tier) and each
    equals the prompt's n=1 greedy output."""
    engine = engines[layout]
    engine.set_scheduler(policy)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, TINY.vocab_size - 1, n).tolist() for n in (20, 9, 18)]
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = tokens(engine.generate(prompt_token_ids=prompts,
                                   sampling_params=SamplingParams(**greedy)))
    forked, fork = [], engine.executor.state.device_kv.fork
    engine.executor.state.device_kv.fork = lambda parent, child: forked.append(
        fork(parent, child)) or forked[-1]
    try:
        outs = engine.generate(prompt_token_ids=prompts,
                               sampling_params=SamplingParams(n=3, **greedy))
    finally:
        del engine.executor.state.device_kv.fork
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[a] * 3 for a in alone]
    assert any(forked)  # some samples shared their prompt's blocks (others found no room)
    state = engine.executor.state
    assert not state.busy and state.device_kv.pool.num_free == DEVICE_KV // 16


STOPPING = dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4)


@pytest.fixture(scope="module")
def stopping(tiny_orbax, workload):
    """The workload's prompts with penalties, each ending on a stop token: the token its
    single-device output with the penalties has at index 3 (so requests end at a token only
    the host learns, mid-way, while others decode); and the single-device tokens of that."""
    prompts, params = workload
    free = one_device_tokens(tiny_orbax, (prompts, [
        SamplingParams(max_tokens=p.max_tokens, **STOPPING) for p in params]),
        max_num_seqs=16, **FAST)
    stops = [SamplingParams(max_tokens=p.max_tokens, stop_token_ids=[out[min(3, len(out) - 1)]],
                            **STOPPING) for p, out in zip(params, free, strict=True)]
    reference = one_device_tokens(tiny_orbax, (prompts, stops), max_num_seqs=16, **FAST)
    assert any(len(r) < len(f) for r, f in zip(reference, free, strict=True))
    return (prompts, stops), reference


@pytest.fixture(scope="module")
def host_sampled(tiny_orbax):
    engine = one_layout_engine(tiny_orbax, "pp=4,tp=2", max_num_seqs=8,
                               kv_cache_tokens=DEVICE_KV, host_kv_tokens=HOST_KV,
                               tdpipe_finish_ratio=0.5, sampler="host", **FAST)
    yield engine
    engine.close()


@pytest.mark.parametrize("sampler", ["device", "host"])
@pytest.mark.parametrize("policy", ["throttle", "tdpipe"])
def test_token_safe_execution_with_stops_and_penalties_matches_one_device(
        engines, host_sampled, stopping, sampler, policy):
    """SiPipe's token-safe execution: a micro-batch's sequences enter the next one as it
    leaves the last stage, their tokens fed on the device (sampled on the device, or on the
    host first), before it lands. Requests that stop on a token the host learns only then
    are already in the next micro-batch: they keep their slot (its penalty state) and blocks
    until that one leaves too, so the requests taking their slots after them (8 slots, 12
    requests, a pool that preempts) get the single-device tokens."""
    engine = engines["pp=4,tp=2"] if sampler == "device" else host_sampled
    engine.set_scheduler(policy)
    engine.reset_stats()
    driver, deferred = engine.executor.driver, []
    ended_in = driver._ended_in
    driver._ended_in = lambda step: deferred.append(ended_in(step)) or deferred[-1]
    try:
        prompts, params = stopping[0]
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        del driver._ended_in
    assert tokens(outs) == stopping[1]
    assert engine.stats()["fed_steps"] > 0 and any(deferred)
    state = engine.executor.state
    assert not state.busy and state.device_kv.pool.num_free == DEVICE_KV // 16


def drains(records) -> list[list[int]]:
    """The ticks with nothing entering (draining), as runs of consecutive tick indices."""
    runs: list[list[int]] = []
    for i, record in enumerate(records):
        if record.slots[0] is None:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    return runs


def test_no_stage_runs_an_empty_micro_batch_between_the_fill_and_the_drain(tiny_orbax):
    """32 like requests under throttle on pp=4,tp=2, room for all: the pipeline fills in
    its first 3 ticks, every stage then runs a micro-batch in every tick, and it drains once,
    in the last 3 ticks."""
    engine = one_layout_engine(tiny_orbax, "pp=4,tp=2", max_num_seqs=32, scheduler="throttle",
                               **FAST)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, TINY.vocab_size - 1, 8).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.generate(prompt_token_ids=prompts, sampling_params=params)
    records = engine.runner.ticks.records()["prefill"]
    empty = [[s for s, mb in enumerate(r.slots) if mb is None] for r in records]
    assert empty[:3] == [[1, 2, 3], [2, 3], [3]]  # the fill
    n = len(records)
    assert drains(records) == [[n - 3, n - 2, n - 1]]  # the drain, once, at the end
    assert not any(empty[3:n - 3]), "a stage ran an empty micro-batch mid-flow"
    counts = engine.runner.ticks.counts()
    assert counts["idle_slots"] == 2 * (1 + 2 + 3)
    assert 0 < engine.stats()["pipeline_bubble_fraction"] < 1
    engine.close()


def test_seesaw_drains_its_prefill_pipeline_only_to_switch(tiny_orbax, workload):
    """Prefill on pp=4,tp=2, decode on tp=8, a host tier of a third of the prompts' KV:
    each stretch of prefill micro-batches drains only before a switch to decode, never in
    between. (The device pool has room: in a small one, prefills wait in the pipeline for
    the room those ahead of them give back when they land.)"""
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill="pp=4,tp=2",
                                 decode="tp=8", max_num_seqs=8, kv_cache_tokens=1024,
                                 host_kv_tokens=80, scheduler="seesaw", **FAST))
    prompts, params = workload
    engine.generate(prompt_token_ids=prompts, sampling_params=params)
    records = engine.runner.ticks.records()["prefill"]
    for run in drains(records):  # each drain empties the pipeline, then a switch follows
        assert all(mb is None for mb in records[run[-1]].slots[:-1])
    assert len(drains(records)) == engine.stats()["to_decode"] >= 2  # one per prefill stretch
    engine.close()


def test_the_trace_has_one_track_per_stage_and_no_overlapping_slices(engines, workload,
                                                                     tmp_path):
    engine = engines["pp=4,tp=2"]
    engine.set_scheduler("tdpipe")
    prompts, params = workload
    engine.generate(prompt_token_ids=prompts, sampling_params=params)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(engine.executor.chrome_trace()))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pids = [p for p, name in names.items() if name.startswith("pipeline")]
    assert pids  # a process per layout phase that ran ticks
    for pid in pids:
        tracks = {e["tid"]: e["args"]["name"] for e in events
                  if e["pid"] == pid and e.get("name") == "thread_name"}
        assert tracks == {s: f"stage {s}" for s in range(4)}
        for tid in tracks:
            slices = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                            if e["pid"] == pid and e.get("tid") == tid and e["ph"] == "X")
            assert slices
            assert all(end <= nxt + 0.1 for (_, end), (nxt, _) in itertools.pairwise(slices))
