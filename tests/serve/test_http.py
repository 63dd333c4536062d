"""The OpenAI-compatible HTTP API of `python -m jaxpipe.serve` (the shared server), called with
the official `openai` client. Expected texts come from the same server's gRPC front end (an
independent path through request parsing, validation and detokenization) or from the HTTP
API's other mode (whole vs streamed, one prompt vs a list)."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "What is 2+2?"}]
PROMPTS = ["The capital of France is", "Water boils at", "Computers are"]


@pytest.fixture(scope="module")
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def server_info(stub) -> pb.ServerInfo:
    return stub.GetServerInfo(pb.ServerInfoRequest())


def wait_idle(stub, deadline_s: float = 60.0) -> pb.ServerInfo:
    end = time.monotonic() + deadline_s
    info = server_info(stub)
    while (info.unfinished_requests or info.engine_has_unfinished) and time.monotonic() < end:
        time.sleep(0.2)
        info = server_info(stub)
    return info


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def test_models_list(client):
    [card] = client.models.list()
    assert card.id == MODEL and card.object == "model"


def test_chat_plain_and_streamed_agree_under_greedy_and_with_grpc(client, stub):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content != ""
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [x for x in reasons if x] == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    chat = pb.Chat(messages=[pb.ChatMessage(**msg) for msg in CHAT])
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=12)
    want = "".join(r.text for r in stub.Generate(pb.GenerateRequest(chat=chat,
                                                                    sampling=sampling)))
    assert text == want


def test_completions_with_a_list_of_prompts_equal_one_by_one(client):
    kw = dict(model=MODEL, temperature=0, max_tokens=5)
    listed = client.completions.create(prompt=PROMPTS, **kw)
    assert [c.index for c in listed.choices] == [0, 1, 2]
    singles = [client.completions.create(prompt=p, **kw) for p in PROMPTS]
    assert [c.text for c in listed.choices] == [s.choices[0].text for s in singles]
    assert listed.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed = client.completions.create(prompt=PROMPTS, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in listed.choices]


def test_logprobs_present_when_asked(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens > 0
    for token in content:
        assert len(token.top_logprobs) == 3
        tops = [t.logprob for t in token.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert token.logprob == pytest.approx(tops[0])  # greedy: the most likely token
        assert token.token == token.top_logprobs[0].token
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                           max_tokens=6)
    assert plain.choices[0].logprobs is None
    text = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0,
                                     max_tokens=4, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == text.usage.completion_tokens
    assert all(alts and max(alts.values()) <= 0 for alts in lp.top_logprobs)


def test_bad_temperature_is_a_bad_request_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert info.value.param == "temperature" and ">= 0" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


def test_client_gone_mid_stream_frees_its_blocks(client, stub, grpc_server):
    before = server_info(stub)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count slowly."}], temperature=0,
        max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert server_info(stub).unfinished_requests == 1
    stream.close()
    info = wait_idle(stub)
    assert info.unfinished_requests == 0 and not info.engine_has_unfinished
    assert info.aborted_requests == before.aborted_requests + 1
    assert 'jaxpipe_kv_tokens_used{tier="device"} 0.0' in scrape(grpc_server.http_url)


def test_16_concurrent_chats_all_answer(client):
    def chat(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Name a number above {i}."}],
            temperature=0, max_tokens=4)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(chat, range(16)))
    for resp in answers:
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.usage.completion_tokens >= 1


def latency_counts(url: str) -> dict:
    """Latency histogram name -> observations for the HTTP front end."""
    out = {}
    for family in text_string_to_metric_families(scrape(url)):
        for s in family.samples:
            if s.name.endswith("_seconds_count") and s.labels.get("front_end") == "http":
                out[s.name] = s.value
    return out


def test_health_and_latency_metrics_on_the_http_port(client, grpc_server):
    with urllib.request.urlopen(grpc_server.http_url + "/health", timeout=10) as resp:
        assert resp.status == 200
    before = latency_counts(grpc_server.http_url)
    kw = dict(model=MODEL, messages=CHAT, max_tokens=4, extra_body={"ignore_eos": True})
    client.chat.completions.create(**kw)
    list(client.chat.completions.create(**kw, stream=True))
    after = latency_counts(grpc_server.http_url)
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        key = f"jaxpipe_{name}_seconds_count"
        assert after[key] - before.get(key, 0) == 2, name
    assert "jaxpipe_engine_up 1.0" in scrape(grpc_server.http_url)


def test_chat_with_n_plain_and_streamed(client):
    """n=3 greedy: three choices indexed 0..2, each the n=1 answer; usage counts the prompt
    once; the streamed chunks carry each choice's index and add up to the same."""
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    single = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    assert [c.message.content for c in plain.choices] == [single.choices[0].message.content] * 3
    assert plain.usage.prompt_tokens == single.usage.prompt_tokens
    assert plain.usage.completion_tokens == 3 * single.usage.completion_tokens
    texts, reasons, roles = ["", "", ""], [[], [], []], [0, 0, 0]
    chunks = list(client.chat.completions.create(**kw, n=3, stream=True,
                                                 stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            reasons[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == [c.message.content for c in plain.choices]
    assert roles == [1, 1, 1] and reasons == [[c.finish_reason] for c in plain.choices]
    assert chunks[-1].usage == plain.usage


def test_completions_with_n_over_a_list_of_prompts_are_prompt_major(client):
    """Two prompts, n=2, seeded: choice 2j + i is prompt j's sample i, which equals an n=1
    request seeded seed + i; plain and streamed agree."""
    kw = dict(model=MODEL, temperature=1.0, max_tokens=6)
    prompts, seed = PROMPTS[:2], 77
    listed = client.completions.create(prompt=prompts, n=2, seed=seed, **kw)
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(prompt=p, seed=seed + i, **kw)
             for p in prompts for i in range(2)]
    assert [c.text for c in listed.choices] == [a.choices[0].text for a in alone]
    assert listed.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])
    texts = [""] * 4
    for chunk in client.completions.create(prompt=prompts, n=2, seed=seed, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in listed.choices]
