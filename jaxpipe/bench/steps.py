"""Synthetic steps for benchmarks and calibration: `batch` sequences of `length` tokens each,
as one ragged step on a runner (prefill: start 0; decode: length 1 at the context's end)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpipe import step_inputs
from jaxpipe.kv.device_cache import blocks_for
from jaxpipe.step_inputs import Piece, StepInputs


def uniform_inputs(runner, batch: int, length: int, start: int = 0,
                   microbatches: int | None = None) -> StepInputs:
    """The step's inputs; sequence r holds blocks r*n .. r*n+n-1 (n: what start + length
    positions need), token ids 1."""
    per_seq = blocks_for(start + length)
    if batch * per_seq > runner.num_blocks:
        raise ValueError(f"{batch} sequences of {start + length} positions need "
                         f"{batch * per_seq} KV blocks; the runner has {runner.num_blocks}")
    pieces = [Piece([1] * length, start, list(range(r * per_seq, (r + 1) * per_seq)))
              for r in range(batch)]
    tokens = runner.buckets.tokens(batch * length)
    m = microbatches or runner.microbatches(tokens)
    return step_inputs.build(pieces, tokens, m, runner.buckets.rows(tokens), runner.max_blocks)


def step_call(runner, batch: int, length: int, start: int = 0,
              microbatches: int | None = None) -> Callable[[], jax.Array]:
    """A call running that step and its LM head over every sequence (blocks until done)."""
    inputs = uniform_inputs(runner, batch, length, start, microbatches)
    return lambda: jax.block_until_ready(runner.logits(inputs, batch))
