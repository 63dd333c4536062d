"""Structured-output workloads and their independent checks, shared by the engine tests
(tests/engine/test_structured.py) and the layouts' (tests/multidevice): constraints of every
kind, llguidance matchers built from llguidance alone (and a tokenizer read from HF's), and
checks of the outputs' texts written against the constraints themselves."""

from __future__ import annotations

import json
import re

import llguidance

from jaxpipe import SamplingParams

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


def mixed_run(engine) -> list[list[int]]:
    """Constrained rows of every kind (greedy and seeded) beside unconstrained greedy ones."""
    params = []
    for i, kind in enumerate(sorted(CONSTRAINTS)):
        params.append(constrained(kind, temperature=0.0, max_tokens=24))
        params.append(constrained(kind, temperature=1.0, max_tokens=24, seed=100 + i))
        params.append(SamplingParams(temperature=0.0, max_tokens=36 + i, ignore_eos=True))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
