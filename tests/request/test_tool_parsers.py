"""The "auto" tool-call parsers on model texts: calls found, text around them kept as content,
malformed calls left as content; `content_end` never lets out text that becomes a call."""

from __future__ import annotations

import json

import pytest

from jaxpipe.request.tool_parsers import TOOL_PARSERS, Parsed, ToolCall

HERMES, LLAMA = TOOL_PARSERS["hermes"], TOOL_PARSERS["llama3_json"]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_one_call_no_text():
    parsed = HERMES.parse(f"<tool_call>\n{PARIS}\n</tool_call>")
    assert parsed.content is None
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris"}


def test_hermes_text_around_calls_stays_content():
    text = (f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>\n"
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nOne moment.')
    parsed = HERMES.parse(text)
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[1].arguments) == {}
    assert parsed.content == "Let me look.\n\n\nOne moment."


def test_hermes_malformed_call_stays_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HERMES.parse(bad) == Parsed(bad)
    text = f"{bad}\n<tool_call>{PARIS}</tool_call>"
    parsed = HERMES.parse(text)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == bad


@pytest.mark.parametrize("text", ["The weather is fine.", "", "<tool_call>not json",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_without_calls_is_all_content(text):
    assert HERMES.parse(text) == Parsed(text)


def test_hermes_unclosed_last_call_is_read():
    parsed = HERMES.parse(f"<tool_call>{PARIS}")
    assert parsed.calls == (ToolCall("get_weather", '{"city": "Paris"}'),)


def test_hermes_arguments_given_as_text_are_kept():
    parsed = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert parsed.calls == (ToolCall("f", '{"a": 1}'),)


def test_llama3_json_calls():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "CET"}}')
    parsed = LLAMA.parse(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert LLAMA.parse(' {"name": "f", "parameters": {}}').calls == (ToolCall("f", "{}"),)


@pytest.mark.parametrize("text", ["Paris is sunny.", '{"name": "f", "parameters": ',
                                  '{"city": "Paris"}', '{"name": "f", "parameters": {}} and more'])
def test_llama3_json_anything_else_is_content(text):
    assert LLAMA.parse(text) == Parsed(text)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", [
    f"Checking.  <tool_call>{PARIS}</tool_call> ok", f"<tool_call>{PARIS}</tool_call>",
    "Plain answer, no calls.", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "<|python_tag|>" + '{"name": "f", "parameters": {}}', "  a < b <tool"])
def test_content_end_never_lets_out_a_call(name, text):
    """At every prefix, what `content_end` lets out is a prefix of the final content (and
    never text of a call)."""
    parser = TOOL_PARSERS[name]
    final = parser.parse(text)
    sent = 0
    for i in range(len(text) + 1):
        sent = max(sent, parser.content_end(text[:i]))
        assert (final.content or "").startswith(text[:sent])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", [
    f"A <tool_call>{PARIS}</tool_call> b <tool_call>{{bad}}</tool_call> "
    f"<tool_call>{PARIS}</tool_call> c", f"<tool_call>{PARIS}",
    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'])
def test_calls_end_holds_the_first_calls(name, text):
    """At every prefix, the calls up to `calls_end` are the first calls of the whole text."""
    parser = TOOL_PARSERS[name]
    final = parser.parse(text).calls
    for i in range(len(text) + 1):
        early = parser.parse(text[:parser.calls_end(text[:i])]).calls
        assert final[:len(early)] == early
