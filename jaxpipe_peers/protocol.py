"""What the benchmark and a peer exchange: the request type, the job and result files, and
the throughput arithmetic both sides report with."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("openvino", "hf", "llamacpp")
# Distributions a peer's result records, from its own environment (None when missing).
VERSIONED = ("torch", "transformers", "openvino", "openvino-genai", "optimum-intel", "optimum",
             "llama-cpp-python")


@dataclass(frozen=True)
class Request:
    """One benchmark request: a prompt and exactly how many tokens to generate for it;
    `samples` > 1: that many completions of the prompt (a rollout: vLLM's `n`, OpenVINO's
    num_return_sequences), each `output_len` tokens sampled at temperature 1."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    samples: int = 1

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)


def throughput(requests: Sequence[Request], elapsed_s: float) -> dict:
    """requests/s, total (prompt + output) tok/s and output tok/s for `requests` served in
    `elapsed_s` seconds. Output tokens are the requests' own output_len (times their samples),
    nothing more; a prompt counts once however many samples it has."""
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len * r.samples for r in requests)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "requests_per_s": len(requests) / elapsed_s,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed_s,
        "output_tok_s": output_tokens / elapsed_s,
    }


def best_point(points: Sequence[dict]) -> dict:
    """The sweep point with the highest output tok/s (the first such on a tie)."""
    if not points:
        raise ValueError("a sweep needs at least one point")
    return max(points, key=lambda p: p["output_tok_s"])


def seconds_per_call(
    call: Callable[[], Any], sync: Callable[[Any], Any], repeats: int, min_seconds: float,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """`statistic` (the median; `min` for a peak) over `repeats` of the time per `call()`, each
    repeat running enough back-to-back calls to last >= `min_seconds` (amortising dispatch),
    synchronised once at its end."""
    sync(call())  # compile / first-touch
    start = time.perf_counter()
    sync(call())
    inner = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-6)))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = call()
        sync(out)
        per_call.append((time.perf_counter() - start) / inner)
    return statistic(per_call)


def versions() -> dict:
    """Python and the peer libraries' versions in this environment."""

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), **{d: version(d) for d in VERSIONED}}


def requests_to_json(requests: Sequence[Request]) -> list:
    """[[prompt ids], output_len(, samples when > 1)] per request: the job file's spelling of a
    workload."""
    return [[list(r.prompt_token_ids), r.output_len] + ([r.samples] if r.samples > 1 else [])
            for r in requests]


def requests_from_json(rows: Sequence[Sequence[Any]]) -> list[Request]:
    """The inverse of `requests_to_json`."""
    return [Request(tuple(int(i) for i in row[0]), int(row[1]), int(row[2]) if len(row) > 2 else 1)
            for row in rows]


def read_json(path: str | os.PathLike) -> dict:
    """A job or result file."""
    return json.loads(Path(path).read_text())


def write_json(data: dict, path: str | os.PathLike) -> None:
    """Write a job or result file whole: aside, then renamed, so a reader never sees half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
