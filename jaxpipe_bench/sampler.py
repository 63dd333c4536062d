"""The device sampler against the host sampler on the same logits (scripts/bench_sampler.py).

Per rows x case: the device sampling program (as the runner calls it, penalty tables
included) and `HostSampler.sample` on host logits, each the median of `repeats` calls after
one warm-up; the host figure includes nothing of the logits' transfer (`fetch_ms` is that:
the [rows, V] f32 logits copied to host memory). Vocabulary 49152 (SmolLM2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.config.checks import check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.request.params import SamplingParams
from jaxpipe.runtime import runner, sampling
from jaxpipe.runtime.host_sampler import HostSampler
from jaxpipe.runtime.synthetic_step import median_seconds
from jaxpipe_bench.cli import check_sizes

VOCAB = 49152
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "top-p/k": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.2,
                                         presence_penalty=0.5),
}


@dataclass(frozen=True)
class SamplerBenchConfig:
    """What `scripts/bench_sampler.py` times (its flags, jaxpipe.config.flags).

    rows: the batch rows sampled in one step
    threads: the host sampler's worker threads (EngineConfig.sampler_threads)
    repeats: timed calls of each (the median is kept)
    json_path: write the points here (none: only the table)
    """

    rows: tuple[int, ...] = (32, 64, 128, 256)
    threads: int = EngineConfig.sampler_threads
    repeats: int = 7
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_sizes(self, "rows")
        check_counts(self, "threads", "repeats")


def _median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


def measure(rows: Sequence[int], threads: int, repeats: int, seed: int = 0) -> list[dict]:
    """One point per (rows, case): device_ms, host_ms, fetch_ms."""
    slots_total = max(rows)
    program = jax.jit(partial(runner._sample, out_rows=slots_total),
                      static_argnames=runner._STATIC, donate_argnames=("prompt_mask", "out_counts"))
    state = {"pm": jnp.zeros((slots_total, VOCAB), bool),
             "oc": jnp.zeros((slots_total, VOCAB), jnp.int32)}
    rng = np.random.default_rng(seed)
    host = HostSampler(slots_total, threads)
    for slot in range(slots_total):  # 200 prompt ids and 100 outputs seen per slot
        host.restore(slot, rng.integers(0, VOCAB, 200), rng.integers(0, VOCAB, 100))
    points = []
    try:
        for b in rows:
            logits = jnp.asarray((rng.standard_normal((b, VOCAB)) * 3).astype(np.float32))
            points += [_point(program, state, host, logits, case, p, repeats)
                       for case, p in CASES.items()]
    finally:
        host.close()
    return points


def _point(program, state: dict, host: HostSampler, logits, case: str, p, repeats: int) -> dict:
    b = logits.shape[0]
    x, slots = np.asarray(logits), np.arange(b, dtype=np.int32)
    params = [p] * b
    t = sampling.build_sampling_tensors(params, list(range(b)), [3] * b, [[]] * b, b)
    mode, pen = sampling.sampling_mode(params), sampling.uses_penalties(params)

    def device():
        tok, _, state["pm"], state["oc"] = program(
            logits, state["pm"], state["oc"], slots, t, mode=mode, penalties=pen,
            num_logprobs=None)
        tok.block_until_ready()

    return {"rows": b, "case": case, "device_ms": _median_ms(device, repeats),
            "host_ms": _median_ms(lambda: host.sample(x, slots, t, mode, pen), repeats),
            "fetch_ms": _median_ms(lambda: np.array(logits + 0), repeats)}


def render(points: list[dict], threads: int) -> str:
    head = f"{'rows':>5} {'case':<10} {'device ms':>9} {'host ms':>8} {'fetch ms':>8}  faster"
    lines = [f"sampling one step, V={VOCAB}, host on {threads} threads", head, "-" * len(head)]
    for p in points:
        faster = "host" if p["host_ms"] < p["device_ms"] else "device"
        lines.append(f"{p['rows']:>5} {p['case']:<10} {p['device_ms']:>9.2f} "
                     f"{p['host_ms']:>8.2f} {p['fetch_ms']:>8.2f}  {faster}")
    return "\n".join(lines)
