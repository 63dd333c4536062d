"""Step times the engine measures once per model, layout and machine, for TD-Pipe's
decode -> prefill switch (`scheduler/tdpipe.py`'s `PhaseTiming`).

The engine runs pp micro-batches as one step (`scheduler.loop.Driver`), so one
micro-batch's time is the step's time at pp times its size, over pp. Decode steps are measured
at power-of-two row counts (context `CONTEXT` tokens each), prefill steps at a few token
counts; times in between are interpolated linearly. The table is cached as JSON under
`~/.cache/jaxpipe/timing/`, keyed by model, dtype, layout, device kind and jax version.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax

from jaxpipe.config.cache_dir import cache_dir
from jaxpipe.kv.device_cache import BLOCK, blocks_for
from jaxpipe.runtime.synthetic_step import median_seconds, step_call

CONTEXT = 256  # tokens of context behind each measured decode row
PREFILL_LENGTH = 64  # tokens per prompt in the measured prefill steps
REPEATS = 3

log = logging.getLogger("jaxpipe")


@dataclass(frozen=True)
class MeasuredTiming:
    """Piecewise-linear step times of one micro-batch: (size, seconds) points, ascending."""

    decode: tuple[tuple[int, float], ...]
    prefill: tuple[tuple[float, float], ...]

    @property
    def peak_batch(self) -> int:
        return self.decode[-1][0]

    def decode_seconds(self, batch: int) -> float:
        return _interpolate(self.decode, batch)

    def prefill_seconds(self, tokens: int) -> float:
        return _interpolate(self.prefill, tokens)


def _interpolate(points, x: float) -> float:
    """Linear between the points, proportional past the last, the first below it."""
    xs = [p for p, _ in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1] * x / points[-1][0]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def load_or_measure(runner, buckets, depth: int, model: str, dtype: str) -> MeasuredTiming:
    """The cached table for this runner's prefill layout, measured (and cached) if absent."""
    path = _cache_path(runner, model, dtype)
    if path.exists():
        data = json.loads(path.read_text())
        return MeasuredTiming(tuple(map(tuple, data["decode"])),
                              tuple(map(tuple, data["prefill"])))
    timing = measure(runner, buckets, depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: an engine starting beside this one reads a whole table or none.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"decode": timing.decode, "prefill": timing.prefill}))
    tmp.replace(path)
    return timing


class TimedStep(NamedTuple):
    """One step `measure` times: `batch` sequences of `length` tokens after `start`, counted
    in the table at `size` (a micro-batch's rows for decode, its tokens for prefill)."""

    size: float
    batch: int
    length: int
    start: int


def measure(runner, buckets, depth: int) -> MeasuredTiming:
    """Time decode and prefill steps on the runner (its KV blocks are overwritten)."""
    began = time.perf_counter()
    decode, prefill = timed_steps(buckets, runner.num_blocks, runner.max_len, depth)
    timing = MeasuredTiming(tuple((s.size, _seconds(runner, s) / depth) for s in decode),
                            tuple((s.size, _seconds(runner, s) / depth) for s in prefill))
    log.info("measured step times for tdpipe in %.1fs", time.perf_counter() - began)
    return timing


def timed_steps(buckets, num_blocks: int, max_len: int, depth: int
                ) -> tuple[list[TimedStep], list[TimedStep]]:
    """(decode steps, prefill steps) to time: pp micro-batches of 1, 2, 4, ... decode rows
    (context `CONTEXT`), and of 1, 4 and 16 prompts of `PREFILL_LENGTH` tokens. Every step is
    one the engine can run: at most `buckets.max_rows` sequences (a step has one row per
    sequence: 4 x 16 prompts on a 16-row engine would not fit), `buckets.max_tokens` tokens
    and `num_blocks` KV blocks, each sequence within `max_len`."""
    most_rows = min(buckets.max_rows, num_blocks)  # a block per decode row at least
    most = max(1, most_rows // depth)
    decode, batch = [], 1
    while True:
        rows = min(batch, most)
        n = min(rows * depth, most_rows)
        decode.append(TimedStep(rows, n, 1, _start(num_blocks, max_len, n, 1, CONTEXT)))
        if rows == most:
            break
        batch *= 2
    length = min(PREFILL_LENGTH, max_len, buckets.max_tokens)
    fit = max(1, min(buckets.max_tokens // length, num_blocks // blocks_for(length),
                     buckets.max_rows))
    counts = sorted({min(prompts * depth, fit) for prompts in (1, 4, 16)})
    prefill = [TimedStep(n * length / depth, n, length, 0) for n in counts]
    return decode, prefill


def _start(num_blocks: int, max_len: int, batch: int, length: int, start: int) -> int:
    """`start`, less if the KV pool cannot hold that much for all `batch` sequences, or it
    passes max_model_len."""
    fits = min(num_blocks // batch * BLOCK, max_len) - length
    return max(0, min(start, fits))


def _seconds(runner, step: TimedStep) -> float:
    """Median seconds of `step` on the runner."""
    return median_seconds(step_call(runner, step.batch, step.length, step.start), REPEATS)


def _cache_path(runner, model: str, dtype: str) -> Path:
    layout = runner.layouts["prefill"]
    device = jax.devices()[0]
    key = f"{model}|{dtype}|{layout}|{device.platform}|{device.device_kind}|{jax.__version__}"
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir("timing") / f"{name}.json"
