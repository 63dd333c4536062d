"""The OpenAI Batch API's routes on the HTTP front end (on with `--batch-dir`):

    POST /v1/files                    upload a JSONL input (multipart: file, purpose="batch")
    GET  /v1/files/{id}               the file object
    GET  /v1/files/{id}/content       its bytes (inputs, and batches' output and error files)
    POST /v1/batches                  {"input_file_id", "endpoint", "completion_window"}
    GET  /v1/batches                  the batches, newest first (?limit=1..100, ?after=<id>)
    GET  /v1/batches/{id}             the batch object, request_counts as they stand
    POST /v1/batches/{id}/cancel      stop it; what finished is in its output file

Jobs and files live in `batches.py`; this module only speaks HTTP. Handlers that read files
are plain functions, which FastAPI runs on worker threads, off the event loop.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jaxpipe.request.openai import CHAT_URL, COMPLETIONS_URL
from jaxpipe.serve.batches import WINDOW, Batches, FileStore
from jaxpipe.serve.http import ApiError

MAX_LIST = 100  # batches one list page holds at most (OpenAI's limit)


class BatchRoutes:
    """Handlers over a FileStore and Batches; uploads larger than `max_file_bytes` get 413."""

    def __init__(self, files: FileStore, batches: Batches, max_file_bytes: int):
        self.files, self.batches, self.max_file_bytes = files, batches, max_file_bytes

    def add_to(self, app: FastAPI) -> None:
        app.post("/v1/files")(self.upload)
        app.get("/v1/files/{file_id}")(self.file)
        app.get("/v1/files/{file_id}/content")(self.content)
        app.post("/v1/batches")(self.create)
        app.get("/v1/batches")(self.list)
        app.get("/v1/batches/{batch_id}")(self.batch)
        app.post("/v1/batches/{batch_id}/cancel")(self.cancel)

    async def upload(self, request: Request) -> dict:
        size = int(request.headers.get("content-length") or 0)
        if size > self.max_file_bytes:
            raise ApiError(413, f"the upload has {size} bytes; this server's limit is "
                           f"{self.max_file_bytes} (--max-file-mb)")
        form = await request.form(max_files=1)
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise ApiError(400, f"purpose: only 'batch' files are accepted, got {purpose!r}",
                           "purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "file: give the JSONL file as a multipart 'file' part", "file")
        data = await upload.read()
        if len(data) > self.max_file_bytes:
            raise ApiError(413, f"the file has {len(data)} bytes; this server's limit is "
                           f"{self.max_file_bytes} (--max-file-mb)")
        return self.files.create(data, upload.filename or "input.jsonl", purpose)

    def file(self, file_id: str) -> dict:
        return self._file(file_id)

    def content(self, file_id: str) -> Response:
        self._file(file_id)
        with open(self.files.path(file_id), "rb") as f:
            return Response(f.read(), media_type="application/jsonl")

    def _file(self, file_id: str) -> dict:
        obj = self.files.get(file_id)
        if obj is None:
            raise ApiError(404, f"no file {file_id!r}", "file_id")
        return obj

    async def create(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        source = self.files.get(str(body.get("input_file_id")))
        if source is None or source["purpose"] != "batch":
            raise ApiError(400 if source else 404, f"input_file_id: no batch input file "
                           f"{body.get('input_file_id')!r}", "input_file_id")
        if body.get("endpoint") not in (CHAT_URL, COMPLETIONS_URL):
            raise ApiError(400, f"endpoint: must be {CHAT_URL} or {COMPLETIONS_URL}, got "
                           f"{body.get('endpoint')!r}", "endpoint")
        if body.get("completion_window", WINDOW) != WINDOW:
            raise ApiError(400, f"completion_window: only {WINDOW!r} is supported",
                           "completion_window")
        return self.batches.create(source["id"], body["endpoint"], body.get("metadata"))

    def list(self, limit: str = "20", after: str | None = None) -> dict:
        """OpenAI's cursor page: `after` is the last id of the page before."""
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST:
            raise ApiError(400, f"limit: must be an integer from 1 to {MAX_LIST}, got "
                           f"{limit!r}", "limit")
        data, more = self.batches.list(int(limit), after)
        return {"object": "list", "data": data, "has_more": more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    def batch(self, batch_id: str) -> dict:
        return self._batch(self.batches.get(batch_id), batch_id)

    def cancel(self, batch_id: str) -> dict:
        return self._batch(self.batches.cancel(batch_id), batch_id)

    @staticmethod
    def _batch(obj: dict | None, batch_id: str) -> dict:
        if obj is None:
            raise ApiError(404, f"no batch {batch_id!r}", "batch_id")
        return obj
