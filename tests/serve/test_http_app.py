"""The HTTP front end (jaxpipe/serve/http.py) over a scripted stand-in for the engine process:
backpressure, errors and aborts, which the real engine makes slow or hard to provoke. No
model runs; the client is the official `openai` package, over loopback to uvicorn."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from jaxpipe.serve import messages as m
from jaxpipe.serve.engine_client import EngineLost, EngineUnavailable
from jaxpipe.serve.http import HttpFrontEnd, HttpServer
from jaxpipe.serve.metrics import ServerMetrics

openai = pytest.importorskip("openai")

MODEL = "scripted"


class ScriptedEngine:
    """EngineClient's surface. Each request gets its first and last prompt ids back as two
    deltas, unless `hold` is set: then it waits until aborted or `lose()` kills the engine."""

    def __init__(self):
        self.info = m.Ready(pid=1, model=MODEL, max_model_len=64, vocab_size=1000,
                            max_num_seqs=4)
        self.dead = threading.Event()
        self.hold = False
        self.pending: dict = {}
        self.aborted: list[str] = []

    @property
    def serving(self) -> bool:
        return not self.dead.is_set()

    def unavailable_reason(self) -> str:
        return "the scripted engine is down"

    def submit(self, rid: str, ids: list[int], params: dict, out) -> None:
        if self.dead.is_set():
            raise EngineUnavailable(self.unavailable_reason())
        if self.hold:
            self.pending[rid] = out
            return
        threading.Thread(target=self._answer, args=(rid, ids, out)).start()

    @staticmethod
    def _answer(rid: str, ids: list[int], out) -> None:
        out.put(m.TokenDelta(rid, [ids[0]], [[[ids[0], -0.5]]]))
        out.put(m.TokenDelta(rid, [ids[-1]], [[[ids[-1], -0.25]]], "length"))

    def abort(self, rid: str) -> None:
        out = self.pending.pop(rid, None)
        if out is not None:
            self.aborted.append(rid)
            out.put(m.TokenDelta(rid, [], None, "abort"))

    def lose(self) -> None:
        self.dead.set()
        pending, self.pending = self.pending, {}
        for rid, out in pending.items():
            out.put(EngineLost(rid, "the engine process exited (code -9)"))

    def stats(self, timeout: float = 5.0):
        return None


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


def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
    ({"prompt": [1], "n": 2}, 400, "n"),
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
