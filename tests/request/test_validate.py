"""Request validation shared by the gRPC front end and batch jobs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from jaxpipe.model.tokenizer import Tokenizer
from jaxpipe.request.errors import RequestError
from jaxpipe.request.validate import Limits, prepare

LIMITS = Limits(max_model_len=64, vocab_size=49152)
GOOD = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from jaxpipe.model.loading import load_tokenizer
    from jaxpipe.model.presets import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def test_text_chat_and_ids_tokenize_like_the_engine(tokenizer):
    chat = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert prepare("text", "Hello", GOOD, tokenizer, LIMITS).prompt_token_ids == \
        tokenizer.encode("Hello")
    assert prepare("chat", chat, GOOD, tokenizer, LIMITS).prompt_token_ids == \
        tokenizer.encode(rendered, add_special_tokens=False)
    prep = prepare("token_ids", [1, 2, 3], {"stop": "x", "top_k": -1}, tokenizer, LIMITS)
    assert prep.prompt_token_ids == [1, 2, 3]
    assert prep.params_dict["stop"] == ["x"] and prep.params_dict["top_k"] == 0


@pytest.mark.parametrize("kind, value, sampling, field", [
    (None, None, {}, "prompt"),
    ("text", "", {}, "text"),
    ("token_ids", [], {}, "token_ids"),
    ("chat", [], {}, "chat"),
    ("chat", [{"role": "wizard", "content": "x"}], {}, "chat[0].role"),
    ("chat", [{"role": "user", "content": 3}], {}, "chat[0].content"),
    ("token_ids", [1] * 64, {}, "token_ids"),
    ("text", "word " * 100, {}, "text"),
    ("token_ids", [1, 49152], {}, "token_ids[1]"),
    ("token_ids", [-1], {}, "token_ids[0]"),
    ("token_ids", [1], {"max_tokens": 0}, "sampling.max_tokens"),
    ("token_ids", [1, 2], {"max_tokens": 63}, "sampling.max_tokens"),
    ("token_ids", [1], {"temperature": -0.5}, "sampling.temperature"),
    ("token_ids", [1], {"top_p": 0.0}, "sampling.top_p"),
    ("token_ids", [1], {"top_p": 1.5}, "sampling.top_p"),
    ("token_ids", [1], {"top_k": -2}, "sampling.top_k"),
    ("token_ids", [1], {"presence_penalty": -2.5}, "sampling.presence_penalty"),
    ("token_ids", [1], {"frequency_penalty": 3.0}, "sampling.frequency_penalty"),
    ("token_ids", [1], {"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ("token_ids", [1], {"n": 0}, "sampling.n"),
    ("token_ids", [1], {"logprobs": 21}, "sampling.logprobs"),
    ("token_ids", [1], {"temperature": "hot"}, "sampling.temperature"),
    ("token_ids", [1], {"beam_width": 4}, "sampling.beam_width"),
])
def test_bad_request_names_the_field(tokenizer, kind, value, sampling, field):
    with pytest.raises(RequestError) as info:
        prepare(kind, value, sampling, tokenizer, LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_max_tokens_filling_the_context_exactly_is_accepted(tokenizer):
    assert prepare("token_ids", [1, 2], {"max_tokens": 62}, tokenizer, LIMITS).params.max_tokens \
        == 62


# -- chat with tools ----------------------------------------------------------------------------

TOOLS_TEMPLATE = (Path(__file__).parent / "data" / "qwen2_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21 C, cloudy"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    """SmolLM2's tokenizer with a Qwen 2.5 (Hermes-style) chat template, which renders tools."""
    return Tokenizer(tokenizer.backend, special_tokens={"eos_token": "<|im_end|>"},
                     chat_template=TOOLS_TEMPLATE)


def _as_hf_gets_it(messages: list[dict]) -> list[dict]:
    """The conversation with tool call arguments as objects (vLLM passes them so)."""
    out = copy.deepcopy(messages)
    for msg in out:
        for call in msg.get("tool_calls") or ():
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("tools", [[WEATHER], None])
def test_chat_with_tools_renders_like_hf(tools_tokenizer, hf_tokenizer, tools):
    expected = hf_tokenizer.apply_chat_template(
        _as_hf_gets_it(TOOL_CHAT), tools=tools, tokenize=False, add_generation_prompt=True,
        chat_template=TOOLS_TEMPLATE)
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}' in expected
    assert ("<tools>" in expected) == bool(tools)
    limits = Limits(max_model_len=2048, vocab_size=49152)
    got = prepare("chat", TOOL_CHAT, GOOD, tools_tokenizer, limits,
                  {"tools": tools}).prompt_token_ids
    assert got == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_smollm2_template_ignores_tools_and_still_renders(tokenizer):
    chat = [{"role": "user", "content": "Hi"}]
    plain = prepare("chat", chat, GOOD, tokenizer, LIMITS)
    assert prepare("chat", chat, GOOD, tokenizer, LIMITS, {"tools": [WEATHER]}) \
        .prompt_token_ids == plain.prompt_token_ids


@pytest.mark.parametrize("message, field", [
    ({"role": "assistant", "content": None}, "chat[1].content"),
    ({"role": "assistant", "content": None, "tool_calls": "x"}, "chat[1].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "chat[1].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]},
     "chat[1].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "18 C", "tool_call_id": 7}, "chat[1].tool_call_id"),
])
def test_bad_tool_messages_name_the_field(tools_tokenizer, message, field):
    with pytest.raises(RequestError) as info:
        prepare("chat", [{"role": "user", "content": "Hi"}, message], GOOD, tools_tokenizer,
                Limits(max_model_len=2048, vocab_size=49152))
    assert info.value.field == field


def test_a_failing_chat_template_is_a_request_error(tokenizer):
    # SmolLM2's template adds each message's content to a string: None fails inside it
    chat = [{"role": "user", "content": "Hi"}, TOOL_CHAT[2]]
    with pytest.raises(RequestError) as info:
        prepare("chat", chat, GOOD, tokenizer, Limits(max_model_len=2048, vocab_size=49152))
    assert info.value.field == "chat" and "chat template" in info.value.message


def test_a_constraint_is_compiled_before_the_engine_sees_it(tokenizer):
    from jaxpipe.request.grammar import grammars_for

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    prep = prepare("text", "JSON:", {**GOOD, "structured_outputs": {"json": schema}},
                   tokenizer, LIMITS)
    grammars = grammars_for(tokenizer, LIMITS.vocab_size)
    assert grammars is grammars_for(tokenizer, LIMITS.vocab_size)  # one per tokenizer and vocab
    assert prep.params.structured_outputs.key in grammars._cache  # the engine reuses it
    assert prep.params_dict["structured_outputs"]["json"] == schema


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "object", "properties": {"x": {"type": "integr"}}}},
     "sampling.structured_outputs.json"),
    ({"regex": "(unclosed"}, "sampling.structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "sampling.structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_names_its_kind(tokenizer, so, field):
    with pytest.raises(RequestError) as info:
        prepare("text", "JSON:", {**GOOD, "structured_outputs": so}, tokenizer, LIMITS)
    assert info.value.field == field
    assert "does not compile" in info.value.message


def test_a_constraint_needs_a_tokenizer():
    with pytest.raises(RequestError) as info:
        prepare("token_ids", [1, 2], {**GOOD, "structured_outputs": {"regex": "a+"}}, None,
                LIMITS)
    assert info.value.field == "sampling.structured_outputs"
