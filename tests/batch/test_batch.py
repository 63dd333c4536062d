"""`python -m jaxpipe.batch`: OpenAI batch format in and out, bad lines, resume after kill -9,
and --server mode. Expected completions come from `Engine.generate` / `Engine.chat`."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpipe import SamplingParams
from jaxpipe.batch.__main__ import main as batch_main
from jaxpipe.batch.job import BatchJobConfig, Job
from jaxpipe.batch.runners import LocalRunner

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def line(cid, url="/v1/completions", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def good_lines() -> list[str]:
    lines = [line(f"c{i}", prompt=f"Fact {i}:", max_tokens=6, temperature=0) for i in range(5)]
    lines.append(line("chat", "/v1/chat/completions", messages=CHAT, max_tokens=20,
                      temperature=0, logprobs=True, top_logprobs=2))
    lines.append(line("ids", prompt=[1, 504, 2988], max_tokens=5, temperature=0, stop=[" the"]))
    return lines


BAD_LINES = {  # custom_id -> (line, expected error param)
    "unknown-key": (line("unknown-key", prompt="x", best_of=2), "body.best_of"),
    "no-prompt": (line("no-prompt", max_tokens=3), "body.prompt"),
    "empty": (line("empty", prompt=""), "body.prompt"),
    "too-long": (line("too-long", prompt="word " * 400), "body.prompt"),
    "vocab": (line("vocab", prompt=[1, 10**6]), "body.prompt[1]"),
    "max-tokens-0": (line("max-tokens-0", prompt="x", max_tokens=0), "body.max_tokens"),
    "max-tokens-big": (line("max-tokens-big", prompt="x", max_tokens=5000), "body.max_tokens"),
    "temp": (line("temp", prompt="x", temperature=-1), "body.temperature"),
    "top-p": (line("top-p", prompt="x", top_p=0), "body.top_p"),
    "top-k": (line("top-k", prompt="x", top_k=-7), "body.top_k"),
    "penalty": (line("penalty", prompt="x", presence_penalty=9), "body.presence_penalty"),
    "role": (line("role", "/v1/chat/completions", messages=[{"role": "x", "content": "y"}]),
             "body.messages[0].role"),
    "url": (json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings",
                        "body": {}}), "url"),
}
LINE_ERRORS = ["{this is not json", json.dumps({"method": "POST", "body": {}}),
               line("c0", prompt="duplicate of c0"), "x" * 5000]


def write_input(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def engine_outputs(engine) -> dict:
    """custom_id -> the engine's own output for each good line (the expected completions)."""
    want = {f"c{i}": engine.generate(f"Fact {i}:", SamplingParams(temperature=0, max_tokens=6))
            for i in range(5)}
    want["chat"] = engine.chat(CHAT, SamplingParams(temperature=0, max_tokens=20, logprobs=2))
    want["ids"] = engine.generate(prompt_token_ids=[[1, 504, 2988]], sampling_params=SamplingParams(
        temperature=0, max_tokens=5, stop=[" the"]))
    return {cid: out.outputs[0] for cid, [out] in want.items()}


def check_against_engine(want: dict, by_id: dict) -> None:
    for i in range(5):
        choice = by_id[f"c{i}"]["response"]["body"]["choices"][0]
        assert (choice["text"], choice["token_ids"]) == (want[f"c{i}"].text,
                                                         want[f"c{i}"].token_ids)
    body = by_id["chat"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want["chat"].text}
    assert len(body["choices"][0]["logprobs"]["content"]) == len(want["chat"].token_ids)
    assert body["usage"]["completion_tokens"] == len(want["chat"].token_ids)
    assert by_id["ids"]["response"]["body"]["choices"][0]["text"] == want["ids"].text


def check_job_output(path: Path, want: dict) -> None:
    out = records(path)
    keyed = [r for r in out if "line" not in r]
    counts = collections.Counter(r["custom_id"] for r in keyed)
    expected_ids = {f"c{i}" for i in range(5)} | {"chat", "ids"} | set(BAD_LINES)
    assert set(counts) == expected_ids and set(counts.values()) == {1}
    by_id = {r["custom_id"]: r for r in keyed}
    for cid, (_, param) in BAD_LINES.items():
        assert by_id[cid]["response"] is None and by_id[cid]["error"]["param"] == param, cid
    line_records = sorted((r for r in out if "line" in r), key=lambda r: r["line"])
    assert [r["error"]["param"] for r in line_records] == ["line", "custom_id", "custom_id",
                                                           "line"]
    check_against_engine(want, by_id)


@pytest.fixture(scope="module")
def want(engine) -> dict:
    """The engine's outputs for the good lines, computed once for both modes' checks."""
    return engine_outputs(engine)


@pytest.fixture(scope="module")
def job_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    lines = good_lines() + [x for x, _ in BAD_LINES.values()] + LINE_ERRORS
    write_input(path, lines)
    return path


def test_in_process_job_gives_one_record_per_line(engine, want, job_input, tmp_path):
    output = tmp_path / "out.jsonl"
    summary = Job(str(job_input), str(output), 4096, progress=False).run(
        LocalRunner(engine, max_in_flight=4))
    assert (summary.succeeded, summary.failed, summary.skipped) == (7, 17, 0)
    check_job_output(output, want)
    again = Job(str(job_input), str(output), 4096, progress=False).run(
        LocalRunner(engine, max_in_flight=4))
    assert (again.succeeded, again.failed, again.skipped) == (0, 0, 24)
    assert len(records(output)) == 24


N_LINES = [line("n3", prompt="Fact 9:", max_tokens=5, temperature=1.0, seed=5, n=3),
           line("chat2", "/v1/chat/completions", messages=CHAT, max_tokens=6, temperature=0,
                n=2)]


def test_a_line_with_n_gives_n_choices_and_counts_its_prompt_once(engine, tmp_path):
    """n=3 seeded: choice i equals a request seeded seed + i (generate, n=1); n=2 greedy chat:
    both choices are the greedy answer; usage counts the prompt once and every sample's
    tokens."""
    path, output = tmp_path / "n.jsonl", tmp_path / "out.jsonl"
    write_input(path, N_LINES)
    summary = Job(str(path), str(output), 4096, progress=False).run(
        LocalRunner(engine, max_in_flight=4))
    assert (summary.succeeded, summary.failed) == (2, 0)
    check_n_output(output, engine)


def test_server_mode_gives_n_choices_too(grpc_server, engine, tmp_path):
    """The same n lines through --server: GenerateBatch's n results per item, by index."""
    path, output = tmp_path / "n.jsonl", tmp_path / "out.jsonl"
    write_input(path, N_LINES)
    code = batch_main([str(path), "-o", str(output), "--server", grpc_server.address,
                       "--max-line-bytes", "4096", "--no-progress"])
    assert code == 0
    check_n_output(output, engine)


def check_n_output(output, engine) -> None:
    by_id = {r["custom_id"]: r["response"]["body"] for r in records(output)}
    alone = [engine.generate("Fact 9:", SamplingParams(temperature=1.0, max_tokens=5,
                                                       seed=5 + i))[0] for i in range(3)]
    body = by_id["n3"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == [a.outputs[0].token_ids for a in alone]
    assert [c["text"] for c in body["choices"]] == [a.outputs[0].text for a in alone]
    assert body["usage"]["prompt_tokens"] == len(alone[0].prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(a.outputs[0].token_ids) for a in alone)
    [single] = engine.chat(CHAT, SamplingParams(temperature=0, max_tokens=6))
    chat = by_id["chat2"]
    assert [c["message"]["content"] for c in chat["choices"]] == [single.outputs[0].text] * 2
    assert chat["usage"]["prompt_tokens"] == len(single.prompt_token_ids)


def test_server_mode_matches(grpc_server, want, job_input, tmp_path):
    output = tmp_path / "out.jsonl"
    code = batch_main([str(job_input), "-o", str(output), "--server", grpc_server.address,
                       "--max-line-bytes", "4096", "--no-progress", "--max-in-flight", "8"])
    assert code == 0
    check_job_output(output, want)


def test_unreachable_server_fails_clearly():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from jaxpipe.batch import runners

    with pytest.raises(runners.ServerError, match=f"cannot reach a jaxpipe server at .*{port}"):
        runners.RemoteRunner(f"127.0.0.1:{port}", 8, timeout=1)


@pytest.mark.slow
def test_killed_job_resumes_and_every_custom_id_ends_once(tmp_path):
    n = 16
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, [line(f"r{i:02d}", prompt=f"Story {i}:", max_tokens=8, temperature=0,
                              ignore_eos=True) for i in range(n)])
    cmd = [sys.executable, "-m", "jaxpipe.batch", str(source), "-o", str(output), "--no-progress",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2",
           "--max-in-flight", "2", "--no-warmup"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while (not output.exists() or len(output.read_text().splitlines()) < 2) and \
                time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    first = len(output.read_text().splitlines())
    assert 2 <= first < n, "the job must be killed midway"
    with open(output, "a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r')  # a record torn by the kill
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{n - first} succeeded, 0 failed" in done.stderr
    assert f"{first} skipped" in done.stderr
    out = records(output)  # every line parses: the torn record was dropped
    counts = collections.Counter(r["custom_id"] for r in out)
    assert counts == {f"r{i:02d}": 1 for i in range(n)}
    assert all(len(r["response"]["body"]["choices"][0]["token_ids"]) == 8 for r in out)


@pytest.mark.parametrize("module, flags", [
    ("jaxpipe.serve", ["--model", "--dtype", "--mesh", "--prefill", "--decode", "--scheduler",
                       "--host-kv-gb", "--port", "--host", "--max-message-mb",
                       "--max-request-bytes", "--max-concurrent-requests", "--drain-timeout",
                       "--max-model-len", "--max-num-seqs", "--kv-cache-gb", "127.0.0.1",
                       "--http-port", "--http-host", "--no-http", "--no-grpc"]),
    ("jaxpipe.batch", ["INPUT.jsonl", "--output", "--server", "--max-in-flight",
                       "--max-line-bytes", "--no-progress", "--model", "--dtype", "--mesh",
                       "resume"]),
])
def test_help_is_complete(module, flags):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert out.returncode == 0
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, out.stdout


@pytest.mark.parametrize("flags, message", [
    (["--max-in-flight", "0"], "BatchJobConfig.max_in_flight must be an integer >= 1, got 0"),
    (["--max-line-bytes", "-1"], "BatchJobConfig.max_line_bytes must be an integer >= 1, got -1"),
    (["--server", " "], "BatchJobConfig.server must be HOST:PORT or None, got ' '"),
    (["--tool-call-parser", "xml"], "BatchJobConfig.tool_call_parser must be one of hermes, "
     "llama3_json, got 'xml'"),
])
def test_bad_job_flag_is_a_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        batch_main(["in.jsonl", "-o", "out.jsonl", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_job_flags_build_the_job_config():
    from jaxpipe.batch.__main__ import build_parser
    from jaxpipe.config.flags import config_from_args

    p = build_parser()
    args = p.parse_args(["in.jsonl", "-o", "out.jsonl", "--server", "h:1", "--no-progress",
                         "--max-in-flight", "8", "--tool-call-parser", "llama3_json"])
    assert config_from_args(BatchJobConfig, args, p) == BatchJobConfig(
        server="h:1", max_in_flight=8, progress=False, tool_call_parser="llama3_json")
    assert config_from_args(BatchJobConfig, p.parse_args(["i", "-o", "o"]), p) == BatchJobConfig()


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TOOL_LINES = [
    line(cid, "/v1/chat/completions", messages=CHAT, tools=[WEATHER_TOOL], max_tokens=60,
         temperature=0, tool_choice=choice)
    for cid, choice in (("named", {"type": "function", "function": {"name": "get_weather"}}),
                        ("required", "required"),
                        ("unknown", {"type": "function", "function": {"name": "nope"}}))]


def test_tool_lines_in_process_are_valid_calls(engine, tmp_path):
    """Chat lines with a forced tool call: each choice's message holds calls whose arguments
    fit the tool's schema (checked by hand); a line naming an unknown tool gets an error
    record naming body.tool_choice."""
    path, output = tmp_path / "tools.jsonl", tmp_path / "out.jsonl"
    write_input(path, TOOL_LINES)
    summary = Job(str(path), str(output), 4096, progress=False).run(
        LocalRunner(engine, max_in_flight=4))
    assert (summary.succeeded, summary.failed) == (2, 1)
    by_id = {r["custom_id"]: r for r in records(output)}
    assert by_id["unknown"]["error"]["param"] == "body.tool_choice"
    for cid in ("named", "required"):
        choice = by_id[cid]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] == "get_weather"
            args = json.loads(call["function"]["arguments"])
            assert set(args) == {"city", "days"} and isinstance(args["city"], str)
            assert len(args["city"]) <= 12 and type(args["days"]) is int
            assert 1 <= args["days"] <= 7


def test_server_mode_refuses_tool_lines_clearly(grpc_server, tmp_path):
    """gRPC carries no tools: such a line gets an error record naming body.tools, the rest of
    the job runs."""
    path, output = tmp_path / "tools.jsonl", tmp_path / "out.jsonl"
    write_input(path, TOOL_LINES[:1] + [line("plain", prompt="Fact 1:", max_tokens=3)])
    code = batch_main([str(path), "-o", str(output), "--server", grpc_server.address,
                       "--no-progress"])
    assert code == 0
    by_id = {r["custom_id"]: r for r in records(output)}
    assert by_id["named"]["error"]["param"] == "body.tools"
    assert "HTTP Batch API" in by_id["named"]["error"]["message"]
    assert by_id["plain"]["response"]["status_code"] == 200
