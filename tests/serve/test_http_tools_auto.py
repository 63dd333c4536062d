"""Tool calls with tool_choice "auto" through the HTTP front end, over a scripted engine that
answers with a model's Hermes-form output (a model that writes tool calls is too big for these
tests). The front end renders the chat with SmolLM2's tokenizer, the `openai` client reads the
answer: `tool_calls` whole, and the same calls and text streamed; Batch API lines likewise."""

from __future__ import annotations

import json

import pytest
from scripted_engine import MODEL, ScriptedEngine, until

from jaxpipe.serve import messages as m
from jaxpipe.serve.batch_runner import ClientRunner
from jaxpipe.serve.batches import Batches, FileStore
from jaxpipe.serve.http import HttpFrontEnd, HttpServer
from jaxpipe.serve.http_batches import BatchRoutes
from jaxpipe.serve.metrics import ServerMetrics

openai = pytest.importorskip("openai")

ANSWER = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
          '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {key: {"type": "string"}}}}}
    for name, key in (("get_weather", "city"), ("get_time", "zone"))]
CHAT = [{"role": "user", "content": "Weather and time in Paris?"}]


class AnsweringEngine(ScriptedEngine):
    """Answers every request with `ids`, a few tokens per delta, then "stop"."""

    def __init__(self, ids: list[int]):
        super().__init__()
        self.ids = ids
        self.info = m.Ready(pid=1, model=MODEL, max_model_len=512, vocab_size=49152,
                            max_num_seqs=4)

    def submit(self, rid: str, ids: list[int], params: dict, out) -> None:
        for at in range(0, len(self.ids), 3):
            last = at + 3 >= len(self.ids)
            out.put(m.TokenDelta(rid, self.ids[at:at + 3], None, "stop" if last else None))


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from jaxpipe.model.loading import load_tokenizer
    from jaxpipe.model.presets import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def client(request, tokenizer):
    """An `openai` client of a front end with the given parser; (client, parser)."""
    engine = AnsweringEngine(tokenizer.encode(ANSWER, add_special_tokens=False))
    front = HttpFrontEnd(engine, tokenizer, MODEL, 1 << 16, 8, ServerMetrics(lambda: None),
                         tool_call_parser=request.param)
    server = HttpServer(front.app, "127.0.0.1", 0, drain_timeout=5)
    port = server.start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                        max_retries=0, timeout=30), request.param
    server.stop()


def expected(parser: str) -> tuple[str | None, list, str]:
    """(content, [(name, arguments)], finish_reason), read off ANSWER by hand."""
    if parser == "llama3_json":  # not its format: all text
        return ANSWER, [], "stop"
    return "I will check both.", [("get_weather", {"city": "Paris", "unit": "C"}),
                                  ("get_time", {"zone": "Europe/Paris"})], "tool_calls"


def test_auto_answer_in_hermes_form_is_tool_calls(client):
    client, parser = client
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    msg, finish = resp.choices[0].message, resp.choices[0].finish_reason
    content, calls, reason = expected(parser)
    assert (msg.content, finish) == (content, reason)
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in msg.tool_calls or []] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls or [])


def test_auto_streamed_equals_whole(client):
    client, parser = client
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                            tool_choice="auto", stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    want_content, want_calls, want_finish = expected(parser)
    assert (content, finish) == (want_content, want_finish)
    assert [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)] == want_calls


def test_tool_choice_none_is_text(client):
    client, _ = client
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                          tool_choice="none")
    assert resp.choices[0].message.content == ANSWER
    assert not resp.choices[0].message.tool_calls


def test_batch_api_lines_with_tools(tokenizer, tmp_path):
    """Batch API chat lines go through the same reader: "auto" lines get tool_calls by the
    server's parser, a line naming an unknown tool an error record naming the key."""
    engine = AnsweringEngine(tokenizer.encode(ANSWER, add_special_tokens=False))
    files = FileStore(str(tmp_path))
    batches = Batches(str(tmp_path), files,
                      lambda prefix: ClientRunner(engine, tokenizer, MODEL, prefix, 4),
                      lambda: True, 1 << 16, tool_call_parser="hermes")
    front = HttpFrontEnd(engine, tokenizer, MODEL, 1 << 16, 4, ServerMetrics(lambda: None))
    BatchRoutes(files, batches, 1 << 20).add_to(front.app)
    server = HttpServer(front.app, "127.0.0.1", 0, drain_timeout=5)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.start()}/v1", api_key="unused",
                           max_retries=0, timeout=30)
    try:
        lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": CHAT, "tools": TOOLS, **extra}})
                 for cid, extra in (("auto", {}), ("bad", {"tool_choice": {
                     "type": "function", "function": {"name": "nope"}}}))]
        source = client.files.create(file=("in.jsonl", "\n".join(lines).encode() + b"\n"),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        assert until(lambda: client.batches.retrieve(batch.id).status == "completed", 30)
        batch = client.batches.retrieve(batch.id)
        (ok,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text
                 .splitlines()]
        (bad,) = [json.loads(x) for x in client.files.content(batch.error_file_id).text
                  .splitlines()]
    finally:
        server.stop()
    choice = ok["response"]["body"]["choices"][0]
    content, calls, finish = expected("hermes")
    assert (choice["message"]["content"], choice["finish_reason"]) == (content, finish)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == calls
    assert bad["error"]["param"] == "body.tool_choice"
