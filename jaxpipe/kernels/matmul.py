"""x @ w with bf16 weights for few rows (decode): a C++ CPU kernel called through `jax.ffi`,
and the same contract in plain jnp (`reference`, the XLA path).

XLA's CPU dot of a few f32-from-bf16 rows against a bf16 weight is slow (inside one jit, 29
[576, 3072] weights take 75 ms at M = 1, 1.4 GB/s); the kernel streams each weight once per
call (6 ms, 17 GB/s there). Each weight load is shared by at most 6 rows, so as M grows the
kernel becomes compute-bound and XLA's blocked dot wins again: `use_kernel(m, n)` says which
to call for a static row count (figures in scripts/bench_matmul_kernel.py). With avx512_bf16 the
kernel treats bf16 denormals (below 1.2e-38) as zero; otherwise it matches `reference` up to
f32 summation order.

Inputs are row-major contiguous (what XLA hands a custom call). A custom call cannot be
partitioned by the SPMD partitioner: on a sharded layout call it inside `jax.shard_map`.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.kernels.build import register

SOURCE = Path(__file__).with_name("matmul.cc")
TARGET = "jaxpipe_bf16_matmul"
# Up to how many rows the kernel is about as fast as XLA's dot or faster (bench_matmul_kernel.py
# on 2 cores shared with other jobs, so +-20%): 10-13x at M = 1 (XLA's one-row dot is
# pathological), 1.1-1.4x at M = 2-8; then it turns compute-bound: 0.95-1.3x of XLA up to M = 64
# on the [576, 3072] and [1536, 576] projections, 0.8-1.05x from M = 8 on the [576, 49152] LM
# head; from M = 128 it loses (0.65-0.95x) on all three.
MAX_ROWS = 64
WIDE_N = 4096  # weights wider than this (the LM head) use the kernel up to MAX_ROWS_WIDE rows
MAX_ROWS_WIDE = 4


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if it cannot."""
    return register(SOURCE, "JaxpipeBf16Matmul", TARGET, "the bf16 matmul kernel")


def use_kernel(m: int, n: int = 0) -> bool:
    """Whether `bf16_matmul` is the faster choice for m rows (static) against a weight with n
    columns (0: unknown, taken as narrow) on this backend."""
    return 0 < m <= (MAX_ROWS_WIDE if n > WIDE_N else MAX_ROWS) and available()


def bf16_matmul(x, w, layer=None) -> jax.Array:
    """y [..., N] f32 = bf16(x) @ w: x [..., K] (any float dtype; rounded to bf16, nearest
    even), w [K, N] bfloat16 (or uint16 holding bf16 bits), or a stack [L, K, N] of which
    `layer` (python int or traced i32 scalar, clamped to [0, L)) is used, read in place: a
    layer sliced from a stacked weight before the call would be copied by XLA on every call.
    Products are exact in f32 and sums are f32, so it equals `reference` up to summation
    order."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the bf16 matmul kernel cannot be built here; use reference()")
    _check_shapes(x, w, layer)
    stack = w if w.ndim == 3 else w[None]
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).astype(jnp.float32)  # [M, K]
    out = jax.ShapeDtypeStruct((rows.shape[0], stack.shape[2]), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    y = jax.ffi.ffi_call(TARGET, out)(rows, stack, index)  # [M, N]
    return y.reshape(*x.shape[:-1], stack.shape[2])


def matmul(x, w) -> jax.Array:
    """`bf16_matmul` where it is faster (few rows, kernel built), else `reference`."""
    rows = math.prod(x.shape[:-1])
    return bf16_matmul(x, w) if use_kernel(rows, w.shape[-1]) else reference(x, w)


def reference(x, w) -> jax.Array:
    """XLA's dot: bf16(x) [..., K] @ w [K, N] bf16, accumulated in f32 -> [..., N] f32."""
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def _check_shapes(x, w, layer) -> None:
    if x.ndim < 1 or w.ndim not in (2, 3) or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"bf16_matmul: x must be [..., K] and w [K, N] or [L, K, N]; got x "
                         f"{x.shape}, w {w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"bf16_matmul: a layer index goes with a stacked w [L, K, N] and only "
                         f"with it; got w {w.shape}, layer {layer!r}")
    if w.dtype not in (jnp.bfloat16, jnp.uint16):
        raise ValueError(f"bf16_matmul: w must be bfloat16 or uint16 (bf16 bits); got {w.dtype}")
