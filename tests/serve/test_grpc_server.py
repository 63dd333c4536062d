"""`python -m jaxpipe.serve` as a subprocess, called with the generated stub over loopback.

Expected outputs come from the in-process `Engine.generate` (the shared `engine` fixture, same
configuration as the server): an independent path through the same model.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxpipe import SamplingParams
from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

TOKENS = 5
SUBJECTS = ["The capital of France is", "Water boils at", "My favourite colour is",
            "The best way to learn is", "In the morning I", "A good book about",
            "The river flows", "Computers are"]
# 24 distinct prompts: three streams per client thread, three times the server's 8 rows.
PROMPTS = [f"{s} (note {i}):" for i in range(3) for s in SUBJECTS]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def channel(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def greedy_pb(max_tokens: int = TOKENS, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def stream_one(stub, prompt: str, sampling: pb.SamplingParams):
    """(token ids, text, last response) of one streamed Generate call."""
    ids, text, last = [], "", None
    for resp in stub.Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=300):
        ids += resp.token_ids
        text += resp.text
        last = resp
    return ids, text, last


def wait_idle(stub, deadline_s: float = 60.0) -> pb.ServerInfo:
    """Poll GetServerInfo until the engine has nothing unfinished (or the deadline passes)."""
    end = time.monotonic() + deadline_s
    info = stub.GetServerInfo(pb.ServerInfoRequest())
    while (info.unfinished_requests or info.engine_has_unfinished) and time.monotonic() < end:
        time.sleep(0.2)
        info = stub.GetServerInfo(pb.ServerInfoRequest())
    return info


# ---- health, reflection, info -----------------------------------------------------------------


def test_health_reports_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "jaxpipe.v1.Generation"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [reply] = list(stub.ServerReflectionInfo(iter([request])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"jaxpipe.v1.Generation", "grpc.health.v1.Health"} <= names
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="jaxpipe.v1.Generation")
    [reply] = list(stub.ServerReflectionInfo(iter([request])))
    assert reply.file_descriptor_response.file_descriptor_proto  # clients can build the API


def test_server_info_describes_the_engine(stub, grpc_server):
    info = stub.GetServerInfo(pb.ServerInfoRequest())
    assert (info.model, info.max_model_len, info.max_num_seqs) == ("smollm2-135m", 256, 8)
    assert info.engine_alive and info.engine_pid not in (0, grpc_server.proc.pid)


# ---- results equal Engine.generate ------------------------------------------------------------


def test_24_streams_from_8_threads_equal_engine_generate(stub, engine):
    expected = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: stream_one(stub, p, greedy_pb()), PROMPTS))
    for (ids, text, last), want in zip(got, expected, strict=True):
        assert ids == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert last.finish_reason == want.outputs[0].finish_reason
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        assert last.usage.completion_tokens == len(ids)


def batch_cases():
    """16 items, four of each kind, twice the server's rows: (custom_id, prompt, sampling
    params)."""
    cases = []
    for i in range(16):
        prompt = PROMPTS[i]
        kind = i % 4
        if kind == 0:
            sp = {"temperature": 0.0, "max_tokens": 4 + i % 5}
        elif kind == 1:
            sp = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1000 + i, "max_tokens": 6}
        elif kind == 2:
            sp = {"temperature": 0.0, "max_tokens": 12, "stop": [" "], "logprobs": 2}
        else:
            sp = {"temperature": 0.0, "max_tokens": 10, "repetition_penalty": 1.3,
                  "presence_penalty": 0.5}
        cases.append((f"item-{i:02d}", prompt, sp))
    return cases


def test_generate_batch_16_items_per_item_params_equal_engine_generate(stub, engine):
    cases = batch_cases()
    expected = engine.generate([p for _, p, _ in cases], [SamplingParams(**sp)
                                                          for _, _, sp in cases])
    items = [pb.BatchItem(custom_id=cid, text=p, sampling=pb.SamplingParams(**sp))
             for cid, p, sp in cases]
    results = list(stub.GenerateBatch(pb.BatchRequest(items=items), timeout=300))
    assert sorted(r.custom_id for r in results) == [cid for cid, _, _ in cases]
    by_id = {r.custom_id: r for r in results}
    for (cid, _, sp), want in zip(cases, expected, strict=True):
        got, w = by_id[cid].completion, want.outputs[0]
        assert by_id[cid].WhichOneof("result") == "completion"
        assert (list(got.token_ids), got.text, got.finish_reason) == \
            (w.token_ids, w.text, w.finish_reason)
        if "logprobs" in sp:
            assert [[e.token_id for e in t.entries] for t in got.logprobs] == \
                [list(d) for d in w.logprobs]
    assert any(by_id[cid].completion.stop_string == " " for cid, _, _ in cases)


def test_n_samples_stream_and_batch_each_sample_equal_to_engine_generate(stub, engine):
    # seeded at temperature 1: sample i is the engine's sample i (seed + i), by its index
    sampling = dict(temperature=1.0, seed=7, max_tokens=TOKENS, n=3)
    [want] = engine.generate(PROMPTS[0], SamplingParams(**sampling))
    streamed = {}
    for resp in stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
            **sampling)), timeout=300):
        streamed.setdefault(resp.index, []).extend(resp.token_ids)
    assert streamed == {o.index: o.token_ids for o in want.outputs}
    item = pb.BatchItem(custom_id="x", text=PROMPTS[0], sampling=pb.SamplingParams(**sampling))
    results = list(stub.GenerateBatch(pb.BatchRequest(items=[item]), timeout=300))
    assert sorted((r.custom_id, r.completion.index) for r in results) == [("x", i)
                                                                          for i in range(3)]
    assert {r.completion.index: list(r.completion.token_ids) for r in results} == \
        {o.index: o.token_ids for o in want.outputs}
    assert len({tuple(o.token_ids) for o in want.outputs}) > 1  # the samples differ


def test_chat_and_token_id_prompts(stub, engine):
    [want] = engine.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=24))
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT])
    items = [pb.BatchItem(custom_id="chat", chat=chat, sampling=greedy_pb(24)),
             pb.BatchItem(custom_id="ids", token_ids=pb.TokenIds(ids=want.prompt_token_ids),
                          sampling=greedy_pb(24))]
    by_id = {r.custom_id: r.completion for r in stub.GenerateBatch(pb.BatchRequest(items=items))}
    for cid in ("chat", "ids"):
        assert list(by_id[cid].token_ids) == want.outputs[0].token_ids
        assert by_id[cid].text == want.outputs[0].text
        assert list(by_id[cid].prompt_token_ids) == want.prompt_token_ids
    # Ended by EOS: finish_reason "stop" with no stop_reason (that is for stop_token_ids/stop).
    assert by_id["chat"].finish_reason == "stop" and by_id["chat"].token_ids[-1] == 2
    assert by_id["chat"].WhichOneof("stop_reason") is None


# ---- cancellation -----------------------------------------------------------------------------


def test_cancel_mid_stream_frees_the_slot(stub):
    before = stub.GetServerInfo(pb.ServerInfoRequest())
    call = stub.Generate(pb.GenerateRequest(
        text="Count slowly:", sampling=greedy_pb(200, ignore_eos=True)))
    first = next(call)
    assert first.finish_reason == ""
    assert stub.GetServerInfo(pb.ServerInfoRequest()).unfinished_requests == 1
    call.cancel()
    info = wait_idle(stub)
    assert info.unfinished_requests == 0 and not info.engine_has_unfinished
    assert info.aborted_requests == before.aborted_requests + 1
    ids, _, last = stream_one(stub, "Hello", greedy_pb(4))  # still serving
    assert len(ids) == 4 and last.finish_reason == "length"
