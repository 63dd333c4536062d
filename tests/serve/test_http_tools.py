"""Forced tool calls on the shared server (SmolLM2, whose chat template ignores `tools`: the
prompt still renders) with the official `openai` client: a named `tool_choice` and
"required" return calls whose arguments validate against the tool's schema (checked with
pydantic models written from the schema), streamed arguments concatenate to the same JSON, and
bad tools are 400s naming the key while the server serves on."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 16}}, "required": ["zone"],
        "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Weather(BaseModel):  # WEATHER's parameters, by hand
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=16)
    days: int = Field(ge=1, le=7)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Time(BaseModel):  # TIME's parameters, by hand
    model_config = ConfigDict(extra="forbid", strict=True)
    zone: str = Field(max_length=16)


ARGUMENTS = {"get_weather": Weather, "get_time": Time}


def valid(name: str, arguments: str) -> BaseModel:
    return ARGUMENTS[name].model_validate(json.loads(arguments))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_choice_is_a_valid_call(client, temperature):
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice=NAMED,
        temperature=temperature, seed=7, max_tokens=80)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    valid("get_weather", call.function.arguments)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_is_one_or_more_valid_calls(client, temperature):
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
        temperature=temperature, seed=11, max_tokens=120)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        valid(call.function.name, call.function.arguments)


def test_named_streamed_arguments_equal_the_whole(client):
    kwargs = dict(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=NAMED,
                  temperature=0.0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    pieces, names, finish = [], [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            names += [call.function.name] if call.function.name else []
            pieces.append(call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert len(pieces) > 2  # the arguments came as they were generated
    assert "".join(pieces) == whole.function.arguments
    valid("get_weather", "".join(pieces))


def test_required_streamed_calls_equal_the_whole(client):
    kwargs = dict(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
                  temperature=0.0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, pieces = {}, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
            pieces += 1
    assert pieces > len(whole) + 2  # the arguments came as they were generated
    assert [calls[i] for i in sorted(calls)] == [
        [c.function.name, c.function.arguments] for c in whole]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]},
     "tools[0].function.parameters"),
])
def test_bad_tools_are_400_naming_the_key_and_the_server_goes_on(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       extra_body=extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices
