"""One batch job: stream the input, skip what the output already holds, run the rest, append
each record as soon as its request ends, and summarise.

Every line ends with exactly one record: a result or an error keyed by its custom_id, or, for a
line that has no usable custom_id (not JSON, too long, no custom_id, a duplicate custom_id), an
error record keyed by its line number ("line": N).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from jaxpipe.batch import jobfile
from jaxpipe.batch.lookahead import DEFAULT_LOOKAHEAD
from jaxpipe.batch.openai import BatchLine, Failed, Finished, error_record, parse_line
from jaxpipe.batch.openai import success_record as ok_record
from jaxpipe.config.checks import check_counts
from jaxpipe.request.errors import RequestError
from jaxpipe.request.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class BatchJobConfig:
    """How a batch job runs, besides its files: `python -m jaxpipe.batch`'s own flags
    (`--server`, `--max-in-flight`, `--max-line-bytes`, `--no-progress`,
    `--prefix-lookahead`, `--tool-call-parser`).

    server: HOST:PORT of a running `python -m jaxpipe.serve` to send the requests to instead
        of loading the model in this process (the engine flags are then ignored)
    max_in_flight: requests outstanding at once; bounds memory
    max_line_bytes: longer input lines get an error record
    progress: a progress bar of requests and tokens/s
    prefix_lookahead: with the engine's prefix cache on (in this process), the next this
        many requests are read ahead and queued so that those sharing a prefix run close
        together (longest-prefix-match groups, jaxpipe.batch.lookahead); 1 keeps the input
        order. Records are written as requests finish, keyed by custom_id, either way
    tool_call_parser: how a chat answer with tool_choice "auto" is read for tool calls:
        "hermes" (Hermes / Qwen `<tool_call>` JSON) or "llama3_json" (Llama 3's JSON form)
    """

    server: str | None = None
    max_in_flight: int = 256
    max_line_bytes: int = 1 << 20
    progress: bool = True
    prefix_lookahead: int = DEFAULT_LOOKAHEAD
    tool_call_parser: str = "hermes"

    def __post_init__(self):
        check_counts(self, "max_in_flight", "max_line_bytes", "prefix_lookahead")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"BatchJobConfig.tool_call_parser must be one of "
                             f"{', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.server is not None and (not isinstance(self.server, str)
                                        or not self.server.strip()):
            raise ValueError(f"BatchJobConfig.server must be HOST:PORT or None, "
                             f"got {self.server!r}")


@dataclass
class Summary:
    """Counts of one run of a job."""

    lines: int = 0
    skipped: int = 0  # already had a record from an earlier run
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def text(self, output: str) -> str:
        rate = self.completion_tokens / max(self.seconds, 1e-9)
        return (f"jaxpipe.batch: {self.lines} lines: {self.succeeded} succeeded, {self.failed} "
                f"failed (error records), {self.skipped} skipped (already in {output})\n"
                f"jaxpipe.batch: {self.prompt_tokens} prompt + {self.completion_tokens} "
                f"completion tokens in {self.seconds:.1f} s ({rate:.1f} completion tok/s)")


class Job:
    """Runs INPUT -> OUTPUT with a runner (`LocalRunner` or `RemoteRunner`)."""

    def __init__(self, input_path: str, output_path: str, max_line_bytes: int,
                 progress: bool = True, tool_call_parser: str = "hermes"):
        self.input_path, self.output_path = input_path, output_path
        self.tool_call_parser = tool_call_parser
        self.max_line_bytes = max_line_bytes
        self.progress = progress
        self.summary = Summary()

    def run(self, runner) -> Summary:
        """Run every pending line; records are flushed as they are written."""

        self.summary.start = time.perf_counter()
        self._model = runner.model
        done = jobfile.scan_output(self.output_path)
        self.summary.lines = jobfile.count_lines(self.input_path)
        self._writer = jobfile.RecordWriter(self.output_path)
        self._bar = tqdm(total=self.summary.lines, unit="req", desc="jaxpipe.batch",
                         disable=not self.progress)
        try:
            runner.run(self._pending(done), self._emit)
        finally:
            self._bar.close()
            self._writer.close()
        return self.summary

    def _pending(self, done: jobfile.Done) -> Iterator[BatchLine]:
        seen: dict[str, int] = {}
        for number, raw, size in jobfile.read_lines(self.input_path, self.max_line_bytes):
            if number in done.lines:
                self._skip()
                continue
            obj, problem = self._decode(raw, size)
            cid = _custom_id(obj)
            if problem is None and cid is None:
                problem = ("invalid_argument", "every line needs a non-empty string custom_id",
                           "custom_id")
            if problem is None and cid in seen:
                problem = ("invalid_argument", f"duplicate custom_id {cid!r} (first on line "
                           f"{seen[cid]}); custom_ids must be unique", "custom_id")
            if problem is not None:
                self._record(error_record(cid, *problem, line=number), ok=False)
                continue
            seen[cid] = number
            if cid in done.custom_ids:
                self._skip()
                continue
            try:
                yield parse_line(obj, number)
            except RequestError as e:
                self._record(error_record(cid, "invalid_argument", e.message, e.field), ok=False)

    def _decode(self, raw: bytes | None, size: int):
        """(JSON object or None, None or (code, message, param) of a line-level problem)."""
        if raw is None:
            return None, ("invalid_argument", f"the line has {size} bytes; the limit is "
                          f"--max-line-bytes={self.max_line_bytes}", "line")
        try:
            return json.loads(raw), None
        except ValueError as e:
            return None, ("invalid_json", f"the line is not valid JSON: {e}", "line")

    def _emit(self, item: BatchLine, outcome: Finished | Failed) -> None:
        if isinstance(outcome, Failed):
            record = error_record(item.custom_id, outcome.code, outcome.message, outcome.param)
            self._record(record, ok=False)
            return
        self.summary.prompt_tokens += len(outcome.prompt_token_ids)
        self.summary.completion_tokens += outcome.completion_tokens
        self._record(ok_record(item, outcome, self._model, self.tool_call_parser), ok=True)

    def _record(self, record: dict, ok: bool) -> None:
        self._writer.write(record)
        if ok:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1
        self._bar.update(1)
        rate = self.summary.completion_tokens / max(self.summary.seconds, 1e-9)
        self._bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)

    def _skip(self) -> None:
        self.summary.skipped += 1
        self._bar.update(1)


def _custom_id(obj) -> str | None:
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None
