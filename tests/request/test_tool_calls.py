"""A chat answer with tools, whole and streamed: the calls a forced or parsed output makes,
finish reasons, and stream deltas that concatenate to the whole answer."""

from __future__ import annotations

import json

import pytest

from jaxpipe.request.tool_calls import ToolCallStream, message
from jaxpipe.request.tools import ToolRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = ToolRequest(TOOLS, "named", "get_weather")
REQUIRED = ToolRequest(TOOLS, "required")
AUTO, NONE = ToolRequest(TOOLS, "auto"), ToolRequest(TOOLS, "none")
HERMES_TEXT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def calls(msg: dict) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls", [])]


def test_named_output_is_the_arguments():
    msg, finish = message('{"city": "Oslo"}', "stop", NAMED, "hermes")
    assert finish == "tool_calls" and msg["content"] is None
    assert calls(msg) == [("get_weather", {"city": "Oslo"})]
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_named_cut_short_keeps_length():
    msg, finish = message('{"city": "Os', "length", NAMED, "hermes")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'


def test_required_makes_one_call_per_item():
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
            '{"name": "get_time", "parameters": {}}]')
    msg, finish = message(text, "stop", REQUIRED, "hermes")
    assert finish == "tool_calls" and msg["content"] is None
    assert calls(msg) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2


def test_required_cut_short_before_a_name_is_content():
    msg, finish = message('[{"name": "get_wea', "length", REQUIRED, "hermes")
    assert (msg, finish) == ({"role": "assistant", "content": '[{"name": "get_wea'}, "length")


def test_auto_parses_with_the_chosen_parser():
    msg, finish = message(HERMES_TEXT, "stop", AUTO, "hermes")
    assert finish == "tool_calls" and msg["content"] == "Sure."
    assert calls(msg) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    msg, finish = message(HERMES_TEXT, "stop", AUTO, "llama3_json")
    assert finish == "stop" and msg["content"] == HERMES_TEXT and "tool_calls" not in msg


def test_auto_without_parallel_calls_keeps_the_first():
    msg, _ = message(HERMES_TEXT, "stop", ToolRequest(TOOLS, "auto", parallel=False), "hermes")
    assert calls(msg) == [("get_weather", {"city": "Oslo"})]


def test_none_is_plain_text():
    msg, finish = message(HERMES_TEXT, "stop", NONE, "hermes")
    assert (msg, finish) == ({"role": "assistant", "content": HERMES_TEXT}, "stop")


def _streamed(tools: ToolRequest, pieces: list[str], parser: str = "hermes"):
    """The deltas of a stream of `pieces` (the last one finishes), joined: (content,
    {index: [name, arguments]}, finish_reason)."""
    stream, content, joined, finish = ToolCallStream(tools, parser), "", {}, None
    for i, piece in enumerate(pieces):
        fields, finish = stream.step(piece, "stop" if i == len(pieces) - 1 else None)
        content += fields.get("content") or ""
        for call in fields.get("tool_calls", []):
            entry = joined.setdefault(call["index"], [None, ""])
            if "id" in call:
                assert call["id"].startswith("call_") and call["type"] == "function"
                entry[0] = call["function"]["name"]
            entry[1] += call["function"]["arguments"]
    return content, joined, finish


@pytest.mark.parametrize("tools, text", [
    (NAMED, '{"city": "Oslo", "days": 3}'),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
    (AUTO, HERMES_TEXT), (AUTO, "No calls here, just text."), (NONE, HERMES_TEXT),
    (AUTO, "Hi <tool_call>{broken</tool_call> bye"),
])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_concatenates_to_the_whole_answer(tools, text, size):
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, joined, finish = _streamed(tools, pieces)
    msg, whole_finish = message(text, "stop", tools, "hermes")
    assert finish == whole_finish
    assert content == (msg["content"] or "")
    assert [joined[i] for i in sorted(joined)] == [
        [c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls", [])]


def test_named_stream_sends_arguments_as_they_come():
    stream = ToolCallStream(NAMED, "hermes")
    first, _ = stream.step('{"ci', None)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    then, _ = stream.step('ty": "Oslo"}', None)
    assert then == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}


def test_auto_stream_sends_each_hermes_call_once_closed():
    stream = ToolCallStream(AUTO, "hermes")
    cut = HERMES_TEXT.index("</tool_call>") + len("</tool_call>")
    fields, _ = stream.step(HERMES_TEXT[:cut - 1], None)
    assert fields == {"content": "Sure."}
    fields, _ = stream.step(HERMES_TEXT[cut - 1:cut + 3], None)
    assert [(c["index"], c["function"]["name"]) for c in fields["tool_calls"]] == \
        [(0, "get_weather")] and "content" not in fields
    fields, finish = stream.step(HERMES_TEXT[cut + 3:], "stop")
    assert [(c["index"], c["function"]["name"]) for c in fields["tool_calls"]] == \
        [(1, "get_time")] and finish == "tool_calls"


def test_auto_stream_sends_plain_text_before_the_end():
    stream = ToolCallStream(AUTO, "hermes")
    assert stream.step("The answer is", None)[0] == {"content": "The answer is"}
    assert stream.step(" <tool", None)[0] == {}  # may become a call: held back
    assert stream.step("box> 4", None)[0] == {"content": " <toolbox> 4"}


TRICKY = ('[{"name": "get_weather", "parameters": {"q": "a \\"}], {\\" b", "n": [1, {"x": 2}]}}, '
          '{"name": "get_time", "parameters": {}}]')


def test_required_arguments_are_the_outputs_own_text():
    msg, _ = message(TRICKY, "stop", REQUIRED, "hermes")
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [
        '{"q": "a \\"}], {\\" b", "n": [1, {"x": 2}]}', "{}"]
    assert calls(msg) == [(item["name"], item["parameters"]) for item in json.loads(TRICKY)]


def test_required_cut_short_mid_call_keeps_what_it_has():
    msg, finish = message(TRICKY[:60], "length", REQUIRED, "hermes")
    assert finish == "length" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] \
        == [("get_weather", TRICKY[39:60])]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_required_stream_sends_calls_as_they_come(size):
    pieces = [TRICKY[i:i + size] for i in range(0, len(TRICKY), size)]
    stream, seen = ToolCallStream(REQUIRED, "hermes"), []
    for i, piece in enumerate(pieces):
        fields, _ = stream.step(piece, "stop" if i == len(pieces) - 1 else None)
        seen += [(i, c["index"]) for c in fields.get("tool_calls", [])]
    steps_of = {k: [step for step, index in seen if index == k] for k in (0, 1)}
    assert len(steps_of[0]) > 2  # call 0's arguments came in pieces, ...
    assert max(steps_of[0]) < min(steps_of[1]) < len(pieces) - 1  # ... before call 1 began
    content, joined, finish = _streamed(REQUIRED, pieces)
    msg, _ = message(TRICKY, "stop", REQUIRED, "hermes")
    assert finish == "tool_calls" and content == ""
    assert [joined[i] for i in sorted(joined)] == [
        [c["function"]["name"], c["function"]["arguments"]] for c in msg["tool_calls"]]


HERMES_FORM = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>')


def test_engine_output_in_hermes_form_is_a_call(engine):
    """A real engine answer held to the Hermes form by a regex (SmolLM2 writes no calls of its
    own), read as "auto" would: one call, its city the text the model chose."""
    from jaxpipe import SamplingParams

    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}])
    [out] = engine.generate([prompt], [SamplingParams(
        temperature=0.8, seed=3, max_tokens=60, structured_outputs={"regex": HERMES_FORM})])
    text = out.outputs[0].text
    msg, finish = message(text, out.outputs[0].finish_reason, AUTO, "hermes")
    assert finish == "tool_calls" and msg["content"] == "Checking."
    city = text.split('"city": "')[1].split('"')[0]
    assert calls(msg) == [("get_weather", {"city": city})]
