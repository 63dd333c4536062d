"""x @ w with bf16 weights on the CPU: a C++ kernel called through `jax.ffi` that reads weights
kept in "panel order", and the same contract in plain jnp (`reference`, XLA's dot on weights
in their natural order).

The kernel has several paths (`PATHS`), each compiled in where the CPU runs it: "portable"
(plain loops), "avx2" (bf16 pairs widened to f32 in registers, FMA), "avx512_bf16"
(vdpbf16ps) and "amx" (AMX tiles, tdpbf16ps). `paths()` lists this machine's; which one (or
XLA's dot) runs a given shape and row count is measured, not assumed (`runtime/kernel_choice.py`).

Why a kernel and an order of its own (default workload, SmolLM2-135M bf16, one CPU device;
`scripts/profile_step.py` and `scripts/bench_matmul_kernel.py`): XLA's dot of a layer's
weight sliced from the stacked [L, K, N] parameter first copies the slice (46 of 135 s of the
workload went to those copies), and its dot then runs at ~450 GFLOP/s on the decoder's
shapes. The kernel reads layer l of the stack in place, and `pack` stores each weight so that
the kernel's inner loop is one 64-byte load per 16 columns x 2 rows of K feeding one
vdpbf16ps (avx512_bf16): 750-880 GFLOP/s from 256 rows, memory speed at one row.

`pack`/`unpack` reorder the trailing [K, N] of a weight (K even) and keep its shape, so a
packed weight has the shape and sharding of the original; only its bytes are in another
order. Inside `shard_map` each device packs its own shard, which is what its kernel calls
read. The runner packs when it places weights in a layout and unpacks before re-sharding.

`grouped_matmul` is the same kernel for an MoE layer's experts (`model/moe.py`): rows in
groups of data-dependent sizes, each group times its own expert's weight, read in natural
order and put in panel order a panel at a time inside the kernel. The step hands both
kernels the whole stack of layers and the layer's index (`StackedWeight`), never a slice: XLA
would copy a sliced layer before every custom call (for an MoE layer, all of its experts'
weights on every step).

On the avx512_bf16 path the kernel treats bf16 denormals (below 1.2e-38) as zero; otherwise
it matches `reference` up to f32 summation order. A custom call cannot be partitioned by the
SPMD partitioner: on a sharded layout call it inside `jax.shard_map`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.kernels.build import register

SOURCE = Path(__file__).with_name("matmul.cc")
TARGET = "jaxpipe_bf16_matmul"
GROUPED_TARGET = "jaxpipe_grouped_matmul"
PANEL = 64  # columns per panel (matmul.cc: kPanel)
PATHS = ("portable", "avx2", "avx512_bf16", "amx")  # matmul.cc's Path, by index


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = register(SOURCE, "JaxpipeBf16Matmul", TARGET, "the bf16 matmul kernel")
    if lib is not None:
        jax.ffi.register_ffi_target(GROUPED_TARGET, jax.ffi.pycapsule(lib.JaxpipeGroupedMatmul),
                                    platform="cpu")
    return lib


def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if it cannot."""
    return _library() is not None


@functools.cache
def paths() -> tuple[str, ...]:
    """The kernel's paths this machine's build has (compiled for this CPU, so it runs them),
    in `PATHS` order; () without the kernel."""
    lib = _library()
    if lib is None:
        return ()
    lib.jaxpipe_matmul_paths.restype = ctypes.c_uint32
    mask = lib.jaxpipe_matmul_paths()
    return tuple(name for i, name in enumerate(PATHS) if mask >> i & 1)


class StackedWeight:
    """Layer `layer` (traced i32) of a stacked weight [L, ...], for the kernels to read in
    place: slicing it out before a custom call makes XLA copy the layer's weight on every
    call. In panel order for `bf16_matmul` (the step's packed weights), in natural order for
    `grouped_matmul` (an MoE layer's experts). Has what the model uses of a weight: shape,
    dtype, reshape (recorded, applied on use); `value()` is the slice itself, for XLA's ops;
    `path(rows)` names the kernel path a call of `rows` rows runs (`runtime/kernel_choice.py`;
    None: the kernel's default)."""

    def __init__(self, stack: jax.Array, layer: jax.Array,
                 path: Callable[[int], str | None] = lambda rows: None,
                 shape: tuple[int, ...] | None = None):
        self.stack, self.layer, self.path = stack, layer, path
        self.shape = shape or stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def reshape(self, *shape: int) -> StackedWeight:
        if -1 in shape:  # as numpy: the one -1 takes what the others leave
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(math.prod(self.shape) // known if d == -1 else d for d in shape)
        return StackedWeight(self.stack, self.layer, self.path, shape)

    def stacked(self) -> jax.Array:
        """The stack as [L, *shape] (a bitcast) for the kernel."""
        return self.stack.reshape(self.stack.shape[0], *self.shape)

    def value(self) -> jax.Array:
        """The layer's weight [*shape] (a copy, where XLA's ops read it)."""
        # (a tree map: the stack may be a pytree of arrays, `model/quantized.py`'s weights)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
            a, self.layer, keepdims=False), self.stack).reshape(self.shape)


def bf16_matmul(x, w, layer=None, *, gated: bool = False, path: str | None = None) -> jax.Array:
    """y [..., N] f32 = bf16(x) @ w: x [..., K] (any float dtype; rounded to bf16, nearest
    even), w [K, N] bfloat16 (or uint16 holding bf16 bits) in panel order (`pack`), or a
    stack [L, K, N] of them of which `layer` (python int or traced i32 scalar, clamped to
    [0, L)) is used, read in place. K must be even. Products are exact in f32 and sums are
    f32, so it equals `reference` on the unpacked weight up to summation order.

    `gated`: y [..., N/2] = silu(y's first N/2 columns) * its last N/2 (a gated MLP's gate
    and up projections, `gated_reference`), computed panel by panel without writing the
    [..., N] product; N must be a multiple of 2 * PANEL.

    `path`: one of `paths()`; None: the last of them (the kernel choice passes its measured
    choice)."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the bf16 matmul kernel cannot be built here; use reference()")
    if path is not None and path not in paths():
        raise ValueError(f"bf16_matmul: path {path!r} is not built here; this machine has "
                         f"{', '.join(paths())}")
    _check_shapes(x, w, layer)
    stack = w if w.ndim == 3 else w[None]
    n = stack.shape[2] // 2 if gated else stack.shape[2]
    if gated and stack.shape[2] % (2 * PANEL):
        raise ValueError(f"bf16_matmul: gated needs N a multiple of {2 * PANEL}; got w "
                         f"{w.shape}")
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).astype(jnp.float32)  # [M, K]
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    code = -1 if path is None else PATHS.index(path)
    y = jax.ffi.ffi_call(TARGET, out)(rows, stack, index, gated=gated,
                                      path=code)  # [M, N or N/2]
    return y.reshape(*x.shape[:-1], n)


def grouped_matmul(x, w, sizes, layer=None, *, gated: bool = False,
                   path: str | None = None) -> jax.Array:
    """y [M, N] f32: x's rows [M, K] in consecutive groups, sizes [G] i32 rows each (in order;
    their sum at most M, rows past it give zeros), group g's rows times bf16(w[g]): w [G, K, N]
    bfloat16 (or uint16 bf16 bits) in natural order (not packed), or a stack [L, G, K, N] of
    which `layer` is used, read in place. A group of 0 rows reads nothing of its weight. K
    must be even. The kernel copies each (group, 64-column panel) into panel order as it
    goes and runs `bf16_matmul`'s path code on it: the same products and f32 sums.

    `gated`: y [M, N/2] = silu(first N/2 columns) * last N/2 (N even). `path`: as
    `bf16_matmul`'s. Sizes outside [0, M] in total fail the call."""
    if not available():
        raise RuntimeError("the bf16 matmul kernel cannot be built here; use jax.lax.ragged_dot")
    if path is not None and path not in paths():
        raise ValueError(f"grouped_matmul: path {path!r} is not built here; this machine has "
                         f"{', '.join(paths())}")
    if (w.ndim == 4) != (layer is not None):
        raise ValueError(f"grouped_matmul: a layer index goes with a stacked w [L, G, K, N] "
                         f"and only with it; got w {w.shape}, layer {layer!r}")
    stack = w if w.ndim == 4 else w[None]
    _check_grouped(x, stack, sizes, gated)
    n = stack.shape[3] // 2 if gated else stack.shape[3]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    code = -1 if path is None else PATHS.index(path)
    return jax.ffi.ffi_call(GROUPED_TARGET, out)(
        x.astype(jnp.float32), stack, index, jnp.asarray(sizes, jnp.int32), gated=gated,
        path=code)  # [M, N or N/2]


def reference(x, w) -> jax.Array:
    """XLA's dot: bf16(x) [..., K] @ w [K, N] bf16 (natural order), f32 sums -> [..., N]."""
    if w.dtype == jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def silu_gate(y) -> jax.Array:
    """The fused gate of a [..., 2F] gate_up product: silu(first half) * second half."""
    half = y.shape[-1] // 2
    return jax.nn.silu(y[..., :half]) * y[..., half:]


def gated_reference(x, w) -> jax.Array:
    """XLA's `reference` then the gate (`silu_gate`) -> [..., N/2]."""
    return silu_gate(reference(x, w))


def pack(w) -> jax.Array:
    """w [..., K, N] (K even) in panel order, same shape: columns in panels of PANEL (the
    last one narrower when PANEL does not divide N), each panel its K/2 rows of (k = 2j,
    k = 2j + 1) pairs for each of its columns."""
    *lead, k, n = w.shape
    if k % 2:
        raise ValueError(f"pack: K must be even, got w of shape {w.shape}")
    if w.size == 0:
        return w
    full = n // PANEL * PANEL
    parts = []
    if full:  # [..., K/2, 2, P, PANEL] -> [..., P, K/2, PANEL, 2]
        a = w[..., :full].reshape(*lead, k // 2, 2, full // PANEL, PANEL)
        parts.append(_swap_last4(a, (2, 0, 3, 1)).reshape(*lead, -1))
    if n > full:  # [..., K/2, 2, rest] -> [..., K/2, rest, 2]
        b = w[..., full:].reshape(*lead, k // 2, 2, n - full)
        parts.append(jnp.swapaxes(b, -1, -2).reshape(*lead, -1))
    return jnp.concatenate(parts, axis=-1).reshape(w.shape)


def unpack(w) -> jax.Array:
    """The inverse of `pack`: w [..., K, N] from panel order back to natural order."""
    *lead, k, n = w.shape
    if w.size == 0:
        return w
    full = n // PANEL * PANEL
    flat = w.reshape(*lead, k * n)
    parts = []
    if full:  # [..., P, K/2, PANEL, 2] -> [..., K/2, 2, P, PANEL]
        a = flat[..., :k * full].reshape(*lead, full // PANEL, k // 2, PANEL, 2)
        parts.append(_swap_last4(a, (1, 3, 0, 2)).reshape(*lead, k, full))
    if n > full:
        b = flat[..., k * full:].reshape(*lead, k // 2, n - full, 2)
        parts.append(jnp.swapaxes(b, -1, -2).reshape(*lead, k, n - full))
    return jnp.concatenate(parts, axis=-1)


def _swap_last4(a, order: tuple[int, ...]):
    """Permute the last four axes of `a` by `order` (indices among those four)."""
    lead = a.ndim - 4
    return a.transpose(*range(lead), *(lead + i for i in order))


def _check_shapes(x, w, layer) -> None:
    if x.ndim < 1 or w.ndim not in (2, 3) or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"bf16_matmul: x must be [..., K] and w [K, N] or [L, K, N]; got x "
                         f"{x.shape}, w {w.shape}")
    if w.shape[-2] % 2:
        raise ValueError(f"bf16_matmul: K must be even (panel order pairs rows of K); got w "
                         f"{w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"bf16_matmul: a layer index goes with a stacked w [L, K, N] and only "
                         f"with it; got w {w.shape}, layer {layer!r}")
    if w.dtype not in (jnp.bfloat16, jnp.uint16):
        raise ValueError(f"bf16_matmul: w must be bfloat16 or uint16 (bf16 bits); got {w.dtype}")


def _check_grouped(x, stack, sizes, gated: bool) -> None:
    if x.ndim != 2 or stack.ndim != 4 or x.shape[1] != stack.shape[2]:
        raise ValueError(f"grouped_matmul: x must be [M, K] and w [G, K, N] or [L, G, K, N]; "
                         f"got x {x.shape}, w {stack.shape}")
    if stack.shape[2] % 2 or (gated and stack.shape[3] % 2):
        raise ValueError(f"grouped_matmul: K must be even (and N, gated); got w {stack.shape}")
    if jnp.shape(sizes) != (stack.shape[1],):
        raise ValueError(f"grouped_matmul: sizes must be [G] = [{stack.shape[1]}]; got "
                         f"{jnp.shape(sizes)}")
    if stack.dtype not in (jnp.bfloat16, jnp.uint16):
        raise ValueError(f"grouped_matmul: w must be bfloat16 or uint16 (bf16 bits); got "
                         f"{stack.dtype}")
