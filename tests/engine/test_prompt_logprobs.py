"""`SamplingParams.prompt_logprobs` against HF transformers' log-softmax over the prompt (f32,
within 1e-4): each prompt token's logprob and rank and the top k, for a single-shot prefill,
a prefill chunked into 7-token steps and a second identical request (which a prefix-cache read
would serve), on SmolLM2 and a tiny checkpoint of every other family; a prompt scored
without output (max_tokens=0); the prefix cache left exact for the plain requests after."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_families  # noqa: E402
import hf_moe  # noqa: E402
from conftest import ENGINE_KWARGS  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.scheduler import Kind, Preempt, make_policy  # noqa: E402

ATOL = 1e-4
K = 5
CHUNK = 7
FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
TINY = dict(dtype="float32", max_model_len=128, max_num_seqs=2, warmup=False,
            show_progress=False)
# 41 tokens: two full cached blocks, and a last chunk of 6 after five of 7.
TINY_PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, hf_families.VOCAB, 41)]
SMOL_TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
             "begins with a single step, and the early bird catches the worm.")

checkpoints = hf_families.checkpoint_fixture(hf_families.write)
moe_checkpoints = hf_families.checkpoint_fixture(hf_moe.write)


def assert_matches_hf(out, ids: list[int], want: np.ndarray, k: int = K) -> None:
    """`out.prompt_logprobs` / `prompt_ranks` are `want`'s (position t - 1 scores token t)."""
    got, ranks = out.prompt_logprobs, out.prompt_ranks
    assert len(got) == len(ids) and got[0] is None and ranks[0] is None
    for t in range(1, len(ids)):
        row, entry = want[t - 1], got[t]
        keys = list(entry)
        assert keys[0] == ids[t]
        np.testing.assert_allclose([entry[i] for i in keys], row[keys], atol=ATOL, rtol=0)
        top = keys[1:] if len(keys) == k + 1 else keys  # the prompt's token among them or not
        assert len(top) == k
        np.testing.assert_allclose(np.sort(row[top]), np.sort(row)[-k:], atol=ATOL, rtol=0)
        value = row[ids[t]]
        assert 1 + np.sum(row > value + ATOL) <= ranks[t] <= 1 + np.sum(row > value - ATOL)


def scored(engine, ids: list[int], max_tokens: int = 3, k: int = K):
    [out] = engine.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=max_tokens, prompt_logprobs=k))
    return out


def chunked(engine: Engine) -> Engine:
    """`engine` prefilling at most CHUNK prompt tokens a step (below the smallest step
    budget EngineConfig takes)."""
    engine.executor.policy = make_policy("prefill_first", max_prefill_tokens=CHUNK)
    return engine


def check_engine(engine, ids: list[int], want: np.ndarray, chunks: int = 1) -> None:
    """A request scores its prompt exactly (prefilled in `chunks` steps); a second identical
    one (a prefix-cache hit for a plain request) too, reading no cached block; the plain
    request after it reads the cached prefix and generates what it generates with the cache
    cold."""
    before = engine.stats()["prefill_chunks"]
    first = scored(engine, ids)
    assert engine.stats()["prefill_chunks"] - before == chunks
    assert_matches_hf(first, ids, want)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    second = scored(engine, ids)
    assert_matches_hf(second, ids, want)
    assert engine.stats()["prefix_cache_hit_tokens"] == hits
    [plain] = engine.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=3))
    assert plain.prompt_logprobs is None
    assert engine.stats()["prefix_cache_hit_tokens"] > hits
    assert plain.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.fixture(scope="module")
def smol_ids(hf_tokenizer):
    return hf_tokenizer.encode(SMOL_TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def smol_want(hf_model, smol_ids):
    return hf_families.hf_log_softmax(hf_model, smol_ids)


def test_smollm2_single_shot(engine, smol_ids, smol_want):
    assert_matches_hf(scored(engine, smol_ids), smol_ids, smol_want)


def test_smollm2_chunked_and_cache_hit(smol_ids, smol_want):
    engine = chunked(Engine(EngineConfig(**{**ENGINE_KWARGS, "max_num_seqs": 1})))
    try:
        check_engine(engine, smol_ids, smol_want, chunks=-(-len(smol_ids) // CHUNK))
    finally:
        engine.close()


def test_scoring_without_output(engine, smol_ids, smol_want):
    """max_tokens=0: the prompt is scored, nothing is generated, the finish is "length"."""
    out = scored(engine, smol_ids, max_tokens=0, k=1)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert_matches_hf(out, smol_ids, smol_want, k=1)


@pytest.mark.parametrize("writer,name", [("checkpoints", n) for n in FAMILIES]
                         + [("moe_checkpoints", n) for n in MOE_FAMILIES],
                         ids=[*FAMILIES, *MOE_FAMILIES])
@pytest.mark.parametrize("chunk", [False, True], ids=["single_shot", "chunk7"])
def test_families(request, writer, name, chunk):
    """Every other family, dense (hf_families) and MoE (hf_moe), against HF."""
    _, model, path = request.getfixturevalue(writer)(name)
    want = hf_families.hf_log_softmax(model, TINY_PROMPT)
    engine = Engine(EngineConfig(model=str(path), **TINY))
    try:
        if chunk:
            chunked(engine)
        check_engine(engine, TINY_PROMPT, want, -(-len(TINY_PROMPT) // CHUNK) if chunk else 1)
    finally:
        engine.close()


@pytest.mark.parametrize("settings", [dict(sampler="host"), dict(overlap=False)],
                         ids=["host_sampler", "no_overlap"])
def test_host_sampler_and_no_overlap(checkpoints, settings):
    """The host sampler's steps and steps landed one by one carry the scores alike."""
    _, model, path = checkpoints("qwen2")
    engine = chunked(Engine(EngineConfig(model=str(path), **TINY, **settings)))
    try:
        out = scored(engine, TINY_PROMPT)
    finally:
        engine.close()
    assert_matches_hf(out, TINY_PROMPT, hf_families.hf_log_softmax(model, TINY_PROMPT))


class RecomputeTwice:
    """7-token chunks; the first sequence is preempted by recompute (its KV dropped, its
    prompt and outputs prefilled again) once mid-prefill and once while it decodes."""

    depth = 1

    def __init__(self):
        self.inner = make_policy("prefill_first", max_prefill_tokens=CHUNK)
        self.victims: list[str] = []

    def schedule(self, state):
        action = self.inner.schedule(state)
        if action is None or action.kind is not Kind.RUN:
            return action
        for seq in [s for s, _ in action.prefill] + action.decode:
            first = len(self.victims) == 0 and seq.computed >= 2 * CHUNK
            if first or (len(self.victims) == 1 and seq.generated == 2):
                self.victims.append(seq.seq_id)
                return Preempt([seq], "recompute")
        return action

    def landed(self, run, finished, state):
        self.inner.landed(run, finished, state)


def test_recompute_preemption_neither_loses_nor_repeats_entries(checkpoints):
    _, model, path = checkpoints("qwen2")
    engine = Engine(EngineConfig(model=str(path), **TINY))
    try:
        engine.executor.policy = policy = RecomputeTwice()
        out = scored(engine, TINY_PROMPT, max_tokens=4)
        assert len(policy.victims) == 2 and engine.stats()["preemptions"] == 2
        assert engine.stats()["prefill_tokens"] > 2 * len(TINY_PROMPT)
    finally:
        engine.close()
    assert_matches_hf(out, TINY_PROMPT, hf_families.hf_log_softmax(model, TINY_PROMPT))


def test_a_one_token_prompt_has_nothing_to_score(engine):
    out = scored(engine, [504], max_tokens=1)
    assert out.prompt_logprobs == [None] and out.prompt_ranks == [None]
    assert len(out.outputs[0].token_ids) == 1


def test_prompt_logprobs_and_max_tokens_are_checked():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1 or None"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    with pytest.raises(ValueError, match="min_tokens must be in"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, min_tokens=1)
