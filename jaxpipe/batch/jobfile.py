"""The job's files: the input read as a stream of lines, the output appended record by record.

Resuming: `scan_output` reads what a previous (possibly killed) run wrote, drops a torn last
line, and returns the custom_ids and line numbers that already have a record, so a re-run
skips them and every request ends with exactly one record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

_CHUNK = 1 << 20


@dataclass
class Done:
    """What an output file already holds."""

    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)  # records of lines that were not requests

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)


def scan_output(path: str) -> Done:
    """Records already in `path` (a missing file is empty). Truncates a torn last line."""
    done = Done()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as f:
        good_end = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # a record cut short by a kill: drop it, it will be redone
            good_end += len(raw)
            _note(done, raw)
        f.truncate(good_end)
    return done


def _note(done: Done, raw: bytes) -> None:
    try:
        record = json.loads(raw)
    except ValueError:
        return
    if not isinstance(record, dict):
        return
    if isinstance(record.get("line"), int):
        done.lines.add(record["line"])
    elif isinstance(record.get("custom_id"), str):
        done.custom_ids.add(record["custom_id"])


def count_lines(path: str) -> int:
    """Non-empty lines in `path`, reading it in chunks (for the progress bar's total)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def read_lines(path: str, max_line_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """Yield (1-based line number, bytes or None if too long, length) for each non-blank line,
    never holding more than max_line_bytes of a line in memory."""
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                yield number, None, len(raw) + _skip_rest_of_line(f)
            elif raw.strip():
                yield number, raw, len(raw)


def _skip_rest_of_line(f) -> int:
    skipped = 0
    while True:
        raw = f.readline(_CHUNK)
        skipped += len(raw)
        if not raw or raw.endswith(b"\n"):
            return skipped


class RecordWriter:
    """Append JSON records to the output, one line each, flushed as soon as written."""

    def __init__(self, path: str):
        self._f = open(path, "a", encoding="utf-8")  # closed in close()

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
