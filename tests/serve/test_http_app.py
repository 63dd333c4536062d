"""The HTTP front end (jaxpipe/serve/http.py) over a scripted stand-in for the engine process:
backpressure, errors and aborts, which the real engine makes slow or hard to provoke. No
model runs; the client is the official `openai` package, over loopback to uvicorn."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from scripted_engine import MODEL, ScriptedEngine, until

from jaxpipe.serve.http import HttpFrontEnd, HttpServer
from jaxpipe.serve.metrics import ServerMetrics

openai = pytest.importorskip("openai")


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def front(engine):
    """An HttpFrontEnd with max_concurrent_requests=1 and 4 KiB bodies, listening on loopback;
    yields (front end, base URL)."""
    front = HttpFrontEnd(engine, None, MODEL, 4096, 1, ServerMetrics(lambda: None))
    server = HttpServer(front.app, "127.0.0.1", 0, drain_timeout=5)
    port = server.start()
    yield front, f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def client(front):
    return openai.OpenAI(base_url=front[1] + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_token_id_prompts_answer_with_usage_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2,
                                     logprobs=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.choices[1].logprobs.token_logprobs == [-0.5, -0.25]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 4)


def test_past_the_limit_429_with_retry_after_then_admitted_again(client, engine, front):
    engine.hold = True
    stream = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, stream=True)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt=[3], max_tokens=4)
    assert info.value.response.headers["retry-after"] == "1"
    assert "max_concurrent_requests=1" in info.value.message
    stream.close()  # the client goes away mid-stream: its request is aborted, its slot freed
    assert until(lambda: engine.aborted == ["h0-0"] and front[0].admission.active == 0)
    engine.hold = False
    assert client.completions.create(model=MODEL, prompt=[3], max_tokens=4).choices


def test_a_whole_response_whose_client_gives_up_is_aborted(front, engine):
    engine.hold = True
    impatient = openai.OpenAI(base_url=front[1] + "/v1", api_key="unused", max_retries=0,
                              timeout=1)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4)
    assert until(lambda: engine.aborted == ["h0-0"] and front[0].admission.active == 0)


def test_engine_down_is_503_and_health_says_so(client, engine, front):
    engine.dead.set()
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503
    assert info.value.body["message"] == "the scripted engine is down"
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(front[1] + "/health", timeout=10)
    assert health.value.code == 503


def test_engine_lost_mid_stream_ends_the_stream_with_an_error(client, engine):
    engine.hold = True
    stream = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, stream=True)
    assert until(lambda: engine.pending)
    engine.lose()
    with pytest.raises(openai.APIError, match="engine process exited"):
        list(stream)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "best_of": 2}, 400, "best_of"),
    ({"prompt": [1, 5000]}, 400, "prompt[1]"),
    ({"prompt": [1], "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": [1], "n": 0}, 400, "n"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "text needs a tokenizer"}, 400, "prompt"),
    ({"prompt": [1], "model": "gpt-4o"}, 404, "model"),
    ({"prompt": [1] * 2000}, 413, None),
])
def test_bad_requests_get_openai_errors_naming_the_key(front, body, status, param):
    req = urllib.request.Request(front[1] + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == status
    error = json.loads(info.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_bad_temperature_is_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1], temperature=-0.5)
    assert info.value.param == "temperature"
    assert "temperature must be >= 0, got -0.5" in info.value.message


def test_models_lists_the_served_model(client):
    assert [card.id for card in client.models.list()] == [MODEL]


def test_a_taken_port_fails_the_start_naming_the_flags(front):
    port = int(front[1].rsplit(":", 1)[1])  # held by the fixture's server
    second = HttpServer(front[0].app, "127.0.0.1", port, drain_timeout=1)
    with pytest.raises(OSError, match=f"127.0.0.1:{port}.*--http-port.*--no-http"):
        second.start(timeout=10)
