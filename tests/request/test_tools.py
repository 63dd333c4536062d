"""`tools` / `tool_choice` read from a chat body: the constraint a forced call puts on the
output (checked against the schema by llguidance's own matcher) and the errors, each naming its
key."""

from __future__ import annotations

import functools
import json

import llguidance
import pytest

from jaxpipe.request.errors import RequestError
from jaxpipe.request.openai import CHAT_URL, COMPLETIONS_URL, read_body
from jaxpipe.request.tools import read_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Now"}}
MESSAGES = [{"role": "user", "content": "Hi"}]


def body(**keys) -> dict:
    return {"messages": MESSAGES, "tools": [WEATHER, TIME], **keys}


def accepts(schema: dict, text: str) -> bool:
    """Whether llguidance's matcher, compiled from `schema` alone, accepts `text` whole."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar)
    return all(matcher.consume_token(byte) for byte in text.encode()) and \
        matcher.is_accepting()


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """One token per byte (id = the byte) and an EOS: texts are checked byte by byte."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"</s>": 256}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.add_special_tokens(["</s>"])
    tok.decoder = tokenizers.decoders.ByteFallback()
    return llguidance.LLTokenizer(tok.to_str())


def test_no_tools_is_no_tool_request():
    assert read_tools({"messages": MESSAGES}) is None
    assert read_tools({"messages": MESSAGES, "tool_choice": "none"}) is None
    assert read_body(CHAT_URL, {"messages": MESSAGES}).tools is None


def test_auto_is_the_default_and_free():
    b = read_body(CHAT_URL, body())
    assert b.tools.choice == "auto" and "structured_outputs" not in b.sampling
    assert b.template_vars == {"tools": [WEATHER, TIME]}
    assert read_body(CHAT_URL, body(tool_choice="none")).tools.choice == "none"


def test_named_choice_constrains_to_the_tools_parameters():
    b = read_body(CHAT_URL, body(tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}}))
    schema = b.sampling["structured_outputs"]["json"]
    assert accepts(schema, '{"city": "Paris", "days": 2}')
    assert not accepts(schema, '{"days": 2}')  # city is required
    assert not accepts(schema, '{"city": 3}')


def test_named_tool_without_parameters_takes_an_empty_object():
    b = read_body(CHAT_URL, body(tool_choice={"type": "function",
                                              "function": {"name": "get_time"}}))
    schema = b.sampling["structured_outputs"]["json"]
    assert accepts(schema, "{}") and not accepts(schema, "[]")


def test_required_constrains_to_a_list_of_calls():
    schema = read_body(CHAT_URL, body(tool_choice="required")).sampling[
        "structured_outputs"]["json"]
    assert accepts(schema, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert accepts(schema, '[{"name": "get_time", "parameters": {}}, '
                           '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert not accepts(schema, "[]")  # at least one call
    assert not accepts(schema, '[{"name": "get_weather", "parameters": {}}]')  # no city
    assert not accepts(schema, '[{"name": "nope", "parameters": {}}]')


def test_required_without_parallel_calls_takes_one():
    schema = read_body(CHAT_URL, body(tool_choice="required", parallel_tool_calls=False)) \
        .sampling["structured_outputs"]["json"]
    one = '{"name": "get_time", "parameters": {}}'
    assert accepts(schema, f"[{one}]") and not accepts(schema, f"[{one}, {one}]")


@pytest.mark.parametrize("keys, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                 "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                 "parameters": {"$ref": "#/missing"}}}]},
     "tools[0].function.parameters"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_name_the_key(keys, param):
    with pytest.raises(RequestError) as info:
        read_tools(body(**keys))
    assert info.value.field == param


def test_auto_beside_response_format_is_allowed():
    assert read_tools(body(response_format={"type": "json_object"})).choice == "auto"
    assert read_tools(body(tool_choice="required", response_format={"type": "text"})) \
        .constrained


def test_tools_are_chat_keys_only():
    with pytest.raises(RequestError) as info:
        read_body(COMPLETIONS_URL, {"prompt": "Hi", "tools": [WEATHER]})
    assert info.value.field == "tools"
