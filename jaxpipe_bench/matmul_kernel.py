"""The C++ bf16 matmul kernel (weights in panel order) against XLA's dot (natural order), over
row counts M and model weight shapes.

Each point calls the jitted matmul on `copies` distinct weights of one shape (so
that together they overflow the L3 cache, as a model's layers do) and reports the time per
call over all of them, and the kernel's weight bandwidth: bytes of weights read per second.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.config.checks import check_counts
from jaxpipe.kernels import matmul as mm
from jaxpipe_bench.cli import check_sizes, dims

# (K, N): SmolLM2-135M's fused q/k/v/o-sized and MLP weights, and its LM head.
SHAPES: tuple[tuple[int, int], ...] = ((576, 3072), (1536, 576), (576, 49152))
ROWS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
STACK_BYTES = 100 * 2**20  # weights per timed call: well past the 32 MiB L3


@dataclass(frozen=True)
class MatmulKernelConfig:
    """What `scripts/bench_matmul_kernel.py` times (its flags, jaxpipe.config.flags).

    rows: the row counts M
    shapes: the weight shapes, each KxN
    repeats: timed calls of each (the median is kept)
    json_path: write the points here (none: only the table)
    """

    rows: tuple[int, ...] = ROWS
    shapes: tuple[str, ...] = tuple(f"{k}x{n}" for k, n in SHAPES)
    repeats: int = 5
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_sizes(self, "rows")
        check_counts(self, "repeats")
        if not self.shapes:
            raise ValueError("MatmulKernelConfig.shapes must be one or more KxN, got ()")
        self.weight_shapes()

    def weight_shapes(self) -> list[tuple[int, int]]:
        """`shapes` as (K, N) pairs."""
        return [dims(s, 2, "MatmulKernelConfig.shapes") for s in self.shapes]


def run(config: MatmulKernelConfig, log=print) -> list[dict]:
    """One point per (shape, rows) of `config`, each logged as its table line when done."""
    points = []
    for k, n in config.weight_shapes():
        for m in config.rows:
            points.append(measure(k, n, m, config.repeats))
            log(format_table(points[-1:]).splitlines()[1])
    return points


def _stack(fn):
    """jit(x [M, K], ws: a tuple of [K, N]) -> fn(x, w) for each w (every output kept: a sum
    of them would add its own memory traffic to the time). Separate arguments, not one
    stacked array: slicing a stack would copy each weight first."""

    @jax.jit
    def run(x, ws):
        return tuple(fn(x, w) for w in ws)

    return run


def _seconds(call, repeats: int) -> float:
    """Median wall time of `call()` (blocked until ready) over `repeats` runs, after a warmup."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(k: int, n: int, m: int, repeats: int, seed: int = 0) -> dict:
    """One point: XLA and kernel ms per stack of weights [K, N], and the kernel's GB/s."""
    copies = max(1, STACK_BYTES // (2 * k * n))
    rng = np.random.default_rng(seed)
    ws = tuple(jnp.asarray(rng.normal(size=(k, n)), jnp.bfloat16) for _ in range(copies))
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)  # [M, K]
    packed = tuple(mm.pack(w) for w in ws)  # the kernel reads weights in panel order
    xla_fn, kernel_fn = _stack(mm.reference), _stack(mm.bf16_matmul)
    xla = _seconds(lambda: xla_fn(x, ws), repeats)
    kernel = _seconds(lambda: kernel_fn(x, packed), repeats)
    return {"k": k, "n": n, "m": m, "copies": copies, "xla_ms": xla * 1e3,
            "kernel_ms": kernel * 1e3, "kernel_gbps": 2 * k * n * copies / kernel / 1e9,
            "xla_gflops": 2 * m * k * n * copies / xla / 1e9,
            "kernel_gflops": 2 * m * k * n * copies / kernel / 1e9, "speedup": xla / kernel}


def format_table(points: list[dict]) -> str:
    """A fixed-width table, one line per point."""
    lines = [f"{'weight [K, N] x copies':>24} {'M':>5} {'XLA ms':>8} {'kernel ms':>9} "
             f"{'XLA GFLOP/s':>11} {'kernel GFLOP/s':>14} {'kernel GB/s':>11} {'speedup':>7}"]
    for p in points:
        shape = f"[{p['k']}, {p['n']}] x {p['copies']}"
        lines.append(f"{shape:>24} {p['m']:>5} {p['xla_ms']:>8.2f} {p['kernel_ms']:>9.2f} "
                     f"{p['xla_gflops']:>11.0f} {p['kernel_gflops']:>14.0f} "
                     f"{p['kernel_gbps']:>11.1f} {p['speedup']:>7.2f}")
    return "\n".join(lines)
