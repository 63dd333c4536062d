"""The steps TD-Pipe's step-time table is measured on are steps the engine can build: within
the step's rows, tokens and KV blocks (pure Python and numpy: the inputs are built, not run)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from jaxpipe.kv.device_cache import blocks_for
from jaxpipe.runtime import pipeline
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.step_timing import timed_steps
from jaxpipe.runtime.synthetic_step import uniform_inputs


@dataclass
class ShapesOnly:
    """What `uniform_inputs` reads of a runner."""

    buckets: Buckets
    num_blocks: int
    max_len: int
    depth: int

    @property
    def max_blocks(self) -> int:
        return blocks_for(self.max_len)

    def microbatches(self, tokens: int) -> int:
        return pipeline.microbatches(tokens, self.depth)


def check_fits(runner: ShapesOnly) -> list:
    """Build every timed step's inputs (raises if one does not fit); the steps."""
    decode, prefill = timed_steps(runner.buckets, runner.num_blocks, runner.max_len,
                                  runner.depth)
    for step in decode + prefill:
        assert step.batch <= runner.buckets.max_rows
        assert step.batch * step.length <= runner.buckets.max_tokens
        assert step.batch * blocks_for(step.start + step.length) <= runner.num_blocks
        assert step.start + step.length <= runner.max_len
        inputs = uniform_inputs(runner, step.batch, step.length, step.start)
        assert inputs.table.shape[0] >= step.batch
    return decode + prefill


def test_prefill_steps_keep_within_the_rows_of_a_small_batch_engine():
    """The issue's engine: 16 rows, 4096 tokens, 2048 tokens of KV, pp=4. 4 x 16 prompts of
    64 tokens were cut to what the tokens and KV allow (32) but not to the 16 rows."""
    runner = ShapesOnly(Buckets.for_engine(16, 256, 4096), 2048 // 16, 256, 4)
    steps = check_fits(runner)
    assert max(s.batch for s in steps) == 16


def test_every_timed_step_fits_random_engines():
    rng = random.Random(0)
    for _ in range(300):
        max_len = rng.choice([16, 64, 100, 256, 2048])
        seqs = rng.randint(1, 300)
        buckets = Buckets.for_engine(seqs, max_len, rng.randint(16, 8192))
        num_blocks = rng.randint(blocks_for(max_len), 4 * blocks_for(max_len) + 600)
        check_fits(ShapesOnly(buckets, num_blocks, max_len, rng.choice([1, 2, 3, 4, 8])))
