"""Servers of their own (these tests end them): the engine process killed under load, and
SIGTERM draining in-flight requests. Every call has a deadline, so a hang fails the test with
DEADLINE_EXCEEDED instead of blocking the run. What they check is the server's, not the
model's: their servers run the two-layer SmolLM2 of tests/conftest.py (`tiny_smollm2`), which
loads and compiles in moments where the 30-layer model takes tens of seconds per engine."""

from __future__ import annotations

import json
import os
import signal
import threading

import grpc
import psutil
import pytest
from conftest import ServerProcess, gguf_dir
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_engine import until

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

# Long enough that the tiny model (a few ms a step) is still generating when the engine is
# killed or the server told to drain: prompt (chat template included, ~35 tokens) + 200 fit
# the servers' max_model_len of 256.
DRAIN_TOKENS = 200
LONG = pb.SamplingParams(temperature=0.0, max_tokens=DRAIN_TOKENS, ignore_eos=True)


@pytest.fixture
def server(tmp_path, tiny_smollm2):
    s = ServerProcess("--model", tiny_smollm2, "--restart-backoff", "3",
                      log_path=tmp_path / "server.log")
    s.wait_serving()
    yield s
    s.stop()


def started_stream(stub, sampling):
    """A Generate call that has already produced its first token, and its responses so far."""
    call = stub.Generate(pb.GenerateRequest(text="Tell me a long story.", sampling=sampling),
                         timeout=120)
    return call, [next(call)]


def health_status(health) -> list:
    return [health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            for service in ("", "jaxpipe.v1.Generation")]


def test_engine_killed_gives_unavailable_then_is_restarted(server):
    """In-flight calls fail UNAVAILABLE, new ones too while the engine is down (health
    NOT_SERVING); the front end starts a new engine process and serves again."""
    with grpc.insecure_channel(server.address) as ch:
        stub, health = pb_grpc.GenerationStub(ch), health_pb2_grpc.HealthStub(ch)
        call, _ = started_stream(stub, LONG)
        batch = stub.GenerateBatch(pb.BatchRequest(items=[
            pb.BatchItem(custom_id=f"b{i}", text=f"Story {i}:", sampling=LONG) for i in range(3)]),
            timeout=120)
        first_pid = server.engine_pid()
        os.kill(first_pid, signal.SIGKILL)
        for pending in (call, batch):
            with pytest.raises(grpc.RpcError) as info:
                list(pending)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "engine process exited" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # within the 3 s before the restart
            list(stub.Generate(pb.GenerateRequest(text="Hi"), timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "restarted" in info.value.details()
        assert set(health_status(health)) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        server.wait_serving()
        assert server.engine_pid() != first_pid
        out = list(stub.Generate(pb.GenerateRequest(
            text="Hi", sampling=pb.SamplingParams(temperature=0.0, max_tokens=3)), timeout=120))
        assert out[-1].finish_reason in ("length", "stop")
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == "zombie"


def test_the_server_exits_when_restarts_run_out(tmp_path, tiny_smollm2):
    """--engine-restarts 0: the first engine death is final: the server stops, exit code 1."""
    s = ServerProcess("--model", tiny_smollm2, "--engine-restarts", "0",
                      log_path=tmp_path / "server.log")
    try:
        s.wait_serving()
        os.kill(s.engine_pid(), signal.SIGKILL)
        assert s.proc.wait(timeout=60) == 1
        assert "gone for good" in s.log()
    finally:
        s.stop()


def started_http_stream(server, model: str):
    """An OpenAI-API chat stream (DRAIN_TOKENS tokens, usage at the end) from the server's
    `model` that has sent its first chunk, and its chunks so far."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    stream = iter(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
        temperature=0, max_tokens=DRAIN_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    return stream, [next(stream)]


def test_sigterm_drains_in_flight_requests_then_exits(server, tiny_smollm2):
    """Three gRPC streams and one HTTP stream in flight at SIGTERM all finish."""
    engine_pid = server.engine_pid()
    results: dict[int, list] = {}
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        calls = [started_stream(stub, LONG) for _ in range(3)]
        http_stream, http_chunks = started_http_stream(server, tiny_smollm2)
        server.proc.send_signal(signal.SIGTERM)
        http_chunks += list(http_stream)

        def finish(i, call, got):
            results[i] = got + list(call)

        threads = [threading.Thread(target=finish, args=(i, *c)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert server.proc.wait(120) == 0
    assert http_chunks[-1].usage.completion_tokens == DRAIN_TOKENS
    assert [c.choices[0].finish_reason for c in http_chunks if c.choices][-1] == "length"
    for i in range(3):
        responses = results[i]
        assert sum(len(r.token_ids) for r in responses) == DRAIN_TOKENS
        assert responses[-1].finish_reason == "length"
    assert not psutil.pid_exists(engine_pid) or \
        psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    assert "SIGTERM received: draining" in server.log()


@pytest.mark.slow  # a kill-and-resume job: a minute
def test_batch_api_job_survives_sigkill_and_finishes_each_custom_id_once(tmp_path):
    """A Batch API job (openai client: files.create, batches.create, poll, files.content) on a
    server killed with SIGKILL mid-batch; a server restarted over the same --batch-dir
    finishes it: every custom_id once, the bad line in the error file."""
    openai = pytest.importorskip("openai")
    gguf_dir()
    batch_dir = str(tmp_path / "batches")
    lines = [json.dumps({"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "smollm2-135m", "prompt": f"Fact {i}:",
                                  "max_tokens": 16, "temperature": 0, "ignore_eos": True}})
             for i in range(48)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "x", "top_p": 0}}))
    first = ServerProcess("--batch-dir", batch_dir, log_path=tmp_path / "first.log")
    try:
        first.wait_serving()
        client = openai.OpenAI(base_url=first.http_url + "/v1", api_key="unused",
                               max_retries=0, timeout=60)
        source = client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 8,
                     timeout=300, every=0.1), first.log()
        first.proc.kill()
    finally:
        first.stop()
    second = ServerProcess("--batch-dir", batch_dir, log_path=tmp_path / "second.log")
    try:
        second.wait_serving()
        client = openai.OpenAI(base_url=second.http_url + "/v1", api_key="unused",
                               max_retries=0, timeout=60)
        assert until(lambda: client.batches.retrieve(batch.id).status == "completed",
                     timeout=300, every=0.5), second.log()
        done = client.batches.retrieve(batch.id)
        assert f"resuming batch {batch.id}" in second.log()
        out, errors = ([json.loads(x) for x in client.files.content(file_id).text.splitlines()]
                       for file_id in (done.output_file_id, done.error_file_id))
    finally:
        second.stop()
    assert sorted(r["custom_id"] for r in out) == [f"r{i:02d}" for i in range(48)]
    assert all(len(r["response"]["body"]["choices"][0]["token_ids"]) == 16 for r in out)
    assert [(e["custom_id"], e["error"]["param"]) for e in errors] == [("bad", "body.top_p")]
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (49, 48, 1)
