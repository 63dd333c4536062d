"""The OpenAI Batch API's state: uploaded files and batch jobs, kept under `--batch-dir` so that
a job survives a restart of the server and finishes each custom_id once.

    files/<file id>                  the bytes of an uploaded or produced file
    files/<file id>.json             its file object
    batches/<batch id>.json          the batch object (status, file ids, timestamps)
    batches/<batch id>.records.jsonl every record, appended as its request ends

A job is the JSONL batch machinery (`jaxpipe.batch.job.Job`) run by a `ClientRunner` over this
server's engine, on a thread of its own: it skips the custom_ids its records already hold, so
a job cut short (engine lost, server killed) is simply run again. When it ends, its records are
split into the output file (results) and the error file (error records), as OpenAI's are.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from jaxpipe.batch import jobfile
from jaxpipe.batch.job import Job
from jaxpipe.batch.runners import ServerError

log = logging.getLogger("jaxpipe.serve")

RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW = "24h"


def _write_json(path: str, obj: dict) -> None:
    """Replace `path` atomically: a kill leaves the old object or the new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class FileStore:
    """Files by id: uploads (purpose "batch") and batch results ("batch_output")."""

    def __init__(self, root: str):
        self.root = os.path.join(root, "files")
        os.makedirs(self.root, exist_ok=True)

    def create(self, data: bytes, filename: str, purpose: str) -> dict:
        file_id = _new_id("file")
        with open(self.path(file_id), "wb") as f:
            f.write(data)
        obj = {"id": file_id, "object": "file", "bytes": len(data),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed"}
        _write_json(self.path(file_id) + ".json", obj)
        return obj

    def get(self, file_id: str) -> dict | None:
        meta = self.path(file_id) + ".json"
        if not _safe_id(file_id) or not os.path.exists(meta):
            return None
        with open(meta, encoding="utf-8") as f:
            return json.load(f)

    def path(self, file_id: str) -> str:
        return os.path.join(self.root, file_id)


def _failed(record: bytes) -> bool:
    """Whether a record (one JSON line) is an error record: what splits the output from the
    error file, and what request_counts counts as failed."""
    return json.loads(record).get("error") is not None


def _safe_id(item_id: str) -> bool:
    """Ids become file names: letters, digits and '-' only."""
    return bool(item_id) and all(c.isalnum() or c == "-" for c in item_id)


class _Tally:
    """A batch's request counts, read incrementally: its input's lines counted once (the
    input file never changes), its records file read on from where the last read stopped."""

    def __init__(self):
        self.total: int | None = None  # lines of the input file, once it has been counted
        self.offset = 0  # bytes of whole records read so far
        self.done = self.failed = 0  # records among them; error records among those

    def counts(self, source: str, records: str) -> dict:
        """{"total", "completed", "failed"} as the files stand now."""
        if self.total is None and os.path.exists(source):
            self.total = jobfile.count_lines(source)
        if os.path.exists(records):
            self._read(records)
        return {"total": self.total or 0, "completed": self.done - self.failed,
                "failed": self.failed}

    def _read(self, path: str) -> None:
        if os.path.getsize(path) < self.offset:  # cut back under us: count it all again
            self.offset = self.done = self.failed = 0
        with open(path, "rb") as f:
            f.seek(self.offset)
            for raw in f:
                if not raw.endswith(b"\n"):  # a torn or half-written last record: not yet
                    break
                self.failed += _failed(raw)
                self.done += 1
                self.offset += len(raw)


class Batches:
    """Batch jobs: created, run on threads, cancelled, resumed after a restart.

    `runner(prefix)` builds the runner of one run of a job (a `ClientRunner`); `wait_engine()`
    blocks until the engine serves again (False: the server is stopping)."""

    def __init__(self, root: str, files: FileStore, runner: Callable, wait_engine: Callable,
                 max_line_bytes: int, tool_call_parser: str = "hermes"):
        self.root = os.path.join(root, "batches")
        os.makedirs(self.root, exist_ok=True)
        self.files, self.runner, self.wait_engine = files, runner, wait_engine
        self.max_line_bytes, self.tool_call_parser = max_line_bytes, tool_call_parser
        self._lock = threading.Lock()  # guards batch objects on disk
        self._runners: dict[str, object] = {}
        self._tallies: dict[str, _Tally] = {}  # by batch id
        self._tally_lock = threading.Lock()  # guards the tallies

    def resume(self) -> None:
        """Start again every job a previous server left unfinished."""
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".json"):
                batch = self.get(name[:-len(".json")])
                if batch is not None and batch["status"] in RUNNING:
                    log.info("resuming batch %s (%s)", batch["id"], batch["status"])
                    self._start(batch["id"])

    def create(self, input_file_id: str, endpoint: str, metadata: dict | None) -> dict:
        now = int(time.time())
        batch = {"id": _new_id("batch"), "object": "batch", "endpoint": endpoint,
                 "errors": None, "input_file_id": input_file_id, "completion_window": WINDOW,
                 "status": "validating", "output_file_id": None, "error_file_id": None,
                 "created_at": now, "in_progress_at": None, "expires_at": now + 86400,
                 "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": metadata}
        _write_json(self._path(batch["id"]), batch)
        self._start(batch["id"])
        return self.get(batch["id"])

    def get(self, batch_id: str) -> dict | None:
        """The batch object, its request_counts read from its records as they stand."""
        if not _safe_id(batch_id) or not os.path.exists(self._path(batch_id)):
            return None
        with self._lock, open(self._path(batch_id), encoding="utf-8") as f:
            batch = json.load(f)
        if batch["status"] not in ("completed", "cancelled", "failed"):
            batch["request_counts"] = self._counts(batch)
        return batch

    def list(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Up to `limit` batch objects, newest first, those after the batch `after` in that
        order (all of them if it is not known), and whether more follow."""
        ids = [name[:-len(".json")] for name in os.listdir(self.root) if name.endswith(".json")]
        found = [b for b in map(self.get, ids) if b is not None]
        found.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        ordered = [b["id"] for b in found]
        start = ordered.index(after) + 1 if after in ordered else 0
        return found[start:start + limit], start + limit < len(found)

    def cancel(self, batch_id: str) -> dict | None:
        batch = self.get(batch_id)
        if batch is None or batch["status"] not in RUNNING or batch["status"] == "finalizing":
            return batch
        self._update(batch_id, status="cancelling", cancelling_at=int(time.time()))
        runner = self._runners.get(batch_id)
        if runner is not None:
            runner.cancel()
        return self.get(batch_id)

    # ---- running ------------------------------------------------------------------------------

    def _start(self, batch_id: str) -> None:
        threading.Thread(target=self._run, args=(batch_id,), name=f"batch-{batch_id}",
                         daemon=True).start()

    def _run(self, batch_id: str) -> None:
        """The job's thread: run until every line has a record (or it is cancelled), then
        write the output and error files."""

        batch = self.get(batch_id)
        source = self.files.path(batch["input_file_id"])
        if batch["status"] == "validating":
            batch = self._update(batch_id, status="in_progress", in_progress_at=int(time.time()))
        attempt = 0
        while self.get(batch_id)["status"] == "in_progress":
            runner = self._runners[batch_id] = self.runner(f"{batch_id}-{attempt}")
            attempt += 1
            try:
                Job(source, self._records(batch_id), self.max_line_bytes, progress=False,
                    tool_call_parser=self.tool_call_parser).run(runner)
                break
            except ServerError as e:
                log.warning("batch %s paused: %s", batch_id, e)
                if not self.wait_engine():
                    return  # the server is stopping; the next one resumes the job
            except OSError as e:  # its input file is gone or unreadable
                log.error("batch %s failed: %s", batch_id, e)
                self._update(batch_id, status="failed", failed_at=int(time.time()), errors={
                    "object": "list", "data": [{"code": "input_unreadable", "message": str(e),
                                                "param": "input_file_id", "line": None}]})
                return
        self._runners.pop(batch_id, None)
        self._finish(batch_id)

    def _finish(self, batch_id: str) -> None:
        cancelled = self.get(batch_id)["status"] == "cancelling"
        if not cancelled:
            self._update(batch_id, status="finalizing", finalizing_at=int(time.time()))
        ok, bad = self._split(batch_id)
        counts = self._counts(self.get(batch_id))
        end = "cancelled" if cancelled else "completed"
        self._update(batch_id, status=end, output_file_id=ok, error_file_id=bad,
                     request_counts=counts, **{f"{end}_at": int(time.time())})
        log.info("batch %s %s: %s", batch_id, end, counts)

    def _split(self, batch_id: str) -> tuple[str | None, str | None]:
        """(output file id, error file id) from the records (None where there are none)."""
        jobfile.scan_output(self._records(batch_id))  # drops a torn last record
        ok, bad = [], []
        if os.path.exists(self._records(batch_id)):
            with open(self._records(batch_id), "rb") as f:
                for raw in f:
                    (bad if _failed(raw) else ok).append(raw)
        ids = []
        for lines, kind in ((ok, "output"), (bad, "errors")):
            ids.append(self.files.create(b"".join(lines), f"{batch_id}_{kind}.jsonl",
                                         "batch_output")["id"] if lines else None)
        return ids[0], ids[1]

    def _counts(self, batch: dict) -> dict:
        """The request counts of a batch, from its files as they stand."""
        with self._tally_lock:
            tally = self._tallies.setdefault(batch["id"], _Tally())
            return tally.counts(self.files.path(batch["input_file_id"]),
                                self._records(batch["id"]))

    def _update(self, batch_id: str, **fields) -> dict:
        with self._lock:
            with open(self._path(batch_id), encoding="utf-8") as f:
                batch = json.load(f)
            batch.update(fields)
            _write_json(self._path(batch_id), batch)
        return batch

    def _path(self, batch_id: str) -> str:
        return os.path.join(self.root, f"{batch_id}.json")

    def _records(self, batch_id: str) -> str:
        return os.path.join(self.root, f"{batch_id}.records.jsonl")
