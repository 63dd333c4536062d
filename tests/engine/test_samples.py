"""n samples of one request (`SamplingParams.n`): the prompt prefilled once, the samples forked
from it sharing its blocks (the last partly filled one copied on write), each with its own seed
stream (request seed + i). The reference for every claim is a separate n=1 request on the same
engine: greedy samples equal its greedy output, sample i equals it seeded seed + i."""

from __future__ import annotations

import pytest

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.kv.device_cache import BLOCK


@pytest.fixture(scope="module")
def tiny(tiny_smollm2):
    """f32, eight rows, on the two-layer SmolLM2 of tests/conftest.py."""
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2}))
    yield engine
    engine.close()


def prompt(length: int, first: int = 100) -> list[int]:
    return [(7 * i + 3) % 5000 + first for i in range(length)]


def one(engine, ids, params):
    [out] = engine.generate(prompt_token_ids=[ids], sampling_params=params)
    return out


def held(engine) -> int:
    return engine.executor.state.device_kv.pool.num_held


# A prompt whose last token opens a block (nothing to copy) and one whose last block is partly
# filled before it (copied on write).
LENGTHS = [2 * BLOCK + 1, 2 * BLOCK + 7]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_samples_all_equal_the_single_greedy_output(tiny, overlap, length):
    tiny.set_overlap(overlap)
    ids = prompt(length)
    single = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=10)).outputs[0]
    out = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=10, n=8))
    assert [c.index for c in out.outputs] == list(range(8))
    assert all(c.token_ids == single.token_ids for c in out.outputs)
    assert all(c.finish_reason == single.finish_reason for c in out.outputs)
    assert out.prompt_token_ids == ids and held(tiny) == 0
    tiny.set_overlap(True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("length", LENGTHS)
def test_seeded_sample_i_equals_a_request_seeded_seed_plus_i(tiny, overlap, length):
    tiny.set_overlap(overlap)
    ids, seed = prompt(length), 2**32 - 2  # sample 2's seed wraps to 0
    sampled = dict(temperature=1.0, max_tokens=8)
    out = one(tiny, ids, SamplingParams(n=4, seed=seed, **sampled))
    alone = [one(tiny, ids, SamplingParams(seed=(seed + i) % 2**32, **sampled)).outputs[0]
             for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ
    assert held(tiny) == 0
    tiny.set_overlap(True)


def test_unseeded_samples_differ_and_each_is_a_seed_stream(tiny):
    """With no seed the request draws one (as an n=1 request does); its samples differ."""
    out = one(tiny, prompt(20), SamplingParams(temperature=1.0, max_tokens=8, n=3))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_the_prompt_is_counted_and_prefilled_once(tiny):
    """usage-like counts: the prompt's tokens once; each sample past the first computes only
    the prompt's last token again (for its own logits)."""
    ids = prompt(3 * BLOCK + 5, first=6000)  # a prompt of its own: no prefix cache hit
    tiny.reset_stats()
    one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=4, n=8))
    stats = tiny.stats()
    assert stats["prompt_tokens"] == len(ids) and stats["added_requests"] == 1
    assert stats["prefill_tokens"] == len(ids) + 7
    assert stats["forked_samples"] == 7 and stats["fork_copied_blocks"] == 7
    assert stats["generated_tokens"] == 8 * 4


def test_aborting_a_request_ends_every_sample_and_frees_its_blocks(tiny):
    for steps in (0, 1, 3):  # before its prefill, as it forks, while the samples decode
        rid = tiny.add_request(prompt_token_ids=prompt(40),
                               params=SamplingParams(temperature=0.0, max_tokens=50, n=4))
        for _ in range(steps):
            tiny.step()
        tiny.abort(rid)
        while tiny.has_unfinished():
            tiny.step()
        out = tiny.pop_output(rid)
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert {c.finish_reason for c in out.outputs} == {"abort"}
        assert held(tiny) == 0 and not tiny.executor.state.has_work()


def test_samples_finish_on_their_own_stops(tiny):
    """Each sample stops on its own: a stop token that one seeded sample draws ends it alone."""
    ids = prompt(30)
    sampled = dict(temperature=1.0, max_tokens=12, seed=99)
    free = one(tiny, ids, SamplingParams(n=3, **sampled)).outputs
    stop = free[1].token_ids[3]
    out = one(tiny, ids, SamplingParams(n=3, stop_token_ids=[stop], **sampled)).outputs
    for got, ran in zip(out, free, strict=True):
        cut = ran.token_ids.index(stop) + 1 if stop in ran.token_ids else len(ran.token_ids)
        assert got.token_ids == ran.token_ids[:cut]
    assert out[1].finish_reason == "stop"


def test_samples_whose_first_token_is_their_last(tiny):
    """max_tokens=1: the first sample is freed as its only token is dispatched, while its
    siblings still share (and copy) its prompt's blocks."""
    ids = prompt(3 * BLOCK + 9, first=4000)
    single = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=1)).outputs[0]
    out = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=1, n=4))
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 4
    assert held(tiny) == 0


def test_more_samples_than_rows_still_end_each_once(tiny):
    """n = 12 on eight rows: the samples without a slot at the fork prefill the prompt
    themselves, later; greedy, they all equal the single output."""
    ids = prompt(25)
    single = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=6)).outputs[0]
    out = one(tiny, ids, SamplingParams(temperature=0.0, max_tokens=6, n=12))
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 12
    assert held(tiny) == 0


@pytest.mark.parametrize("n", [0, -1, 129, 2.5])
def test_bad_n_is_refused_naming_the_field(n):
    with pytest.raises((ValueError, TypeError), match="^n must be"):
        SamplingParams(n=n)


def test_stream_yields_each_sample_by_index_as_generate_returns_them(tiny):
    ids, params = prompt(2 * BLOCK + 7), SamplingParams(n=3, seed=11, temperature=1.0,
                                                        max_tokens=6)
    want = one(tiny, ids, params).outputs
    tokens, finishes = {}, {}
    for delta in tiny.stream(ids, params):
        assert delta.index not in finishes  # nothing after a sample's finish
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        if delta.finish_reason is not None:
            finishes[delta.index] = delta.finish_reason
    assert tokens == {c.index: c.token_ids for c in want}
    assert finishes == {c.index: c.finish_reason for c in want}
    assert held(tiny) == 0


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_tokens=512),  # preemption recomputes
    dict(kv_cache_tokens=512, host_kv_tokens=4096),  # preemption swaps to the host tier
    dict(kv_cache_tokens=1024, host_kv_tokens=4096, scheduler="seesaw"),  # prefills parked
], ids=["recompute", "swap", "seesaw"])
def test_samples_through_preemption_swaps_and_the_host_tier(tiny_smollm2, kwargs):
    """Two greedy requests of n=3 outgrow a small pool together (each fits alone): samples are
    preempted (recomputed or swapped out and back) while their siblings keep the shared
    blocks; under seesaw every prefill goes to the host tier and the samples fork as it
    comes back. Every sample equals its prompt's greedy output alone; no block is left
    held."""
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2, **kwargs}))
    try:
        ids = [prompt(40, first=7000), prompt(45, first=8000)]
        greedy = dict(temperature=0.0, max_tokens=60, ignore_eos=True)
        alone = [one(engine, p, SamplingParams(**greedy)).outputs[0].token_ids for p in ids]
        engine.reset_stats()
        outs = engine.generate(prompt_token_ids=ids, sampling_params=SamplingParams(n=3, **greedy))
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[a] * 3 for a in alone]
        if "scheduler" not in kwargs:
            assert engine.stats()["preemptions"] > 0
        assert held(engine) == 0
        with pytest.raises(ValueError, match="16 samples.* device store holds"):
            engine.add_request(prompt_token_ids=prompt(100),
                               params=SamplingParams(n=16, max_tokens=100))
        assert not engine.has_unfinished()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def seesaw(tiny_smollm2):
    """The tiny engine under seesaw: every prefill goes to a host tier, then comes back."""
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2, "scheduler": "seesaw",
                                    "kv_cache_tokens": 1024, "host_kv_tokens": 4096}))
    yield engine
    engine.close()


@pytest.mark.parametrize("length", LENGTHS)
def test_under_seesaw_the_samples_fork_as_the_prompt_comes_back_from_the_host_tier(seesaw,
                                                                                    length):
    """The prompt's prefill goes to the host tier with its samples waiting on it; they fork
    when it is swapped back in, sharing its blocks: the prompt is computed once (prefill
    tokens: the prompt and the n - 1 last tokens again, as under the other policies). Greedy
    samples equal the greedy n=1 output, seeded sample i an n=1 request seeded seed + i."""
    ids = prompt(length, first=3000 + length)  # a prompt of its own: no prefix cache hit
    seesaw.reset_stats()
    out = one(seesaw, ids, SamplingParams(temperature=0.0, max_tokens=10, n=8))
    stats = seesaw.stats()
    single = one(seesaw, ids, SamplingParams(temperature=0.0, max_tokens=10)).outputs[0]
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 8
    assert stats["prefill_tokens"] == length + 7 and stats["forked_samples"] == 7
    assert stats["swap_in_bytes"] > 0 and held(seesaw) == 0  # through the host tier
    sampled, seed = dict(temperature=1.0, max_tokens=8), 1234
    got = one(seesaw, ids, SamplingParams(n=4, seed=seed, **sampled)).outputs
    alone = [one(seesaw, ids, SamplingParams(seed=seed + i, **sampled)).outputs[0]
             for i in range(4)]
    assert [c.token_ids for c in got] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in got}) > 1 and held(seesaw) == 0


@pytest.mark.parametrize("sampler", ["device", "host"])
def test_samples_keep_their_own_penalty_state_and_logprobs(tiny_smollm2, tiny, sampler):
    """Penalties count each sample's own outputs (its slot's state starts from the prompt),
    on the device sampler and the host one; logprobs come per sample."""
    from conftest import ENGINE_KWARGS

    engine = tiny if sampler == "device" else Engine(EngineConfig(
        **{**ENGINE_KWARGS, "model": tiny_smollm2, "sampler": "host"}))
    try:
        ids = prompt(37, first=9000)
        params = dict(temperature=0.9, max_tokens=10, repetition_penalty=1.3, logprobs=2,
                      presence_penalty=0.5, frequency_penalty=0.4)
        out = one(engine, ids, SamplingParams(n=3, seed=11, **params)).outputs
        alone = [one(engine, ids, SamplingParams(seed=11 + i, **params)).outputs[0]
                 for i in range(3)]
        assert [c.token_ids for c in out] == [a.token_ids for a in alone]
        for got, want in zip(out, alone, strict=True):
            assert [list(e) for e in got.logprobs] == [list(e) for e in want.logprobs]
            assert [v for e in got.logprobs for v in e.values()] == pytest.approx(
                [v for e in want.logprobs for v in e.values()], abs=1e-4)
    finally:
        if engine is not tiny:
            engine.close()
