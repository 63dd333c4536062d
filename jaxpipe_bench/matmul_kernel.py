"""The C++ bf16 matmul kernel (weights in panel order) against XLA's dot (natural order), and
beside them dynamic W8A8 int8 (`quantization="int8"`): XLA's int8 dot and the int8 kernel's
paths (`kernels/int8_matmul.py`), and GGUF's quantized blocks (`quantization="gguf"`): XLA's
reference and the GGUF kernel's paths (`kernels/gguf_matmul.py`) per format, over row counts M
and model weight shapes, in one run.

Each point calls the jitted matmul on `copies` distinct weights of one shape (so that
together they overflow the L3 cache, as a model's layers do: about 100 MB of bf16 weights,
as many int8 bytes) and reports the time per call over all of them, the bf16 kernel's weight
bandwidth, and GFLOP/s (bf16) or GOP/s (int8: multiply-adds x 2, rows quantized per token
inside the call; GGUF: rows quantized per block inside the call, weights as many bytes of
blocks) of every implementation.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.config.checks import check_counts
from jaxpipe.kernels import gguf_blocks, int8
from jaxpipe.kernels import gguf_matmul as gm
from jaxpipe.kernels import int8_matmul as im
from jaxpipe.kernels import matmul as mm
from jaxpipe_bench.cli import check_names, check_sizes, dims

# (K, N): SmolLM2-135M's fused q/k/v/o-sized and MLP weights, and its LM head.
SHAPES: tuple[tuple[int, int], ...] = ((576, 3072), (1536, 576), (576, 49152))
ROWS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
STACK_BYTES = 100 * 2**20  # weights per timed call: well past the 32 MiB L3
# The int8 paths timed by default: the plain loops ("portable") only on request (slow).
INT8_PATHS = ("avx2", "avx_vnni", "avx512_vnni", "amx_int8")
GGUF_FORMATS = ("q4_1", "q8_0")  # the shipped SmolLM2 file's (q8_0: its tied embedding)
GGUF_PATHS = ("avx2", "avx_vnni", "avx512_vnni")


@dataclass(frozen=True)
class MatmulKernelConfig:
    """What `scripts/bench_matmul_kernel.py` times (its flags, jaxpipe.config.flags).

    rows: the row counts M
    shapes: the weight shapes, each KxN
    repeats: timed calls of each (the median is kept)
    int8_paths: the int8 kernel's paths to time beside XLA's int8 dot (those this machine's
        build lacks are skipped)
    gguf_formats: the GGUF block formats to time
    gguf_paths: the GGUF kernel's paths to time beside XLA's reference (as int8_paths)
    json_path: write the points here (none: only the table)
    """

    rows: tuple[int, ...] = ROWS
    shapes: tuple[str, ...] = tuple(f"{k}x{n}" for k, n in SHAPES)
    repeats: int = 5
    int8_paths: tuple[str, ...] = INT8_PATHS
    gguf_formats: tuple[str, ...] = GGUF_FORMATS
    gguf_paths: tuple[str, ...] = GGUF_PATHS
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_sizes(self, "rows")
        check_counts(self, "repeats")
        check_names(self, "int8_paths", im.PATHS)
        check_names(self, "gguf_formats", gguf_blocks.FORMATS)
        check_names(self, "gguf_paths", gm.PATHS)
        if not self.shapes:
            raise ValueError("MatmulKernelConfig.shapes must be one or more KxN, got ()")
        self.weight_shapes()

    def weight_shapes(self) -> list[tuple[int, int]]:
        """`shapes` as (K, N) pairs."""
        return [dims(s, 2, "MatmulKernelConfig.shapes") for s in self.shapes]


def run(config: MatmulKernelConfig, log=print) -> list[dict]:
    """One point per (shape, rows) of `config`, each logged as its table line when done."""
    paths = tuple(p for p in config.int8_paths if p in im.paths())
    gguf_paths = tuple(p for p in config.gguf_paths if p in gm.paths())
    for kind, want, have in (("int8", config.int8_paths, paths),
                             ("GGUF", config.gguf_paths, gguf_paths)):
        if set(want) - set(have):
            log(f"{kind} paths not built here, skipped: {', '.join(sorted(set(want) - set(have)))}")
    points = []
    for k, n in config.weight_shapes():
        for m in config.rows:
            point = measure(k, n, m, config.repeats, int8_paths=paths)
            point["gguf_gops"] = {f: measure_gguf(k, n, m, config.repeats, f, gguf_paths)
                                  for f in config.gguf_formats}
            points.append(point)
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


def measure(k: int, n: int, m: int, repeats: int, seed: int = 0,
            int8_paths: tuple[str, ...] = ()) -> dict:
    """One point: XLA and kernel ms per stack of weights [K, N], the kernel's GB/s, and
    `int8_ops` (GOP/s of XLA's int8 dot, "xla", and of each of `int8_paths`)."""
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
            "kernel_gflops": 2 * m * k * n * copies / kernel / 1e9, "speedup": xla / kernel,
            **measure_int8(k, n, m, repeats, seed, int8_paths)}


def measure_int8(k: int, n: int, m: int, repeats: int, seed: int,
                 paths: tuple[str, ...]) -> dict:
    """int8 GOP/s per implementation on `int8_copies` weights (STACK_BYTES of int8 codes):
    XLA's int8 dot on natural-order codes, each kernel path on packed ones."""
    copies = max(1, STACK_BYTES // (k * n))
    rng = np.random.default_rng(seed + 1)
    quantized = [int8.quantize_weight(jnp.asarray(rng.normal(size=(k, n)), jnp.float32))
                 for _ in range(copies)]
    codes, scales = tuple(q for q, _ in quantized), tuple(s for _, s in quantized)
    packed = tuple(im.pack(q) for q in codes)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)  # [M, K]
    ops = 2 * m * k * n * copies / 1e9
    xla_fn = _stack_int8(int8.reference)
    out = {"xla": ops / _seconds(lambda: xla_fn(x, codes, scales), repeats)}
    for path in paths:
        fn = _stack_int8(partial(im.int8_matmul, path=path))
        out[path] = ops / _seconds(partial(fn, x, packed, scales), repeats)
    return {"int8_copies": copies, "int8_gops": out}


def measure_gguf(k: int, n: int, m: int, repeats: int, fmt: str,
                 paths: tuple[str, ...]) -> dict[str, float]:
    """GOP/s per implementation for GGUF format `fmt` on STACK_BYTES of blocks: XLA's
    reference (`gguf_blocks.reference`) and each kernel path, on the same random blocks (the
    file's order; rows quantized per block inside every call)."""
    form = gguf_blocks.format_of(fmt)
    copies = max(1, STACK_BYTES // (n * gguf_blocks.row_bytes(form, k)))
    rows = jnp.asarray(gguf_blocks.random_blocks(form, (copies, n, k)))
    ws = tuple(rows[i] for i in range(copies))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(m, k)), jnp.float32)  # [M, K]
    ops = 2 * m * k * n * copies / 1e9
    xla_fn = _stack(partial(gguf_blocks.reference, fmt=form))
    out = {"xla": ops / _seconds(lambda: xla_fn(x, ws), repeats)}
    for path in paths:
        fn = _stack(partial(gm.gguf_matmul, fmt=fmt, path=path))
        out[path] = ops / _seconds(partial(fn, x, ws), repeats)
    return out


def _stack_int8(fn):
    """jit(x, codes, scales) -> fn(x, w, s) for each weight (as `_stack`)."""

    @jax.jit
    def run(x, ws, ss):
        return tuple(fn(x, w, s) for w, s in zip(ws, ss, strict=True))

    return run


def format_table(points: list[dict]) -> str:
    """A fixed-width table, one line per point: bf16 (XLA, kernel), then int8 GOP/s (XLA's
    int8 dot, each kernel path) and the best int8 over the best bf16, then each GGUF format's
    GOP/s (XLA's reference, each kernel path)."""
    impls = list(dict.fromkeys(i for p in points for i in p.get("int8_gops", {})))
    gguf = list(dict.fromkeys((f, i) for p in points for f, by in p.get("gguf_gops", {}).items()
                              for i in by))
    int8_head = "".join(f" {'i8 ' + i:>15}" for i in impls)
    gguf_head = "".join(f" {f + ' ' + i:>16}" for f, i in gguf)
    lines = [f"{'weight [K, N] x copies':>24} {'M':>5} {'XLA ms':>8} {'kernel ms':>9} "
             f"{'XLA GFLOP/s':>11} {'kernel GFLOP/s':>14} {'kernel GB/s':>11} {'speedup':>7}"
             + int8_head + (f" {'i8/bf16':>7}" if impls else "") + gguf_head]
    for p in points:
        shape = f"[{p['k']}, {p['n']}] x {p['copies']}"
        line = (f"{shape:>24} {p['m']:>5} {p['xla_ms']:>8.2f} {p['kernel_ms']:>9.2f} "
                f"{p['xla_gflops']:>11.0f} {p['kernel_gflops']:>14.0f} "
                f"{p['kernel_gbps']:>11.1f} {p['speedup']:>7.2f}")
        gops = p.get("int8_gops", {})
        if impls:
            line += "".join(f" {gops.get(i, float('nan')):>15.0f}" for i in impls)
            best_bf16 = max(p["xla_gflops"], p["kernel_gflops"])
            line += f" {max(gops.values(), default=float('nan')) / best_bf16:>7.2f}"
        by_format = p.get("gguf_gops", {})
        line += "".join(f" {by_format.get(f, {}).get(i, float('nan')):>16.0f}" for f, i in gguf)
        lines.append(line)
    return "\n".join(lines)
