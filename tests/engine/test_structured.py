"""Structured outputs in the engine (`engine/structured.py`, `request/grammar.py`): every token
a constrained request samples is one its grammar allows, checked by llguidance's own matcher
built here from HF's tokenizer (independent of the engine's masks); a greedy constrained run
equals HF transformers' greedy decoding with its logits masked by that matcher; the outputs
hold through overlap on and off, both `constrained_steps`, the host sampler, n samples,
preemption (recompute and swap) and seesaw's host tier; a constraint that does not compile is
refused naming its field, and the engine serves on."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.request.validate import RequestError

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
# The engine's documented JSON style: compact, ", " and ": " separators, no free whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CONSTRAINTS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": r"(yes|no), [a-z]{2,6} [0-9]{1,3}"},
    "choice": {"choice": ["alpha", "beta", "gamma delta"]},
    "grammar": {"grammar": 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/'},
}


def grammar_text(kind: str) -> str:
    """llguidance's grammar of CONSTRAINTS[kind], built here from llguidance alone."""
    value = CONSTRAINTS[kind][kind]
    if kind in ("json", "json_object"):
        schema = SCHEMA if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value))
    return llguidance.LLMatcher.grammar_from_lark(value)


@pytest.fixture(scope="module")
def reference_tokenizer(hf_tokenizer):
    """llguidance's tokenizer read from HF's (not from the engine's)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB, eos_token=EOS)


def matcher(reference_tokenizer, kind: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(reference_tokenizer, grammar_text(kind), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def assert_allowed(reference_tokenizer, kind: str, completion, max_tokens: int) -> None:
    """Each token of `completion` was allowed where it was sampled; a "stop" ends a complete
    output, a "length" is max_tokens long."""
    m = matcher(reference_tokenizer, kind)
    for i, token in enumerate(completion.token_ids):
        assert m.validate_tokens([token]) == 1, (kind, i, token, completion.token_ids)
        assert m.consume_token(token)
    if completion.finish_reason == "stop":
        assert m.is_stopped() or m.is_accepting()
        assert_text_fits(kind, completion.text)
    else:
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == max_tokens


def assert_text_fits(kind: str, text: str) -> None:
    value = CONSTRAINTS[kind][kind]
    if kind == "json":
        out = json.loads(text)
        assert set(out) <= set(SCHEMA["properties"]) and {"name", "age"} <= set(out)
        assert isinstance(out["name"], str) and len(out["name"]) <= 12
        assert isinstance(out["age"], int) and 0 <= out["age"] <= 120
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(value, text)
    elif kind == "choice":
        assert text in value
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text)


def constrained(kind: str, **fields) -> SamplingParams:
    return SamplingParams(structured_outputs=CONSTRAINTS[kind], **fields)


PROMPTS = ["Give me a person as JSON:", "Answer yes or no.", "Pick one:", "Numbers:"]


@pytest.fixture(scope="module")
def tiny(tiny_smollm2):
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2}))
    yield engine
    engine.close()


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_sampled_token_is_allowed_by_the_grammar(tiny, reference_tokenizer, kind):
    """The random two-layer model at temperature 1 strays everywhere the masks let it."""
    params = [constrained(kind, temperature=1.0, max_tokens=40, seed=seed) for seed in range(6)]
    outs = tiny.generate(PROMPTS[:3] * 2, params)
    for out in outs:
        assert_allowed(reference_tokenizer, kind, out.outputs[0], 40)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs) or kind == "json_object"


def hf_masked_greedy(hf_model, reference_tokenizer, kind: str, ids: list[int],
                     max_tokens: int) -> list[int]:
    """HF's greedy tokens with the logits masked by llguidance's matcher, until the grammar
    is complete or max_tokens."""
    import torch

    m, out = matcher(reference_tokenizer, kind), []
    mask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    with torch.no_grad():
        while len(out) < max_tokens and not m.is_stopped():
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            llg_numpy.fill_next_token_bitmask(m, mask)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB]
            token = int(np.argmax(np.where(bits == 1, logits, -np.inf)))
            if token == EOS:
                break
            assert m.consume_token(token)
            out.append(token)
    return out


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_constrained_run_equals_hf_masked_by_the_same_grammar(
        engine, hf_model, hf_tokenizer, reference_tokenizer, kind):
    prompt = {"json": "Describe Alice, who is 30, as JSON:", "regex": "Is water wet?",
              "choice": "Which letter comes first?"}[kind]
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    [out] = engine.generate(prompt_token_ids=[ids],
                            sampling_params=constrained(kind, temperature=0.0, max_tokens=30))
    got = [t for t in out.outputs[0].token_ids if t != EOS]
    assert got == hf_masked_greedy(hf_model, reference_tokenizer, kind, ids, 30)
    assert_text_fits(kind, out.outputs[0].text)


def mixed_run(engine) -> list[list[int]]:
    """Constrained rows of every kind (greedy and seeded) beside unconstrained greedy ones."""
    params = []
    for i, kind in enumerate(sorted(CONSTRAINTS)):
        params.append(constrained(kind, temperature=0.0, max_tokens=24))
        params.append(constrained(kind, temperature=1.0, max_tokens=24, seed=100 + i))
        params.append(SamplingParams(temperature=0.0, max_tokens=36 + i, ignore_eos=True))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def mixed_reference(tiny):
    tiny.set_overlap(False)
    try:
        return mixed_run(tiny)
    finally:
        tiny.set_overlap(True)


def test_overlap_keeps_every_output(tiny, mixed_reference):
    assert mixed_run(tiny) == mixed_reference


@pytest.mark.parametrize("fields", [
    dict(constrained_steps="land"),
    dict(sampler="host"),
    dict(kv_cache_tokens=128, max_model_len=64),  # preemption recomputes
    dict(kv_cache_tokens=128, max_model_len=64, host_kv_tokens=4096),  # swaps to the host tier
    dict(kv_cache_tokens=1024, host_kv_tokens=4096, scheduler="seesaw"),
], ids=["land", "host-sampler", "recompute", "swap", "seesaw"])
def test_outputs_hold_through_every_engine_path(tiny_smollm2, mixed_reference, fields):
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2, **fields}))
    try:
        engine.reset_stats()
        assert mixed_run(engine) == mixed_reference
        if fields.get("kv_cache_tokens") == 128:
            assert engine.stats()["preemptions"] > 0
    finally:
        engine.close()


def test_each_of_n_samples_follows_its_own_grammar_state(tiny, reference_tokenizer):
    [out] = tiny.generate(["Numbers:"], constrained("grammar", temperature=1.0, max_tokens=30,
                                                    n=4, seed=7))
    for c in out.outputs:
        assert_allowed(reference_tokenizer, "grammar", c, 30)
    [alone] = tiny.generate(["Numbers:"], constrained("grammar", temperature=1.0,
                                                      max_tokens=30, seed=9))
    assert out.outputs[2].token_ids == alone.outputs[0].token_ids  # sample i: seed + i


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "bogus"}}, "sampling.structured_outputs.json"),
    ({"regex": "(["}, "sampling.structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "sampling.structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_serves_on(tiny, so,
                                                                                field):
    with pytest.raises(RequestError) as e:
        tiny.add_request("x", SamplingParams(structured_outputs=so))
    assert e.value.field == field
    assert not tiny.has_unfinished()
    [out] = tiny.generate(["Pick one:"], constrained("choice", temperature=0.0))
    assert out.outputs[0].text in CONSTRAINTS["choice"]["choice"]


@pytest.mark.parametrize("so", [{}, {"regex": "a", "choice": ["b"]}, {"xml": "<a/>"},
                                {"choice": []}, {"json": "[1"}])
def test_malformed_structured_outputs_are_refused_naming_the_field(so):
    with pytest.raises((ValueError, TypeError), match="structured_outputs"):
        SamplingParams(structured_outputs=so)
