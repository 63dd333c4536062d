"""One engine over two processes of 4 virtual CPU devices each (gloo on 127.0.0.1), against
one process of 8 (`cpu-8`): the same greedy tokens on layouts whose pp (prefill) or tp
(decode) crosses the process boundary, under seesaw and prefill_first, with a device KV pool
small enough that sequences are preempted and swapped through the host tier. Then the server:
a follower killed mid-generation fails the leader's calls UNAVAILABLE (the call's deadline
would turn a hang into DEADLINE_EXCEEDED) and the rejoined cluster serves again. Every
process is started here and killed at the end, whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from child import save_tiny, workload
from conftest import SERVE_ARGS, ServerProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe_bench.multihost import clean_env, cluster_port

CHILD = Path(__file__).with_name("child.py")
ROOT = Path(__file__).resolve().parents[2]
SCHEDULERS = ("prefill_first", "seesaw")  # prefill_first on the prefill layout, then seesaw
# pp crossing the process boundary in prefill; tp=8 (crossing it) in decode.
PAIRS = [("pp=2,tp=4", "tp=8"), ("pp=8", "tp=8")]
TIMEOUT = 600  # seconds a run may take before the test fails (and kills its processes)

pytestmark = pytest.mark.slow  # minutes of multi-process runs: `make test-slow`


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_tiny(path)
    return str(path)


def child_env() -> dict:
    return dict(clean_env(), PYTHONPATH=str(ROOT))


def cluster_args(port: int, process: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
            "--process-id", str(process)]


def run(model: str, tmp: Path, prefill: str, decode: str, processes: int,
        *extra_args: str) -> dict:
    """The child's runs (scheduler -> tokens, stats) on one process or two."""
    out, port = tmp / f"out{processes}.json", cluster_port()
    base = [sys.executable, str(CHILD), model, str(out), "--prefill", prefill, "--decode",
            decode, "--schedulers", ",".join(SCHEDULERS), *extra_args]
    logs = [tmp / f"p{processes}-{i}.log" for i in range(processes)]
    procs = []
    try:
        for i, log in enumerate(logs):
            extra = cluster_args(port, i) if processes > 1 else []
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(base + extra, stdout=f, stderr=subprocess.STDOUT,
                                              env=child_env()))
        codes = [p.wait(TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                      for log in logs)
    assert codes == [0] * processes, tails
    return json.loads(out.read_text())


def test_two_processes_give_the_prompt_logprobs_of_one(tiny, tmp_path):
    """Requests asking for prompt logprobs beside others, the prefill's pp crossing the
    process boundary: the leader sends each step's scored positions to the follower."""
    args = ("pp=8", "tp=8")
    one = run(tiny, tmp_path, *args, 1, "--prompt-logprobs", "3")
    two = run(tiny, tmp_path, *args, 2, "--prompt-logprobs", "3")
    for name in SCHEDULERS:
        assert two[name]["tokens"] == one[name]["tokens"], name
        got, want = two[name]["prompt_logprobs"], one[name]["prompt_logprobs"]
        assert [g is None for g in got] == [i % 2 == 0 for i in range(len(got))]
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            for ge, we in zip(g or [], w or [], strict=True):
                assert (ge is None) == (we is None)
                if ge is not None:
                    assert [t for t, _ in ge] == [t for t, _ in we]
                    np.testing.assert_allclose([v for _, v in ge], [v for _, v in we],
                                               atol=1e-4, rtol=0)


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_two_processes_give_the_tokens_of_one(tiny, tmp_path, prefill, decode):
    one = run(tiny, tmp_path, prefill, decode, 1)
    two = run(tiny, tmp_path, prefill, decode, 2)
    prompts, _ = workload()
    for name in SCHEDULERS:
        assert two[name]["tokens"] == one[name]["tokens"], name
        assert len(two[name]["tokens"]) == len(prompts)
        stats = two[name]["stats"]
        assert stats["preemptions"] > 0, name
        if name == "seesaw":  # both layouts, the host tier both ways
            assert stats["transitions"] > 0 and stats["swap_out_bytes"] > 0
            assert stats["swap_in_bytes"] == stats["swap_out_bytes"]
        assert stats["control_messages"] >= stats["steps"] > 0, name
        assert "control_messages" not in one[name]["stats"]
    # prefill_first decodes on the pp layout: each micro-batch entering took the tokens of the
    # one that had just left the last stage, on both processes (followers keep pp steps)
    assert two["prefill_first"]["stats"]["fed_steps"] > 0


def test_the_leaders_token_masks_reach_every_process(tmp_path):
    """Constrained requests of every kind (tests/structured_workload.py) beside others on
    SmolLM2's tokenizer: only the leader holds the grammars; the masks travel in the sampling
    inputs, and two processes give the tokens of one."""
    from conftest import write_tiny_smollm2

    model = write_tiny_smollm2(tmp_path / "ckpt")
    one = run(model, tmp_path, *PAIRS[0], 1, "--structured")
    two = run(model, tmp_path, *PAIRS[0], 2, "--structured")
    for name in SCHEDULERS:
        assert two[name]["tokens"] == one[name]["tokens"], name
        assert two[name]["stats"]["preemptions"] > 0, name


def test_followers_mirror_the_prefix_cache_host_tier(tiny, tmp_path):
    """Prompts sharing a stem, the prefix cache on, a 6-block pool: blocks evicted to the
    host tier and copied back (and moved by the switches) on every process, the same
    tokens as one process."""
    one = run(tiny, tmp_path, *PAIRS[0], 1, "--prefix-caching")
    two = run(tiny, tmp_path, *PAIRS[0], 2, "--prefix-caching")
    for name in SCHEDULERS:
        assert two[name]["tokens"] == one[name]["tokens"], name
    stats = [two[name]["stats"] for name in SCHEDULERS]
    assert all(s["prefix_cache_hit_tokens"] > 0 for s in stats)
    assert sum(s["prefix_cache_host_hit_tokens"] for s in stats) > 0


def test_followers_mirror_the_copies_on_write_of_samples(tiny, tmp_path):
    """Requests of n=2 greedy samples: the samples share their prompt's blocks and copy the
    last partly filled one on every process; the same tokens as one process, each sample
    the same as its sibling (greedy)."""
    one = run(tiny, tmp_path, *PAIRS[0], 1, "--samples")
    two = run(tiny, tmp_path, *PAIRS[0], 2, "--samples")
    for name in SCHEDULERS:
        assert two[name]["samples"] == one[name]["samples"], name
        assert all(a == b for a, b in one[name]["samples"]), name
    stats = two["prefill_first"]["stats"]  # (seesaw's samples prefill themselves)
    assert stats["forked_samples"] > 0 and stats["fork_copied_blocks"] > 0


# ---- the server, and a follower that dies ------------------------------------------------------

LONG = pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SERVE = ["--model", "{model}", "--mesh", "cpu-8", "--prefill", "pp=2,tp=4", "--decode", "tp=8",
         "--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-tokens", "2048",
         "--host-kv-tokens", "2048"]


def serve_args(model: str) -> list[str]:
    return [a.format(model=model) for a in SERVE]


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status


def follower_process(model: str, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "jaxpipe.serve", *SERVE_ARGS, *serve_args(model),
             *cluster_args(port, 1), "--engine-restarts", "3", "--restart-backoff", "1"],
            stdout=f, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)


def follower_child(proc: subprocess.Popen) -> int:
    """The pid of the follower CLI's JAX process (its child)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children()
        if children:
            return children[0].pid
        time.sleep(0.2)
    raise AssertionError("the follower CLI started no follower process")


def test_a_dead_follower_fails_calls_unavailable_and_the_cluster_serves_again(tiny, tmp_path):
    port = cluster_port()
    leader = ServerProcess(*serve_args(tiny), *cluster_args(port, 0), "--engine-restarts", "3",
                           "--restart-backoff", "1", log_path=tmp_path / "leader.log")
    follower = follower_process(tiny, port, tmp_path / "follower.log")
    everyone = []
    try:
        leader.wait_serving(timeout=TIMEOUT)
        everyone = [leader.proc.pid, follower.pid, *(c.pid for c in psutil.Process(
            leader.proc.pid).children(recursive=True)), follower_child(follower)]
        with grpc.insecure_channel(leader.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                                    sampling=LONG), timeout=120)
            assert not next(call).finish_reason  # generating
            os.kill(follower_child(follower), signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert health(leader.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            leader.wait_serving(timeout=TIMEOUT)  # the follower CLI rejoined; a new leader
            out = list(stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=4)), timeout=120))
            assert out[-1].finish_reason == "length"
            assert health(leader.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        leader.stop()
        os.killpg(follower.pid, signal.SIGKILL)
        follower.wait()
    for pid in everyone:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid


# ---- a batch job over two processes, and a follower that dies ------------------------------------


def batch_processes(model: str, tmp: Path, port: int, tag: str) -> list[subprocess.Popen]:
    """The leader's and the follower's `python -m jaxpipe.batch` (same command and flags)."""
    procs = []
    for i in (1, 0):
        with open(tmp / f"batch-{tag}-{i}.log", "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxpipe.batch", str(tmp / "in.jsonl"), "-o",
                 str(tmp / "out.jsonl"), "--no-progress", *SERVE_ARGS, *serve_args(model),
                 *cluster_args(port, i)],
                stdout=f, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True))
    return procs


def results(tmp: Path) -> list[dict]:
    path = tmp / "out.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_a_batch_job_resumes_exactly_once_after_a_follower_dies(tiny, tmp_path):
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(16):
            body = {"prompt": [5 + i, 6, 7], "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")
    follower, leader = batch_processes(tiny, tmp_path, cluster_port(), "first")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not results(tmp_path) and leader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(follower_child(follower), signal.SIGKILL)
        assert leader.wait(TIMEOUT) != 0  # stopped: the job was not done
        follower.wait(TIMEOUT)
    finally:
        for p in (follower, leader):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    before = len(results(tmp_path))
    assert 0 < before < 16
    follower, leader = batch_processes(tiny, tmp_path, cluster_port(), "again")
    try:
        assert leader.wait(TIMEOUT) == 0, (tmp_path / "batch-again-0.log").read_text()[-3000:]
        assert follower.wait(TIMEOUT) == 0
    finally:
        for p in (follower, leader):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    rows = results(tmp_path)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(16))
    assert all(r["error"] is None for r in rows)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 200 for r in rows)
