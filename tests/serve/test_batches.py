"""The Batch API (jaxpipe/serve/batches.py, http_batches.py) over a scripted engine, with the
official `openai` client: a round trip, cancelling, and a job a killed server left behind
finished by the next one with every custom_id once. No model runs."""

from __future__ import annotations

import json
import os

import pytest
from scripted_engine import MODEL, ScriptedEngine, until

from jaxpipe.serve.batch_runner import ClientRunner
from jaxpipe.serve.batches import Batches, FileStore
from jaxpipe.serve.http import HttpFrontEnd, HttpServer
from jaxpipe.serve.http_batches import BatchRoutes
from jaxpipe.serve.metrics import ServerMetrics

openai = pytest.importorskip("openai")

MAX_FILE_BYTES = 16384


def request_line(cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "max_tokens": 2, **body}})


GOOD = [request_line(f"r{i:02d}", prompt=[i + 1, 7]) for i in range(24)]
BAD = [request_line("bad-temperature", prompt=[1], temperature=-1), "not json"]


def batches_in(root, engine: ScriptedEngine, engine_back: bool = True):
    """(FileStore, Batches) over `root`, running on `engine` (8 requests in flight); after an
    engine loss a job waits for it (or, with engine_back=False, gives up as a stopping server
    does)."""
    files = FileStore(str(root))
    batches = Batches(str(root), files,
                      lambda prefix: ClientRunner(engine, None, MODEL, prefix, 8),
                      lambda: engine_back, 4096)
    return files, batches


@pytest.fixture
def served(tmp_path):
    """(openai client, scripted engine, Batches) of a front end with the Batch API."""
    engine = ScriptedEngine()
    files, batches = batches_in(tmp_path, engine)
    front = HttpFrontEnd(engine, None, MODEL, 4096, 4, ServerMetrics(lambda: None))
    BatchRoutes(files, batches, MAX_FILE_BYTES).add_to(front.app)
    server = HttpServer(front.app, "127.0.0.1", 0, drain_timeout=5)
    port = server.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=30)
    yield client, engine, batches
    server.stop()


def upload(client, lines: list[str]):
    return client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()),
                               purpose="batch")


def wait_status(client, batch_id: str, statuses=("completed", "cancelled", "failed")):
    """The batch once its status is one of `statuses` (polled)."""
    assert until(lambda: client.batches.retrieve(batch_id).status in statuses, timeout=30), \
        client.batches.retrieve(batch_id)
    return client.batches.retrieve(batch_id)


def records(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_round_trip_every_custom_id_once_and_errors_in_the_error_file(served):
    client, _, _ = served
    source = upload(client, GOOD + BAD)
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_status(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (26, 24, 2)
    out = records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == [f"r{i:02d}" for i in range(24)]
    first = next(r for r in out if r["custom_id"] == "r03")
    assert first["response"]["body"]["choices"][0]["token_ids"] == [4, 7]
    errors = {r["custom_id"]: r["error"] for r in records(client, batch.error_file_id)}
    assert errors["bad-temperature"]["param"] == "body.temperature"
    assert errors[None]["code"] == "invalid_json"


def test_a_line_with_n_gives_its_samples_as_choices(served):
    """A request of n=3 samples among single ones: one record with choices 0..2 (sample i's
    tokens, as the scripted engine answers under each sample's key), usage counting its
    prompt once."""
    client, _, _ = served
    source = upload(client, GOOD[:3] + [request_line("n3", prompt=[40, 9, 7], n=3)])
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_status(client, batch.id)
    assert (batch.status, batch.request_counts.completed) == ("completed", 4)
    body = next(r for r in records(client, batch.output_file_id)
                if r["custom_id"] == "n3")["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == [[40, 7], [41, 7], [42, 7]]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_cancel_aborts_what_is_in_flight(served):
    client, engine, _ = served
    engine.hold = True
    batch = client.batches.create(input_file_id=upload(client, GOOD).id,
                                  endpoint="/v1/completions", completion_window="24h")
    assert until(lambda: len(engine.pending) == 8)  # the runner's max_in_flight
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_status(client, batch.id)
    assert batch.status == "cancelled" and len(engine.aborted) == 8
    assert batch.request_counts.completed == 0 and batch.output_file_id is None


def test_bad_uploads_and_unknown_ids(served):
    client, _, _ = served
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-0000")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-0000", endpoint="/v1/completions",
                              completion_window="24h")


def test_batches_list_newest_first_in_pages(served):
    client, _, _ = served
    source = upload(client, GOOD[:2])
    made = [client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                  completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert page.has_more and len(page.data) == 2
    every = [b.id for b in client.batches.list(limit=2)]  # iterating follows `after`
    assert sorted(every) == sorted(made) and len(every) == 3
    listed = [(b.created_at, b.id) for b in client.batches.list().data]
    assert listed == sorted(listed, reverse=True)  # newest first, ids breaking ties
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.batches.list(limit=0)


def test_a_job_a_killed_server_left_is_finished_once(tmp_path):
    """The state SIGKILL leaves: a batch in progress, some records, the last one torn. A new
    Batches over the same directory resumes it: each custom_id ends with one record."""
    engine = ScriptedEngine()
    files, batches = batches_in(tmp_path, engine, engine_back=False)
    source = files.create(("\n".join(GOOD) + "\n").encode(), "input.jsonl", "batch")
    engine.hold = True  # the first server never finishes a request
    batch = batches.create(source["id"], "/v1/completions", None)
    assert until(lambda: len(engine.pending) == 8)
    records_path = os.path.join(tmp_path, "batches", f"{batch['id']}.records.jsonl")
    with open(records_path, "a", encoding="utf-8") as f:  # as if 3 had finished, 1 mid-write
        for i in range(3):
            f.write(json.dumps({"id": f"x{i}", "custom_id": f"r{i:02d}", "response": {
                "status_code": 200, "body": {}}, "error": None}) + "\n")
        f.write('{"id": "x3", "custom_id": "r03", "resp')
    # "killed": that Batches and its engine are abandoned; a new server starts over the dir
    fresh = ScriptedEngine()
    _, resumed = batches_in(tmp_path, fresh)
    resumed.resume()
    assert until(lambda: resumed.get(batch["id"])["status"] == "completed", timeout=30)
    done = resumed.get(batch["id"])
    out = [json.loads(x) for x in open(files.path(done["output_file_id"]), encoding="utf-8")]
    assert sorted(r["custom_id"] for r in out) == [f"r{i:02d}" for i in range(24)]
    assert done["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    engine.lose()  # ends the abandoned job's thread without a write (its server "stopped")


def _record(cid: str, failed: bool) -> str:
    error = {"code": "invalid_argument", "message": "no"} if failed else None
    return json.dumps({"id": f"x-{cid}", "custom_id": cid, "response": None if failed else {
        "status_code": 200, "body": {}}, "error": error}) + "\n"


def test_request_counts_follow_records_as_they_are_appended(tmp_path):
    """The counts are read on from where the last `get` stopped: after every append (a torn
    record not counted until its newline), and after the file is cut back, they are those
    of a fresh Batches that reads the files from the start."""
    files, batches = batches_in(tmp_path, ScriptedEngine())
    source = files.create(("\n".join(GOOD[:5]) + "\n").encode(), "input.jsonl", "batch")
    with open(os.path.join(tmp_path, "batches", "batch-t.json"), "w", encoding="utf-8") as f:
        json.dump({"id": "batch-t", "input_file_id": source["id"], "status": "in_progress",
                   "created_at": 0}, f)  # no job runs: the records are written by hand
    records = os.path.join(tmp_path, "batches", "batch-t.records.jsonl")

    def counts(b: Batches) -> tuple[int, int, int]:
        c = b.get("batch-t")["request_counts"]
        return c["total"], c["completed"], c["failed"]

    assert counts(batches) == (5, 0, 0)
    steps = [(_record("a", False), (5, 1, 0)), (_record("b", True), (5, 1, 1)),
             (_record("c", False)[:20], (5, 1, 1)), (_record("c", False)[20:], (5, 2, 1))]
    for text, expected in steps:
        with open(records, "a", encoding="utf-8") as f:
            f.write(text)
        assert counts(batches) == expected == counts(batches_in(tmp_path, ScriptedEngine())[1])
    with open(records, "w", encoding="utf-8") as f:  # cut back below what was read
        f.write(_record("d", True))
    assert counts(batches) == (5, 0, 1)
