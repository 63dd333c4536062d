"""The public Engine contract on one shared f32 SmolLM2 engine: lengths, stop conditions,
logprobs, streaming and input validation; with the same settings on the two-layer SmolLM2 of
tests/conftest.py, the claims whose reference is the same engine (seeded sampling, penalties,
continuous batching, overlap on and off, a context filled exactly); and, on a tiny
random-weight model, that an engine keeps nothing of the requests whose outputs it handed out.

Expected outputs are never hard-coded from a jaxpipe run: each test derives them from a plain
greedy run and Python string / list operations (exact-token parity with HF is in
tests/model/test_llama_hf.py)."""

from __future__ import annotations

import gc
import math
import random

import pytest

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.config.model import ModelConfig
from jaxpipe.model import decoder, orbax_dir
from jaxpipe.scheduler import SeqInfo

EOS = 2  # <|im_end|>
PLAIN_TOKENS = 24

QUESTION = [{"role": "user", "content": "What is 2+2?"}]  # greedy answer ends with EOS
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]  # runs to the limit
GREETING = [{"role": "user", "content": "Hi"}]
RAW_TEXT = "The quick brown fox"

BATCH_PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "A list of fruits: apple, banana,",
    "In 1492, Columbus",
    "The opposite of hot is",
    "def add(a, b):",
    "Roses are red, violets are",
    "The largest planet in our solar system is",
    "Photosynthesis converts",
    "My favourite book is",
    "Once upon a time",
    "E = mc",
]


def greedy(max_tokens: int = PLAIN_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def chat_ids(engine, conversation) -> list[int]:
    text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(engine, ids: list[int], params: SamplingParams):
    """One request by token ids; returns its CompletionOutput."""
    [out] = engine.generate(prompt_token_ids=[ids], sampling_params=params)
    return out.outputs[0]


@pytest.fixture(scope="module")
def prompts(engine) -> dict[str, list[int]]:
    return {"question": chat_ids(engine, QUESTION), "poem": chat_ids(engine, POEM),
            "greeting": chat_ids(engine, GREETING), "raw": engine.tokenizer.encode(RAW_TEXT)}


@pytest.fixture(scope="module")
def plain(engine, prompts):
    """Greedy, 24-token outputs of every prompt in one batch: name -> CompletionOutput."""
    outs = engine.generate(prompt_token_ids=list(prompts.values()), sampling_params=greedy())
    return {name: o.outputs[0] for name, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def eos_index(plain) -> int:
    """Position of EOS in the greedy answer to QUESTION (a precondition of several tests)."""
    tokens = plain["question"].token_ids
    assert tokens[-1] == EOS and len(tokens) < PLAIN_TOKENS, "QUESTION must end with EOS"
    return len(tokens) - 1


@pytest.fixture(scope="module")
def tiny_text(tiny_smollm2):
    """The shared engine's settings on the two-layer SmolLM2 of tests/conftest.py (random
    weights, SmolLM2's tokenizer): for the claims whose reference is the same engine (seeds,
    penalties, a batch against one request at a time; SmolLM2-135M's batch of more prompts
    than rows against HF one at a time: tests/model/test_llama_hf.py)."""
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2}))
    yield engine
    engine.close()


# ---- driving the engine step by step ---------------------------------------------------------


def test_pop_output_of_a_stepped_request(engine, prompts, plain):
    rid = engine.add_request(prompt_token_ids=prompts["poem"], params=greedy(6))
    with pytest.raises(RuntimeError, match="not finished"):
        engine.pop_output(rid)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    assert out.request_id == rid and out.finished
    assert out.outputs[0].token_ids == plain["poem"].token_ids[:6]
    with pytest.raises(KeyError, match=rid):
        engine.pop_output(rid)


# ---- lengths and stop conditions --------------------------------------------------------------


def test_plain_run_to_the_limit_finishes_with_length(plain):
    poem = plain["poem"]
    assert len(poem.token_ids) == PLAIN_TOKENS
    assert EOS not in poem.token_ids
    assert poem.finish_reason == "length" and poem.stop_reason is None


def test_max_tokens_gives_exact_prefix(engine, prompts, plain):
    out = run(engine, prompts["poem"], greedy(5))
    assert out.token_ids == plain["poem"].token_ids[:5]
    assert out.finish_reason == "length"


def test_eos_stops_with_stop_and_no_special_text(plain, eos_index):
    out = plain["question"]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert EOS not in out.token_ids[:eos_index]
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_ignore_eos_continues_past_eos(engine, prompts, plain, eos_index):
    out = run(engine, prompts["question"], greedy(eos_index + 5, ignore_eos=True))
    assert len(out.token_ids) == eos_index + 5
    assert out.token_ids[:eos_index + 1] == plain["question"].token_ids
    assert out.finish_reason == "length"


def _first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """(position, id) of the first token at or after `start` that does not occur before it."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k, tokens[k]
    raise AssertionError("no suitable token in the plain run")


def test_stop_token_ids_cut_after_the_token(engine, prompts, plain):
    tokens = plain["poem"].token_ids
    k, token = _first_new_token(tokens, 6)
    out = run(engine, prompts["poem"], greedy(stop_token_ids=[token]))
    assert out.token_ids == tokens[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def _stop_string(text: str) -> str:
    """A 6-character piece from the middle of `text`."""
    start = len(text) // 2
    return text[start:start + 6]


def test_stop_string_cuts_text_before_it(engine, prompts, plain):
    text = plain["poem"].text
    stop = _stop_string(text)
    out = run(engine, prompts["poem"], greedy(stop=[stop]))
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == plain["poem"].token_ids[:len(out.token_ids)]


def test_min_tokens_bans_eos_until_reached(engine, prompts, plain, eos_index):
    min_tokens = eos_index + 4
    out = run(engine, prompts["question"], greedy(min_tokens + 2, min_tokens=min_tokens))
    assert len(out.token_ids) >= min_tokens
    assert EOS not in out.token_ids[:min_tokens]
    # Banning EOS does not change the earlier greedy choices (EOS was not their argmax).
    assert out.token_ids[:eos_index] == plain["question"].token_ids[:eos_index]


# ---- sampling ---------------------------------------------------------------------------------


def sampled(seed: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=8, **kwargs)


# Seeds and penalties act on the logits, whatever the model: their reference is the same
# engine, here the two-layer SmolLM2 (`tiny_text`), whose step programs compile in moments
# (on SmolLM2-135M each new batch shape or sampling mix compiles 30 layers).


@pytest.fixture(scope="module")
def tiny_prompts(tiny_text) -> dict[str, list[int]]:
    """The `prompts` on its tokenizer (the same one), in the same order."""
    return {"question": chat_ids(tiny_text, QUESTION), "poem": chat_ids(tiny_text, POEM),
            "greeting": chat_ids(tiny_text, GREETING), "raw": tiny_text.tokenizer.encode(RAW_TEXT)}


@pytest.fixture(scope="module")
def seeded_alone(tiny_text, tiny_prompts):
    return run(tiny_text, tiny_prompts["poem"], sampled(1234)).token_ids


def test_seeded_sampling_is_batch_independent(tiny_text, tiny_prompts, seeded_alone):
    ids = [tiny_prompts["raw"], tiny_prompts["poem"], tiny_prompts["greeting"]]
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=3), sampled(1234),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=12)]
    outs = tiny_text.generate(prompt_token_ids=ids, sampling_params=params)
    assert outs[1].outputs[0].token_ids == seeded_alone


def test_seeded_sampling_repeats(tiny_text, tiny_prompts, seeded_alone):
    assert run(tiny_text, tiny_prompts["poem"], sampled(1234)).token_ids == seeded_alone


def test_different_seeds_differ(tiny_text, tiny_prompts, seeded_alone):
    assert run(tiny_text, tiny_prompts["poem"], sampled(4321)).token_ids != seeded_alone


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-9)],
                         ids=["top_k=1", "min_p=1", "top_p=1e-9"])
def test_filters_that_keep_one_token_are_greedy(engine, prompts, plain, filters):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, **filters)
    assert run(engine, prompts["poem"], params).token_ids == plain["poem"].token_ids[:6]


def penalised(max_tokens: int = 16) -> SamplingParams:
    return greedy(max_tokens, repetition_penalty=1.3, frequency_penalty=0.5,
                  presence_penalty=0.5)


def test_penalties_change_the_output_and_are_per_request(tiny_text, tiny_prompts):
    poem = tiny_prompts["poem"]
    plain = run(tiny_text, poem, greedy(16)).token_ids
    alone = run(tiny_text, poem, penalised()).token_ids
    assert alone != plain
    outs = tiny_text.generate(prompt_token_ids=[tiny_prompts["raw"], poem, poem],
                              sampling_params=[penalised(20), penalised(), greedy(16)])
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].token_ids == plain


# ---- logprobs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_logprobs(engine, prompts):
    """(greedy top-5, sampled top-3, greedy top-0) on the poem prompt, one batch."""
    params = [greedy(6, logprobs=5), sampled(99, logprobs=3), greedy(6, logprobs=0)]
    outs = engine.generate(prompt_token_ids=[prompts["poem"]] * 3, sampling_params=params)
    return [o.outputs[0] for o in outs]


def _check_entries(out, n: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry
        assert all(lp <= 0.0 for lp in entry.values())
        assert n <= len(entry) <= n + 1  # top n, plus the sampled token if not among them
        assert math.fsum(math.exp(lp) for lp in entry.values()) <= 1.0 + 1e-5


def test_greedy_logprobs_top_n_and_argmax(with_logprobs, plain):
    out = with_logprobs[0]
    assert out.token_ids == plain["poem"].token_ids[:6]
    _check_entries(out, 5)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert len(entry) == 5
        assert entry[token] == max(entry.values())


def test_sampled_logprobs_contain_the_sampled_token(with_logprobs):
    _check_entries(with_logprobs[1], 3)


def test_zero_logprobs_gives_only_the_sampled_token(with_logprobs):
    out = with_logprobs[2]
    _check_entries(out, 0)
    assert all(len(entry) == 1 for entry in out.logprobs)
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(
        with_logprobs[0].logprobs[0][out.token_ids[0]], abs=1e-6)


def test_no_logprobs_by_default(plain):
    assert plain["poem"].logprobs is None


# ---- streaming --------------------------------------------------------------------------------


def _collect(engine, ids, params):
    deltas = list(engine.stream(ids, params))
    tokens = [t for d in deltas for t in d.token_ids]
    return deltas, tokens, "".join(d.text for d in deltas)


def test_stream_concatenates_to_generate(engine, prompts, plain):
    deltas, tokens, text = _collect(engine, prompts["question"], greedy())
    assert tokens == plain["question"].token_ids
    assert text == plain["question"].text
    assert deltas[-1].finish_reason == "stop"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert len({d.request_id for d in deltas}) == 1


def test_stream_with_stop_string_matches_generate(engine, prompts, plain):
    text = plain["poem"].text
    stop = _stop_string(text)
    _, tokens, streamed = _collect(engine, prompts["poem"], greedy(stop=[stop]))
    assert streamed == text[:text.index(stop)]
    assert tokens == plain["poem"].token_ids[:len(tokens)]


def test_stream_accepts_text(engine, plain):
    _, tokens, _ = _collect(engine, RAW_TEXT, greedy(4))
    assert tokens == plain["raw"].token_ids[:4]


def test_closing_a_stream_early_aborts_the_request(engine, prompts):
    stream = engine.stream(prompts["poem"], greedy())
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    stream.close()
    assert not engine.has_unfinished()


# ---- batching ---------------------------------------------------------------------------------


def batch_params() -> list[SamplingParams]:
    """Different lengths, so that requests finish (and free slots) at different steps."""
    return [greedy(2 + (i * 5) % 7) for i in range(len(BATCH_PROMPTS))]


@pytest.fixture(scope="module")
def big_batch(tiny_text):
    """More prompts than max_num_seqs, in one generate call; plus the stats delta."""
    assert len(BATCH_PROMPTS) > tiny_text.config.max_num_seqs
    before = tiny_text.stats()
    outs = tiny_text.generate(BATCH_PROMPTS, batch_params())
    return outs, before, tiny_text.stats()


def test_outputs_in_input_order_with_distinct_ids(tiny_text, big_batch):
    outs, _, _ = big_batch
    assert [o.prompt for o in outs] == BATCH_PROMPTS
    assert [o.prompt_token_ids for o in outs] == [tiny_text.tokenizer.encode(p)
                                                  for p in BATCH_PROMPTS]
    assert len({o.request_id for o in outs}) == len(outs)
    assert all(o.finished for o in outs)


def test_continuous_batching_matches_one_at_a_time(tiny_text, big_batch):
    outs, _, _ = big_batch
    for prompt, params, out in zip(BATCH_PROMPTS, batch_params(), outs, strict=True):
        [alone] = tiny_text.generate(prompt, params)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prompt
        assert out.outputs[0].text == alone.outputs[0].text
        assert len(out.outputs[0].token_ids) <= params.max_tokens


def test_stats_count_the_batch(big_batch):
    outs, before, after = big_batch
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert after["finished_requests"] - before["finished_requests"] == len(outs)
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(
        len(o.prompt_token_ids) for o in outs)


def test_flat_token_list_is_one_prompt(engine, prompts, plain):
    [out] = engine.generate(prompt_token_ids=prompts["poem"], sampling_params=greedy(2))
    assert out.prompt_token_ids == prompts["poem"]
    assert out.outputs[0].token_ids == plain["poem"].token_ids[:2]


def test_chat_accepts_a_single_conversation(engine, plain):
    [out] = engine.chat(QUESTION, greedy())
    assert out.outputs[0].token_ids == plain["question"].token_ids


# ---- invalid input ----------------------------------------------------------------------------


INVALID_REQUESTS = {
    "empty token prompt": (dict(prompt_token_ids=[[]]), "empty"),
    "empty text prompt": (dict(prompts=[""]), "empty"),
    "token id = vocab size": (dict(prompt_token_ids=[[1, 49152]]), "vocabulary"),
    "negative token id": (dict(prompt_token_ids=[[1, -1]]), "vocabulary"),
    "prompt too long": (dict(prompt_token_ids=[[1] * 300]), "max_model_len"),
    "prompt fills context": (dict(prompt_token_ids=[[1] * 256]), "max_model_len"),
    "max_tokens overflows": (dict(prompt_token_ids=[[1] * 10],
                                  sampling_params=SamplingParams(max_tokens=247)), "max_tokens"),
    "too many params": (dict(prompts=["a", "b"], sampling_params=[SamplingParams()] * 3),
                        "sampling params"),
    "too few params": (dict(prompts=["a", "b", "c"], sampling_params=[SamplingParams()] * 2),
                       "sampling params"),
    "both prompts and ids": (dict(prompts=["a"], prompt_token_ids=[[1]]), "exactly one"),
    "neither prompts nor ids": (dict(), "exactly one"),
}


@pytest.mark.parametrize("kwargs, match", list(INVALID_REQUESTS.values()),
                         ids=list(INVALID_REQUESTS))
def test_invalid_request_raises_and_queues_nothing(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert not engine.has_unfinished()


def test_invalid_prompt_later_in_batch_queues_nothing(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(prompt_token_ids=[[1, 2, 3], [1, 10**6]], sampling_params=greedy(4))
    assert not engine.has_unfinished()


def test_max_tokens_exactly_filling_context_is_accepted(tiny_text):
    # the shared engine's max_model_len on the two-layer model: a 254-token step compiles
    # in moments there
    out = run(tiny_text, [1] * 254, greedy(2))
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_engine_usable_after_errors(engine, prompts, plain):
    for kwargs, _ in INVALID_REQUESTS.values():
        with pytest.raises(ValueError):
            engine.generate(**kwargs)
    assert run(engine, prompts["poem"], greedy(3)).token_ids == plain["poem"].token_ids[:3]


INVALID_PARAMS = [  # (kwargs, the field the error must name)
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(seed=-1), "seed"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-5]), "stop_token_ids"),
    (dict(n=0), "n"),
]


@pytest.mark.parametrize("kwargs, field", INVALID_PARAMS, ids=[repr(k) for k, _ in INVALID_PARAMS])
def test_invalid_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_reject_wrong_types():
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature="hot")
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=3.5)


@pytest.mark.slow  # a second SmolLM2 engine; `make test` keeps the claim: each attention gives
# HF's tokens (tests/model/test_paths_parity.py::test_f32_greedy_matches_hf_with_each_attention)
def test_xla_attention_fallback_gives_the_same_tokens(engine, prompts, plain):
    """The kernel and the XLA fallback are two implementations of one contract."""
    from conftest import ENGINE_KWARGS

    from jaxpipe import Engine, EngineConfig

    assert engine.runner.attention == "cpu", "the shared engine should use the kernel on CPU"
    fallback = Engine(EngineConfig(**{**ENGINE_KWARGS, "attention": "xla"}))
    assert fallback.runner.attention == "xla"
    outs = fallback.generate(prompt_token_ids=list(prompts.values()), sampling_params=greedy())
    assert [o.outputs[0].token_ids for o in outs] == [plain[n].token_ids for n in prompts]


# ---- overlap on and off -------------------------------------------------------------------------


def test_overlap_on_and_off_give_the_same_outputs(tiny_text, tiny_prompts):
    """Every output field, for every kind of request in one batch, with the engine's steps
    overlapped (the default) and landed one by one (the same engine is the reference: the
    two-layer SmolLM2)."""
    ids = list(tiny_prompts.values())
    poem = run(tiny_text, tiny_prompts["poem"], greedy()).token_ids
    params = [greedy(), greedy(20, stop=["sea"]), sampled(7, logprobs=2),
              greedy(16, repetition_penalty=1.3, frequency_penalty=0.5),
              sampled(11, min_tokens=4, presence_penalty=0.7),
              greedy(12, stop_token_ids=[poem[5]], logprobs=1)]
    prompt_ids = [ids[i % len(ids)] for i in range(len(params))]
    assert prompt_ids[-1] == tiny_prompts["poem"]  # so the last one stops at its token

    def outputs(overlap: bool):
        tiny_text.set_overlap(overlap)
        try:
            outs = tiny_text.generate(prompt_token_ids=prompt_ids, sampling_params=params)
        finally:
            tiny_text.set_overlap(True)
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                 o.outputs[0].stop_reason, o.outputs[0].logprobs) for o in outs]

    # With the prefix cache on (the default), a call finds the prompts an earlier one cached
    # and prefills only the rest: a different chunking, the same tokens, logprobs a few ulps
    # apart. A first call caches every prompt, so the two compared calls chunk alike.
    outputs(True)
    on, off = outputs(True), outputs(False)
    assert on == off
    assert {o[2] for o in on} == {"stop", "length"}


# ---- stop strings on the detokenizer worker -----------------------------------------------------


def test_a_stop_string_the_worker_finds_late_cuts_the_request_back(engine, prompts, plain,
                                                                 monkeypatch):
    """The worker lags (slowed down here): the engine generates past the token that completed
    the stop string, then cuts back to it. Same output as the check on the engine's thread."""
    import time

    from jaxpipe.request import stopping

    word = plain["poem"].text.split()[6]
    params = greedy(PLAIN_TOKENS, stop=[word], logprobs=1)
    engine.set_detok_worker(False)  # checked inline, on the engine's thread
    try:
        inline = run(engine, prompts["poem"], params)
    finally:
        engine.set_detok_worker(True)
    push, settle, cuts = stopping.StopChecker._push_one, stopping.StopChecker.settle, []

    def slow_push(self, *args):
        time.sleep(0.05)
        return push(self, *args)

    def recording_settle(self, seq, reason):
        had = len(seq.output_token_ids)
        out = settle(self, seq, reason)
        cuts.append(had - len(seq.output_token_ids))
        return out

    monkeypatch.setattr(stopping.StopChecker, "_push_one", slow_push)
    monkeypatch.setattr(stopping.StopChecker, "settle", recording_settle)
    engine.reset_stats()
    late = run(engine, prompts["poem"], params)
    assert inline.finish_reason == "stop" and inline.stop_reason == word
    assert (late.token_ids, late.text, late.finish_reason, late.stop_reason, late.logprobs) == (
        inline.token_ids, inline.text, inline.finish_reason, inline.stop_reason,
        inline.logprobs)
    assert cuts and cuts[0] > 0  # it really ran ahead and was cut back
    assert engine.stats()["generated_tokens"] == len(late.token_ids)


def test_a_stop_on_the_token_before_the_last_does_not_free_the_sequence_twice(engine):
    """With overlap, a sequence whose next token is certainly its last (max_tokens) is freed
    when that step is dispatched; if the token before it (still in flight then) turns out to
    be a stop id, the sequence ends there, and must not be freed again (the soak found this:
    "finished sequence ... is not running" took the engine process down)."""
    prompt = "List the first ten prime numbers:"
    ref = engine.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(3, 7) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0.0, max_tokens=stop_at + 2,
                            stop_token_ids=[ref[stop_at]])
    for _ in range(3):  # alone, and beside other requests
        outs = engine.generate([prompt, "Hello", "One two three"], [params, greedy(5), greedy(9)],
                               use_tqdm=False)
        first = outs[0].outputs[0]
        assert first.token_ids == ref[:stop_at + 1] and first.finish_reason == "stop"
    assert not engine.has_unfinished()


# ---- nothing kept after a request ends -------------------------------------------------------

# Prime sizes as in tests/multidevice; two layers: compiled and stepped in moments.
TINY = ModelConfig(vocab_size=251, hidden_size=37, intermediate_size=53, num_layers=2,
                   num_heads=14, num_kv_heads=7, head_dim=6, tie_embeddings=False,
                   max_position_embeddings=64, eos_token_ids=(250,))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An engine on TINY's random weights (no tokenizer): 16 rows, steps of up to 32 tokens."""
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    orbax_dir.save_orbax(path, TINY, decoder.numpy_random_values(TINY, seed=0), "float32")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=32,
                                 max_num_seqs=16, max_num_batched_tokens=32, warmup=False,
                                 show_progress=False))
    yield engine
    engine.close()


def requests_alive() -> int:
    gc.collect()
    return sum(isinstance(o, SeqInfo) for o in gc.get_objects())


def test_an_engine_keeps_nothing_of_the_requests_it_served(tiny):
    """2,000 short requests through one engine: once their outputs are handed out, no more
    request records are alive than one batch holds (here none), and the scheduler state
    only counts the finished ones."""
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(rng.randint(1, 4))] for _ in range(2000)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 4), ignore_eos=True)
              for _ in prompts]
    before = requests_alive()
    outputs = tiny.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert requests_alive() - before <= tiny.max_num_seqs
    state = tiny.executor.state
    assert state.num_finished == 2000 and not state.has_work()
