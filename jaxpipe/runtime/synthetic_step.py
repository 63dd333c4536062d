"""The synthetic step and its median wall time: what the engine compiles at warm-up (padding
only) and what TD-Pipe's step table (`step_timing`), the planner's calibration and the
benchmarks time (`batch` sequences of `length` tokens: prefill starts at 0, decode is length 1
at the context's end; on a pipelined layout they flow through the stages as `microbatches`
micro-batches, pp by default, and the pipeline drains after them). Here, below all three, so
that none imports another for it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxpipe.kv.device_cache import blocks_for
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.step_inputs import Piece, StepInputs

SYNTHETIC_IDS = 200  # token ids of a synthetic step are below it (every vocabulary is larger)


def padding_inputs(runner, tokens: int) -> StepInputs:
    """A step of the `tokens` bucket that is all padding: it writes no KV and no penalty state."""
    return _build(runner, [], tokens)


def uniform_pieces(runner, batch: int, length: int, start: int = 0) -> list[Piece]:
    """`batch` sequences of `length` tokens after `start`; sequence r holds blocks
    r*n .. r*n+n-1 (n: what start + length positions need), seeded random token ids below
    `SYNTHETIC_IDS`: one id for every token would route every token of an MoE model to the
    same experts, and the step would read 2 of 8 experts' weights where a real one reads
    nearly all."""
    per_seq = blocks_for(start + length)
    if not fits(batch, start + length, runner.num_blocks):
        raise ValueError(f"{batch} sequences of {start + length} positions need "
                         f"{batch * per_seq} KV blocks; the runner has {runner.num_blocks}")
    ids = np.random.default_rng(0).integers(1, SYNTHETIC_IDS, (batch, length)).tolist()
    return [Piece(ids[r], start, list(range(r * per_seq, (r + 1) * per_seq)))
            for r in range(batch)]


def fits(sequences: int, positions: int, num_blocks: int) -> bool:
    """Whether `sequences` synthetic sequences of `positions` positions each fit a pool of
    `num_blocks` KV blocks (`uniform_pieces` gives each its own blocks)."""
    return sequences * blocks_for(positions) <= num_blocks


def uniform_inputs(runner, batch: int, length: int, start: int = 0) -> StepInputs:
    """The step of `uniform_pieces`, in one micro-batch."""
    return _build(runner, uniform_pieces(runner, batch, length, start),
                  runner.buckets.tokens(batch * length))


def _build(runner, pieces: list[Piece], tokens: int) -> StepInputs:
    return step_inputs.build(pieces, tokens, runner.buckets.rows(tokens), runner.max_blocks)


def step_call(runner, batch: int, length: int, start: int = 0,
              microbatches: int | None = None) -> Callable[[], jax.Array]:
    """A call running that step (its sequences split over `microbatches` micro-batches, the
    layout's pp by default) and its LM head over every sequence (blocks until done)."""
    pieces = uniform_pieces(runner, batch, length, start)
    m = min(microbatches or runner.layout.pp, batch)
    parts = [pieces[i::m] for i in range(m)]
    steps = [(_build(runner, part, runner.buckets.tokens(len(part) * length)), len(part))
             for part in parts]

    return lambda: jax.block_until_ready(runner.logits_many(steps))


def median_seconds(call: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `call()` (which must block until its result is ready), after one
    untimed call that compiles it."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
