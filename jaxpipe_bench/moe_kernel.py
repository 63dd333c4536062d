"""MoE experts on the CPU: `model/moe.py`'s three paths ("dense": every expert on every
token; "ragged": XLA's `ragged_dot` on the sorted pairs; "grouped": the C++ grouped kernel on
them) per expert shape and token count.

Each point times one jitted `experts_mlp` call per path in interleaved rounds (dense,
ragged, grouped, dense, ...) so that a contended machine's slow spells fall on all of them, and
reports each path's median ms and its GFLOP/s of useful work (the k experts each token
chose: 2 * T * k * 3 * E * F). "ragged" is left out where its CPU lowering (k times the dense
FLOPs) would exceed `ragged_max_gflop`.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.config.checks import check_counts
from jaxpipe.model import moe
from jaxpipe_bench.cli import check_sizes, dims

# (X experts, top-k, hidden E, expert intermediate F)
CASES: tuple[tuple[int, int, int, int], ...] = ((8, 2, 256, 512), (64, 8, 256, 512),
                                                 (64, 8, 1024, 768))
TOKENS: tuple[int, ...] = (8, 64, 512)
EXPERTS_PATHS = ("dense", "ragged", "grouped")


@dataclass(frozen=True)
class MoeKernelConfig:
    """What `scripts/bench_moe_kernel.py` times (its flags, jaxpipe.config.flags).

    tokens: the token counts T
    cases: the expert shapes, each XxKxExF (experts, top-k, hidden, intermediate)
    rounds: interleaved rounds of each point (the median is kept)
    ragged_max_gflop: skip ragged_dot where its CPU lowering does more work than this
    json_path: write the points here, with the machine (none: only the table)
    """

    tokens: tuple[int, ...] = TOKENS
    cases: tuple[str, ...] = tuple("x".join(map(str, c)) for c in CASES)
    rounds: int = 5
    ragged_max_gflop: float = 20.0
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_sizes(self, "tokens")
        check_counts(self, "rounds")
        if not self.cases:
            raise ValueError("MoeKernelConfig.cases must be one or more XxKxExF, got ()")
        self.expert_shapes()

    def expert_shapes(self) -> list[tuple[int, int, int, int]]:
        """`cases` as (X, k, E, F) tuples."""
        return [dims(c, 4, "MoeKernelConfig.cases") for c in self.cases]


def run(config: MoeKernelConfig, log=print) -> list[dict]:
    """One point per (case, tokens) of `config`, each logged as its table line when done."""
    points = []
    for case in config.expert_shapes():
        for t in config.tokens:
            points.append(measure(*case, t, config.rounds, config.ragged_max_gflop))
            log(format_table(points[-1:]).splitlines()[1])
    return points


def _inputs(x: int, k: int, e: int, f: int, tokens: int, seed: int = 0):
    """h [T, E] f32 routed by a random router, bf16 expert weights."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(e, x)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(x, e, 2, f)) / e ** 0.5, jnp.bfloat16)
    down = jnp.asarray(rng.normal(size=(x, f, e)) / f ** 0.5, jnp.bfloat16)
    weights, experts = moe.route(h, router, k, True)
    return h, weights, experts, gate_up, down


def measure(x: int, k: int, e: int, f: int, tokens: int, rounds: int,
            ragged_max_gflop: float) -> dict:
    """One point: each path's median ms over `rounds` interleaved rounds."""
    args = _inputs(x, k, e, f, tokens)
    dense_flop = 2 * tokens * x * 3 * e * f
    names = [d for d in EXPERTS_PATHS if d != "ragged" or k * dense_flop <= ragged_max_gflop * 1e9]
    fns = {d: jax.jit(functools.partial(moe.experts_mlp, path=d)) for d in names}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile, warm up
    times = {d: [] for d in names}
    for _ in range(rounds):
        for d, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[d].append(time.perf_counter() - start)
    useful = 2 * tokens * k * 3 * e * f
    ms = {d: statistics.median(t) * 1e3 for d, t in times.items()}
    return {"x": x, "k": k, "e": e, "f": f, "tokens": tokens, "rounds": rounds,
            "rows_per_expert": tokens * k / x, "ms": ms,
            "gflops": {d: useful / (v / 1e3) / 1e9 for d, v in ms.items()},
            "dense_over_grouped": ms["dense"] / ms["grouped"]}


def format_table(points: list[dict]) -> str:
    """A fixed-width table, one line per point (ms, and useful GFLOP/s in brackets)."""
    head = (f"{'X k E F':>18} {'T':>5} {'rows/X':>7} " +
            " ".join(f"{d + ' ms (GF/s)':>20}" for d in EXPERTS_PATHS) + f" {'dense/grouped':>13}")
    lines = [head]
    for p in points:
        cells = " ".join(f"{p['ms'][d]:>10.2f} ({p['gflops'][d]:>6.1f})" if d in p["ms"]
                         else f"{'-':>20}" for d in EXPERTS_PATHS)
        case = f"{p['x']} {p['k']} {p['e']} {p['f']}"
        lines.append(f"{case:>18} {p['tokens']:>5} {p['rows_per_expert']:>7.2f} {cells} "
                     f"{p['dense_over_grouped']:>13.2f}")
    return "\n".join(lines)
