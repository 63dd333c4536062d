"""Step times the engine measures once per model, layout and machine, for TD-Pipe's
decode -> prefill switch (`scheduler/tdpipe.py`'s `PhaseTiming`).

The engine runs pp micro-batches as one step (`Executor._microbatch_step`), so one
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
import time
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxpipe.cache_dir import cache_dir
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.synthetic_step import median_seconds, step_call

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
    path.write_text(json.dumps({"decode": timing.decode, "prefill": timing.prefill}))
    return timing


def measure(runner, buckets, depth: int) -> MeasuredTiming:
    """Time decode and prefill steps on the runner (its KV blocks are overwritten)."""
    start = time.perf_counter()
    most = max(1, min(buckets.max_rows, runner.num_blocks) // depth)  # a block per row
    decode = []
    batch = 1
    while True:
        rows = min(batch, most)
        decode.append((rows, _seconds(runner, rows * depth, 1, CONTEXT) / depth))
        if rows == most:
            break
        batch *= 2
    length = min(PREFILL_LENGTH, runner.max_len)
    fit = max(1, min(buckets.max_tokens // length, runner.num_blocks // -(-length // BLOCK)))
    prefill = {}
    for n in sorted({min(prompts * depth, fit) for prompts in (1, 4, 16)}):
        prefill[n * length / depth] = _seconds(runner, n, length, 0) / depth
    log.info("measured step times for tdpipe in %.1fs", time.perf_counter() - start)
    return MeasuredTiming(tuple(decode), tuple(sorted(prefill.items())))


def _seconds(runner, batch: int, length: int, start: int) -> float:
    """Median seconds of a step of `batch` sequences of `length` tokens after `start` (less
    if the KV pool cannot hold that much for all of them, or it passes max_model_len)."""
    fits = min(runner.num_blocks // batch * BLOCK, runner.max_len) - length
    return median_seconds(step_call(runner, batch, length, max(0, min(start, fits))), REPEATS)


def _cache_path(runner, model: str, dtype: str) -> Path:
    layout = runner.layouts["prefill"]
    device = jax.devices()[0]
    key = f"{model}|{dtype}|{layout}|{device.platform}|{device.device_kind}|{jax.__version__}"
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir("timing") / f"{name}.json"
