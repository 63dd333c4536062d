"""Automatic prefix caching in the engine (`EngineConfig.prefix_caching`): requests that share
a prefix of their prompt with earlier ones (inside a block, exactly on a block boundary, the
whole prompt, a prompt that replays an earlier request and its output) start their prefill
after the cached blocks, and their f32 greedy tokens (penalised ones too: the penalty state
of a sequence that starts past a prefix must still be set) equal those of the same engine with
the cache off, which equal HF transformers'. Under every policy on one device, with the host
tier, recompute and swap preemption, aborts, and the host sampler; `generate` queues a list
in the cache-aware order and answers in input order. The multi-device layouts are in
tests/multidevice/test_prefix_caching_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import TINY_SMOLLM2  # noqa: E402
from hf_families import VOCAB, hf_greedy, write  # noqa: E402
from prefix_workload import (  # noqa: E402
    NEW,
    assert_all_released,
    check_waves,
    run_waves,
    tokens,
)

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.kv.device_cache import BLOCK  # noqa: E402
from jaxpipe.scheduler import Kind, Preempt, make_policy  # noqa: E402
from jaxpipe.scheduler.prefix_order import admission_order  # noqa: E402

FAST = dict(dtype="float32", max_model_len=96, max_num_seqs=3, max_num_batched_tokens=64,
            host_kv_tokens=256, warmup=False, show_progress=False)
POLICIES = ["prefill_first", "seesaw", "tdpipe", "throttle", "decode_first"]
KNOBS = {"tdpipe": {"tdpipe_finish_ratio": 0.5}}  # no step timing measured


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
    """The waves' tokens with the cache off (prefill_first); its greedy ones are HF's."""
    model, path = checkpoint
    engine = engine_of(path, scheduler="prefill_first", prefix_caching=False)
    reference = run_waves(engine, VOCAB)
    assert engine.stats()["prefix_cache_queried_tokens"] == 0
    engine.close()
    *waves, params = reference
    for prompts, outs in waves:
        for prompt, out, p in zip(prompts, outs, params, strict=True):
            if p.repetition_penalty == 1.0:
                assert out == hf_greedy(model, prompt, NEW)
    return reference


@pytest.fixture(scope="module")
def cached(checkpoint):
    """The engine under test: the cache on, a policy set by each test (idle between tests)."""
    engine = engine_of(checkpoint[1], prefix_caching=True)
    yield engine
    engine.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_uncached_tokens(cached, reference, policy):
    cached.set_scheduler(policy, **KNOBS.get(policy, {}))
    first, second = check_waves(cached, reference)
    for stats in (first, second):
        assert stats["prefix_cache_hit_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert first["prefix_cache_queried_tokens"] >= sum(len(p) for p in reference[0][0])
    if policy == "seesaw":
        assert first["swap_out_bytes"] > 0  # prefills went through the host tier


def test_without_overlap_and_with_the_host_sampler(cached, reference):
    cached.set_scheduler("prefill_first")
    cached.set_overlap(False)
    try:
        assert check_waves(cached, reference)[1]["prefix_cache_hit_tokens"] > 0
    finally:
        cached.set_overlap(True)
    cached.runner.set_sampler("host")
    try:
        assert check_waves(cached, reference)[1]["prefix_cache_hit_tokens"] > 0
    finally:
        cached.runner.set_sampler("device")


class PreemptEvery:
    """prefill_first, except that every `every`-th decode step preempts its newest sequence
    (`mode`: "recompute" or "swap"); records the cached tokens each victim comes back with."""

    depth = 1

    def __init__(self, every: int, mode: str):
        self.inner = make_policy("prefill_first", max_prefill_tokens=FAST["max_num_batched_tokens"])
        self.every, self.mode, self.decodes = every, mode, 0
        self.victims: dict[str, list[int]] = {}  # id -> cached tokens at each return

    def schedule(self, state):
        action = self.inner.schedule(state)
        if action is not None and action.kind is Kind.RUN and action.decode:
            self.decodes += 1
            if self.decodes % self.every == 0:
                victim = action.decode[-1]
                self.victims.setdefault(victim.seq_id, [])
                return Preempt([victim], self.mode)
        return action

    def landed(self, run, finished, state):
        for seq, _ in run.prefill:
            if seq.seq_id in self.victims and seq.computed == seq.context_len - 1:
                self.victims[seq.seq_id].append(seq.cached_tokens)
        self.inner.landed(run, finished, state)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_releases_references_only(cached, reference, mode):
    """Preempted sequences drop their references, never a block others hold: recomputed,
    they come back finding their own blocks still cached; swapped to the host tier, their
    shared blocks are copied out and stay with the others."""
    cached.executor.policy = policy = PreemptEvery(3, mode)
    try:
        first, second = check_waves(cached, reference)
    finally:
        cached.set_scheduler("prefill_first")
    assert first["preemptions"] > 0 and second["preemptions"] > 0
    if mode == "recompute":
        assert max(max(c, default=0) for c in policy.victims.values()) >= BLOCK
    else:
        assert first["swap_out_bytes"] > 0 and second["swap_in_bytes"] > 0


def test_a_prefix_evicted_to_the_host_tier_is_copied_back(checkpoint, reference):
    """A pool of 6 blocks: the first wave's blocks are evicted to the host tier by prompts
    that share nothing with them; sent again, the first wave finds its prefixes there, copied
    back into the pool, and gives the uncached tokens."""
    engine = engine_of(checkpoint[1], prefix_caching=True, kv_cache_tokens=6 * BLOCK,
                       scheduler="prefill_first")
    (prompts, want), _, params = reference
    try:
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) == want
        others = [[(7 * i + 3 * j) % VOCAB for j in range(40 + i)] for i in range(6)]
        engine.generate(prompt_token_ids=others, sampling_params=params[0])
        assert engine.stats()["prefix_cache_host_stored_blocks"] > 0
        engine.reset_stats()
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) == want
        stats = engine.stats()
        assert_all_released(engine)
    finally:
        engine.close()
    assert stats["prefix_cache_host_hit_tokens"] > 0 and stats["prefix_cache_host_bytes_in"] > 0
    assert stats["prefix_cache_device_hit_tokens"] + stats["prefix_cache_host_hit_tokens"] == \
        stats["prefix_cache_hit_tokens"]


@pytest.mark.parametrize("policy", ["prefill_first", "seesaw"])
def test_a_small_pool_evicts_cached_blocks(checkpoint, reference, policy):
    """A pool of 6 blocks for 3 rows of up to 5 blocks: cached blocks nobody holds are
    evicted for new ones (seesaw also parks running sequences in the host tier), and only
    those that were hit go to the host tier."""
    engine = engine_of(checkpoint[1], prefix_caching=True, kv_cache_tokens=6 * BLOCK,
                       scheduler=policy)
    try:
        first, second = check_waves(engine, reference)
    finally:
        engine.close()
    assert first["prefix_cache_hit_tokens"] > 0
    assert first["prefix_cache_evictions"] + second["prefix_cache_evictions"] > 0
    # only blocks hit at least once go to the host tier (prefix_cache.py)
    assert (first["prefix_cache_host_stored_blocks"] + second["prefix_cache_host_stored_blocks"]
            ) * BLOCK <= first["prefix_cache_hit_tokens"] + second["prefix_cache_hit_tokens"]
    if policy == "seesaw":
        assert first["preemptions"] + second["preemptions"] > 0


def test_reset_stats_zeroes_the_prefix_cache_counters(cached, reference):
    cached.set_scheduler("prefill_first")
    assert check_waves(cached, reference)[1]["prefix_cache_hit_tokens"] > 0
    cached.reset_stats()
    stats = cached.stats()
    assert stats["prefix_cache_hit_tokens"] == stats["prefix_cache_queried_tokens"] == 0
    assert stats["prefix_cache_evictions"] == 0 and stats["prefix_cache_hit_rate"] == 0.0


@pytest.mark.parametrize("policy", ["prefill_first", "seesaw"])
def test_aborting_a_sharer_leaves_the_others_their_blocks(cached, reference, policy):
    """The first wave with two requests that share the stem aborted as soon as they left
    the queue (on the device, or parked in the host tier); the rest give the reference
    tokens."""
    cached.set_scheduler(policy)
    cached.reset_stats()
    (prompts, want), _, params = reference
    ids = [cached.add_request(None, p, prompt_token_ids=t)
           for t, p in zip(prompts, params, strict=True)]
    state, victims = cached.executor.state, {1, 6}
    while cached.has_unfinished():
        cached.step()
        for i in [i for i in victims if ids[i] in state.device or ids[i] in state.host]:
            cached.abort(ids[i])
            victims.discard(i)
    assert not victims and cached.stats()["prefix_cache_hit_tokens"] > 0
    for i, rid in enumerate(ids):
        out = cached.pop_output(rid).outputs[0]
        if i in (1, 6):
            assert out.finish_reason == "abort"
        else:
            assert list(out.token_ids) == want[i]
    assert_all_released(cached)


def test_generate_queues_a_list_by_prefix_and_answers_in_input_order(cached, reference):
    """Both waves in one shuffled list: queued in `admission_order`, answered in input
    order, each with the request id its input position gives and the reference tokens."""
    cached.set_scheduler("prefill_first")
    (first, want_first), (second, want_second), params = reference
    perm = [9, 2, 13, 0, 7, 4, 11, 1, 6, 12, 3, 8, 5, 10]
    prompts = [(first + second)[i] for i in perm]
    want = [(want_first + want_second)[i] for i in perm]
    queued = []
    add = cached.executor.add
    cached.executor.add = lambda seq: (queued.append(seq.request_id), add(seq))
    try:
        outs = cached.generate(prompt_token_ids=prompts,
                               sampling_params=[(params + params)[i] for i in perm])
    finally:
        del cached.executor.add
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    ids = [int(o.request_id) for o in outs]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert [ids.index(int(r)) for r in queued] == admission_order(prompts, BLOCK)
    assert cached.stats()["prefix_cache_hit_tokens"] > 0
    assert_all_released(cached)


def test_requests_of_one_step_share_a_new_prefix_by_waiting_a_step(checkpoint, cached):
    """Three copies of a 40-token prompt no one sent before, queued together: the first
    computes it, the other two wait a step (its first block is being written) and then
    find its two full blocks cached; all three give HF's greedy tokens."""
    model, _ = checkpoint
    cached.set_scheduler("prefill_first")
    cached.reset_stats()
    prompt = [(11 * j + 5) % VOCAB for j in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = tokens(cached.generate(prompt_token_ids=[prompt] * 3, sampling_params=params))
    assert outs == [hf_greedy(model, prompt, NEW)] * 3
    assert cached.stats()["prefix_cache_hit_tokens"] == 2 * 2 * BLOCK
    assert_all_released(cached)


@pytest.fixture(scope="module")
def tiny_pair(tiny_smollm2):
    """Two engines of the tiny SmolLM2, cache off and on, with a pool of 24 blocks for 8
    rows: admission is limited by room, and a workload of a few thousand tokens evicts."""
    opts = dict(max_model_len=192, max_num_seqs=8, max_num_batched_tokens=128,
                kv_cache_tokens=24 * BLOCK)
    pair = [engine_of(tiny_smollm2, **opts, prefix_caching=on) for on in (False, True)]
    yield pair
    for engine in pair:
        engine.close()


def no_sharing(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """40 random prompts of 5 to 119 tokens (no two share a block), greedy, 1 to 7 tokens."""
    rng = np.random.default_rng(seed)
    vocab = TINY_SMOLLM2["vocab_size"]
    prompts = [rng.integers(3, vocab, rng.integers(5, 120)).tolist() for _ in range(40)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 8)),
                             ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("policy", ["prefill_first", "decode_first", "tdpipe"])
def test_the_cache_changes_no_step_when_nothing_is_shared(tiny_pair, policy):
    """With nothing shared the cache is invisible to scheduling: the same steps (kind, decode
    rows, prompt tokens, in order) and tokens as the cache off, although cached blocks nobody
    holds fill the pool and are evicted (they count as free room). seesaw is left out: which
    swap-ins are ready for a step is timing, so its steps differ between two runs cache off;
    so is throttle, which preempts here, and a recomputed sequence finds its own blocks."""
    prompts, params = no_sharing(POLICIES.index(policy))  # prompts no earlier test sent
    runs = []
    for engine in tiny_pair:
        engine.set_scheduler(policy, **KNOBS.get(policy, {}))
        engine.reset_stats()
        out = tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))
        steps = [(r.name, r.decode, r.prefill) for r in engine.executor.timeline.records]
        runs.append((out, steps, engine.stats()))
    (off, steps_off, _), (on, steps_on, stats) = runs
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["prefix_cache_evictions"] > 0
    assert stats["preemptions"] == 0
    assert steps_on == steps_off and on == off
