"""Batch lines with structured outputs (`response_format`, vLLM's `structured_outputs`): a
JSONL job in process and through --server (gRPC) gives outputs that parse and fit their
constraint, checked by pydantic, `json.loads`, `re.fullmatch` and list membership; a line
whose schema does not compile gets an error naming the body key while the rest run."""

from __future__ import annotations

import json
import re

import pytest

from jaxpipe.batch.__main__ import main as batch_main
from jaxpipe.batch.job import Job
from jaxpipe.batch.runners import LocalRunner

pydantic = pytest.importorskip("pydantic")

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
LABELS = ["yes", "no", "maybe"]
YEAR = "1[0-9]{3}|20[0-9]{2}"


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=99)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "City", "schema": City.model_json_schema(), "strict": True}}


def line(cid: str, url: str = CHAT_URL, **body) -> str:
    if url == CHAT_URL:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"max_tokens": 120, "seed": 1, **body}})


LINES = [
    line("city-0", prompt="Describe Paris.", response_format=SCHEMA_FORMAT, temperature=0),
    line("city-1", prompt="Tell me about Lima.", response_format=SCHEMA_FORMAT, temperature=1),
    line("city-2", COMPLETIONS_URL, prompt="A city as JSON:", response_format=SCHEMA_FORMAT,
         temperature=0),
    line("object", prompt="Reply in JSON: your name.", temperature=0,
         response_format={"type": "json_object"}),
    line("choice", COMPLETIONS_URL, prompt="Is the sky blue? Answer:", temperature=1,
         structured_outputs={"choice": LABELS}),
    line("regex", COMPLETIONS_URL, prompt="The Eiffel Tower was built in", temperature=0,
         structured_outputs={"regex": YEAR}),
]
BAD = {  # custom_id -> (line, the error's param)
    "bad-schema": (line("bad-schema", prompt="Hi", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"type": "integr"}}}}}),
        "body.structured_outputs.json"),
    "two": (line("two", prompt="Hi", response_format={"type": "json_object"},
                 structured_outputs={"regex": "a"}), "body.structured_outputs"),
    "format": (line("format", prompt="Hi", response_format={"type": "xml"}),
               "body.response_format.type"),
}


def text_of(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


def check(path) -> None:
    by_id = {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(by_id) == {json.loads(x)["custom_id"] for x in LINES} | set(BAD)
    for cid in ("city-0", "city-1", "city-2"):
        City.model_validate_json(text_of(by_id[cid]))
    assert isinstance(json.loads(text_of(by_id["object"])), dict)
    assert text_of(by_id["choice"]) in LABELS
    assert re.fullmatch(YEAR, text_of(by_id["regex"]))
    for cid, (_, param) in BAD.items():
        assert by_id[cid]["response"] is None and by_id[cid]["error"]["param"] == param, cid


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured") / "in.jsonl"
    path.write_text("\n".join(LINES + [x for x, _ in BAD.values()]) + "\n")
    return path


def test_in_process_job_outputs_fit_their_constraints(engine, job_input, tmp_path):
    output = tmp_path / "out.jsonl"
    summary = Job(str(job_input), str(output), 4096, progress=False).run(
        LocalRunner(engine, max_in_flight=8))
    assert (summary.succeeded, summary.failed) == (len(LINES), len(BAD))
    check(output)


def test_server_mode_outputs_fit_their_constraints(grpc_server, job_input, tmp_path):
    output = tmp_path / "out.jsonl"
    code = batch_main([str(job_input), "-o", str(output), "--server", grpc_server.address,
                       "--max-line-bytes", "4096", "--no-progress", "--max-in-flight", "8"])
    assert code == 0
    check(output)
