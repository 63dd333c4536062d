"""The engine's step for a pipelined policy (the driver merges pp micro-batches into one step)
keeps within the step's budgets, for random request mixes and engine sizes: at most the largest
token bucket, and no more sequences than the rows of its bucket (`step_inputs.build` refuses
anything else). Pure Python: the policy is driven by the engine's loop (`Driver`, over an
executor that merges as the engine's does)."""

from __future__ import annotations

import random

from jaxpipe.runtime.buckets import Buckets
from jaxpipe.scheduler import Driver, Run, SchedulerState, SeqInfo, StepExecutor, make_policy
from jaxpipe.scheduler.throttle import ThrottleKnobs
from scheduler.helpers import LinearTiming

BLOCK = 16  # the device KV block (jaxpipe.kv.device_cache.BLOCK)


def engine_policy(name: str, depth: int, budget: int, rng: random.Random):
    """The policy as `executor._policy` makes it: each micro-batch's prompt budget is the
    step's over pp; the knobs vary."""
    opts = {"pipeline_depth": depth, "max_prefill_tokens": max(1, budget // depth)}
    if name == "throttle":
        opts["knobs"] = ThrottleKnobs(rng.choice([1, 4, 8]), rng.choice([32, 512, 2048, 8192]),
                                      rng.choice([0, 32]), rng.choice([0.0, 0.05, 0.3]))
    elif rng.random() < 0.5:
        opts.update(predictor=rng.choice(["learned", "oracle"]),
                    finish_ratio=rng.choice([0.1, 0.5, 1.0]))
    else:
        opts.update(predictor=rng.choice(["learned", "oracle"]), timing=LinearTiming())
    return make_policy(name, **opts)


def check_step(runs: list[Run], buckets: Buckets) -> None:
    """What `step_inputs.build` needs of the merged step (rows: one per sequence)."""
    seqs = [s.seq_id for r in runs for s in r.seqs]
    tokens = sum(r.prefill_tokens + len(r.decode) for r in runs)
    assert len(set(seqs)) == len(seqs), "a sequence in two micro-batches of one step"
    assert tokens <= buckets.max_tokens, (tokens, buckets.max_tokens)
    assert len(seqs) <= buckets.rows(buckets.tokens(tokens)), (len(seqs), tokens)


class MergingExecutor(StepExecutor):
    """Checks each merged step; every sequence runs to its max_output_len."""

    merge = True

    def __init__(self, buckets: Buckets):
        self.buckets, self.max_step_tokens = buckets, buckets.max_tokens

    def launch(self, runs, state):
        check_step(runs, self.buckets)
        return [s.seq_id for r in runs for s in r.sampling() if s.generated + 1 >= s.max_output_len]

    def land(self, ended, state):
        return ended

    def execute(self, action, state):
        pass


def drive_steps(name: str, rng: random.Random) -> int:
    """One random engine and workload, run to the end; returns the steps taken."""
    seqs_max, depth = rng.choice([1, 3, 8, 16, 64]), rng.choice([2, 4, 8])
    batched = rng.choice([16, 64, 256, 2048, 4096])
    pool = BLOCK * rng.randint(16, 300)
    if name == "throttle":  # room for every slot's whole request: throttle admits prompts
        pool = max(pool, seqs_max * BLOCK * 23)  # it cannot finish together and then thrashes
    buckets = Buckets.for_engine(seqs_max, 512, batched)
    policy = engine_policy(name, depth, min(batched, buckets.max_tokens), rng)
    state = SchedulerState(pool, seqs_max, device_unit=BLOCK)
    for i in range(rng.randint(1, 60)):
        prompt = rng.randint(1, min(300, pool - BLOCK))
        state.add(SeqInfo(i, prompt, rng.randint(1, min(60, pool - prompt))))
    return Driver(policy, state, MergingExecutor(buckets)).run(max_steps=20_000)


def test_tdpipe_steps_keep_within_the_step_budgets():
    rng = random.Random(1)
    for _ in range(100):
        drive_steps("tdpipe", rng)


def test_throttle_steps_keep_within_the_step_budgets():
    rng = random.Random(2)
    for _ in range(100):
        drive_steps("throttle", rng)
