"""Reading OpenAI bodies: structured outputs by OpenAI's names (response_format) and vLLM's
(structured_outputs) on both URLs, and errors naming the body key."""

from __future__ import annotations

import pytest

from jaxpipe.request.errors import RequestError
from jaxpipe.request.openai import CHAT_URL, COMPLETIONS_URL, body_key, read_body
from jaxpipe.request.validate import sampling_params

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def constraint(url: str, **extra):
    """The SamplingParams.structured_outputs a body's extra keys come to (None: none)."""
    body = read_body(url, {**(CHAT if url == CHAT_URL else COMPLETION), **extra})
    return sampling_params(body.sampling).structured_outputs


@pytest.mark.parametrize("url", [CHAT_URL, COMPLETIONS_URL])
def test_response_format_and_structured_outputs_become_one_constraint(url):
    schema_fmt = {"type": "json_schema",
                  "json_schema": {"name": "point", "schema": SCHEMA, "strict": True}}
    assert constraint(url, response_format=schema_fmt).json == SCHEMA
    assert constraint(url, response_format={"type": "json_object"}).json_object is True
    assert constraint(url, response_format={"type": "text"}) is None
    assert constraint(url, response_format=None) is None
    so = {"regex": "[a-z]+", "choice": None}  # null fields are not given
    assert constraint(url, structured_outputs=so).regex == "[a-z]+"
    assert constraint(url, structured_outputs={"choice": ["yes", "no"]}).choice == ("yes", "no")
    assert constraint(url, structured_outputs={"grammar": 'start: "a"'}).kind == "grammar"
    assert constraint(url, structured_outputs={"json": SCHEMA}).json == SCHEMA
    assert constraint(url, structured_outputs={"json_object": True}).kind == "json_object"


@pytest.mark.parametrize("extra, key", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": 3, "schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "extra": 1}}}, "response_format.json_schema.extra"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a+"}}, "structured_outputs.pattern"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_bad_constraints_name_the_body_key(extra, key):
    with pytest.raises(RequestError) as info:
        read_body(CHAT_URL, {**CHAT, **extra})
    assert info.value.field == key


def test_accepted_response_formats_are_listed():
    with pytest.raises(RequestError) as info:
        read_body(CHAT_URL, {**CHAT, "response_format": {"type": "yaml"}})
    assert all(t in info.value.message for t in ("json_schema", "json_object", "text"))
    assert "'yaml'" in info.value.message


@pytest.mark.parametrize("so, key", [
    ({"regex": "a+", "choice": ["a"]}, "structured_outputs"),  # two constraints in one
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({}, "structured_outputs"),
])
def test_bad_structured_outputs_values_name_the_key(so, key):
    body = read_body(CHAT_URL, {**CHAT, "structured_outputs": so})
    with pytest.raises(RequestError) as info:
        sampling_params(body.sampling)
    assert body_key(info.value.field) == key
