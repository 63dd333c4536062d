"""Structured outputs through the shared server's front ends: OpenAI's `response_format`
(the official client's `chat.completions.parse` with a pydantic model, JSON mode, a streamed
schema, a Batch API job), vLLM's `structured_outputs` in `extra_body` (regex, choice), and the
gRPC `StructuredOutputs` message. The references are independent of the engine: pydantic's
validation, `json.loads`, `re.fullmatch` and list membership; a bad schema is refused before
the engine sees it and the server then serves on."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "smollm2-135m"
MAX_TOKENS = 120  # bounded strings and ints: the longest City fits in about 70 tokens
PROMPTS = ["Describe Paris as JSON.", "Tell me about Tokyo.", "Give facts about a small "
           "village in Norway.", "What is the biggest city in Brazil?", "Invent a city on Mars."]
PHONE = r"[0-9]{3}-[0-9]{4}"
LABELS = ["positive", "negative", "neutral"]
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "integr"}}}


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as ch:
        yield pb_grpc.GenerationStub(ch)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def parallel(fn, args: list) -> list:
    """fn over args from as many threads, so the engine batches them."""
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def parse(client):
    """`chat.completions.parse` of the installed client (beta in older ones)."""
    chat = client.chat.completions
    return chat.parse if hasattr(chat, "parse") else client.beta.chat.completions.parse


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_pydantic_object_for_every_prompt(client, temperature):
    def ask(prompt: str):
        return parse(client)(model=MODEL, messages=user(prompt), response_format=City,
                             temperature=temperature, seed=7, max_tokens=MAX_TOKENS)

    for out in parallel(ask, PROMPTS):
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, City), message.content
        assert City.model_validate_json(message.content) == message.parsed
        assert message.content == json.dumps(json.loads(message.content), ensure_ascii=False)


def test_json_mode_always_parses_as_an_object(client):
    def ask(prompt: str):
        return client.chat.completions.create(
            model=MODEL, messages=user(prompt), response_format={"type": "json_object"},
            temperature=0, max_tokens=200)

    # prompts that ask for a small object: JSON mode bounds nothing, and a 135M model asked
    # only "for a cat" nests and repeats itself past any max_tokens
    for out in parallel(ask, ["Give a JSON object for a cat, with a name and an age.",
                              "Reply in JSON: your name.", "A JSON object with two numbers.",
                              "Write a JSON object with a title and an author of a book."]):
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_and_choice_through_extra_body(client):
    def ask(args):
        prompt, so, temperature = args
        return client.chat.completions.create(
            model=MODEL, messages=user(prompt), temperature=temperature, seed=3, max_tokens=20,
            extra_body={"structured_outputs": so}).choices[0].message.content

    phones = [("Give me a phone number.", {"regex": PHONE}, t) for t in (0.0, 1.0)]
    labels = [(f"Sentiment of: {s}", {"choice": LABELS}, t)
              for s in ("I love it!", "This is awful.") for t in (0.0, 1.0)]
    outs = parallel(ask, phones + labels)
    assert all(re.fullmatch(PHONE, text) for text in outs[:2]), outs[:2]
    assert all(text in LABELS for text in outs[2:]), outs[2:]


def test_completions_url_takes_a_constraint_too(client):
    out = client.completions.create(model=MODEL, prompt="The year it happened was",
                                    temperature=0, max_tokens=10,
                                    extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert re.fullmatch("[12][0-9]{3}", out.choices[0].text)


def test_a_streamed_constrained_chat_concatenates_to_valid_json(client):
    schema = {"type": "json_schema", "json_schema": {
        "name": "City", "schema": City.model_json_schema(), "strict": True}}
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Describe Rome."), response_format=schema, temperature=1.0,
        seed=11, max_tokens=MAX_TOKENS, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert len([c for c in chunks if c.delta.content]) > 1  # it really streamed
    assert chunks[-1].finish_reason == "stop"
    City.model_validate_json(text)


def test_a_bad_schema_is_a_bad_request_and_the_server_serves_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=user("Hi"), max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}})
    assert info.value.body["param"] == "structured_outputs.json"
    assert "integr" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=5,
                                       response_format={"type": "yaml"})
    assert info.value.body["param"] == "response_format.type"
    out = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=5,
                                         temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content


def grpc_text(stub, so: pb.StructuredOutputs, prompt: str) -> tuple[str, str]:
    """(text, finish_reason) of one streamed Generate call under `so`."""
    text, last = "", None
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so)
    for resp in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=300):
        text, last = text + resp.text, resp
    return text, last.finish_reason


def test_grpc_choice_and_regex_match(stub):
    choice = pb.StructuredOutputs(choice=pb.StructuredOutputs.Choice(options=LABELS))
    text, reason = grpc_text(stub, choice, "The review 'great product' is")
    assert text in LABELS and reason == "stop"
    text, reason = grpc_text(stub, pb.StructuredOutputs(regex=PHONE), "Call me at")
    assert re.fullmatch(PHONE, text) and reason == "stop"


def test_grpc_bad_schema_is_invalid_argument_naming_the_field(stub):
    with pytest.raises(grpc.RpcError) as info:
        grpc_text(stub, pb.StructuredOutputs(json=json.dumps(BAD_SCHEMA)), "Hi")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.structured_outputs.json: ")
    text, reason = grpc_text(stub, pb.StructuredOutputs(regex="yes|no"), "Yes or no?")
    assert text in ("yes", "no") and reason == "stop"


def test_a_batch_api_job_with_response_format_lines(client):
    schema = {"type": "json_schema", "json_schema": {
        "name": "City", "schema": City.model_json_schema(), "strict": True}}
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": user(prompt), "seed": i,
                                  "temperature": 1.0, "max_tokens": MAX_TOKENS,
                                  "response_format": schema}})
             for i, prompt in enumerate(PROMPTS)]
    lines.append(json.dumps({"custom_id": "label", "method": "POST",
                             "url": "/v1/chat/completions", "body": {
                                 "model": MODEL, "messages": user("Is it good?"),
                                 "max_tokens": 10, "structured_outputs": {"choice": LABELS}}}))
    source = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch.id).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, client.batches.retrieve(batch.id)
        time.sleep(0.5)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.failed == 0
    records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
             for r in records}
    assert set(texts) == {f"c{i}" for i in range(len(PROMPTS))} | {"label"}
    for i in range(len(PROMPTS)):
        City.model_validate_json(texts[f"c{i}"])
    assert texts["label"] in LABELS
