"""The one sequence-to-output path (jaxpipe/request/outputs.py): `Completion.to_output` in
isolation, and `Engine.pop_output` / `generate` / `stream` on the shared SmolLM2 engine, every
field of the vLLM-shaped result checked against the tokenizer's plain decode and string
operations; the streamed deltas are the same whether stop strings are checked on the
detokenizer worker or on the engine's thread."""

from __future__ import annotations

import pytest

from jaxpipe import SamplingParams
from jaxpipe.request.outputs import Completion, TokenDelta
from jaxpipe.request.validate import Prepared

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ---- Completion.to_output, no engine -----------------------------------------------------------


def test_to_output_turns_logprob_lists_into_one_dict_per_token_sampled_first():
    prep = Prepared([5, 6, 7], SamplingParams(logprobs=2), {})
    c = Completion(prep, None)
    c.add(TokenDelta("r", [9], [[[9, -1.5], [3, -0.25], [4, -2.0]]]))
    c.add(TokenDelta("r", [3], [[[3, -0.5], [1, -1.0]]], "stop", 3))
    out = c.to_output("r", "the prompt", {"arrival": 1.0})
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished, out.metrics) == (
        "r", "the prompt", [5, 6, 7], True, {"arrival": 1.0})
    [o] = out.outputs
    assert (o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason) == (
        0, "", [9, 3], "stop", 3)
    assert o.logprobs == [{9: -1.5, 3: -0.25, 4: -2.0}, {3: -0.5, 1: -1.0}]
    assert [next(iter(entry)) for entry in o.logprobs] == [9, 3]  # the sampled token first


def test_to_output_has_no_logprobs_unless_asked():
    c = Completion(Prepared([1], SamplingParams(), {}), None)
    c.add(TokenDelta("r", [2, 3], None, "length"))
    [o] = c.to_output("r", None, {}).outputs
    assert o.logprobs is None and o.finish_reason == "length" and o.stop_reason is None


# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poem(engine) -> list[int]:
    text = engine.tokenizer.apply_chat_template(POEM, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def plain(engine, poem):
    [out] = engine.generate(prompt_token_ids=[poem], sampling_params=greedy())
    return out


def test_generate_fills_every_field(engine, poem, plain):
    assert plain.prompt is None and plain.prompt_token_ids == poem and plain.finished
    [o] = plain.outputs
    assert o.index == 0 and o.finish_reason == "length" and o.stop_reason is None
    assert o.text == engine.tokenizer.decode(o.token_ids, True)
    m = plain.metrics
    assert sorted(m) == ["arrival", "finished", "first_token"]
    assert m["arrival"] <= m["first_token"] <= m["finished"]


def test_a_text_prompt_is_kept_and_special_tokens_are_shown_when_asked(engine):
    [out] = engine.generate("Once upon a time", greedy(6, skip_special_tokens=False))
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == engine.tokenizer.encode("Once upon a time")
    [o] = out.outputs
    assert o.text == engine.tokenizer.decode(o.token_ids, False)


@pytest.mark.parametrize("worker", [True, False], ids=["worker", "inline"])
def test_a_stop_string_cuts_text_ids_and_logprobs(engine, poem, plain, worker):
    text = plain.outputs[0].text
    stop = text.split()[5]
    engine.set_detok_worker(worker)
    try:
        [out] = engine.generate(prompt_token_ids=[poem], sampling_params=greedy(
            stop=[stop], logprobs=2))
    finally:
        engine.set_detok_worker(True)
    [o] = out.outputs
    assert o.text == text[:text.index(stop)]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    k = len(o.token_ids)
    assert o.token_ids == plain.outputs[0].token_ids[:k]
    decode = engine.tokenizer.decode
    assert stop in decode(o.token_ids, True) and stop not in decode(o.token_ids[:-1], True)
    assert len(o.logprobs) == k
    for token, entry in zip(o.token_ids, o.logprobs, strict=True):
        assert next(iter(entry)) == token and len(entry) == 2  # greedy: the sampled is top
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in entry.items())


def test_pop_output_matches_generate(engine, poem, plain):
    rid = engine.add_request(prompt_token_ids=poem, params=greedy(), request_id="popped")
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    assert out.request_id == "popped"
    assert out.outputs == plain.outputs and out.prompt_token_ids == plain.prompt_token_ids


def _stream(engine, ids, params, worker: bool) -> list[tuple]:
    engine.set_detok_worker(worker)
    try:
        return [(tuple(d.token_ids), d.text, d.finish_reason) for d in engine.stream(ids, params)]
    finally:
        engine.set_detok_worker(True)


def test_stream_text_grows_with_its_tokens(engine, poem, plain):
    """No stop strings: nothing is held back; after each delta the text so far is the
    decode of the tokens so far (the poem is plain ASCII, so no character spans deltas)."""
    deltas = _stream(engine, poem, greedy(), worker=True)
    tokens, text = [], ""
    for ids, new, _ in deltas:
        tokens += ids
        text += new
        assert text == engine.tokenizer.decode(tokens, True)
    assert tokens == plain.outputs[0].token_ids and text == plain.outputs[0].text
    assert [d[2] for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_stream_with_a_stop_string_is_the_same_on_the_worker_and_inline(engine, poem, plain):
    """The worker finds the match a step late; the stream waits for the cut, so its deltas
    (tokens, text boundaries, finish) are those of the check on the engine's thread."""
    text = plain.outputs[0].text
    stop = text.split()[5]
    on = _stream(engine, poem, greedy(stop=[stop]), worker=True)
    off = _stream(engine, poem, greedy(stop=[stop]), worker=False)
    assert on == off
    assert "".join(d[1] for d in on) == text[:text.index(stop)]
    assert on[-1][2] == "stop" and on[-1][0]  # the stop's token comes with the finish
    shown = ""
    for _, new, _ in on[:-1]:  # running: the last len(stop) - 1 characters are held back
        shown += new
        assert text.startswith(shown)
