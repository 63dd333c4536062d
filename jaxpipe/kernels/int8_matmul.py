"""x @ w with int8 weights and activations on the CPU (dynamic W8A8, the arithmetic in
`kernels/int8.py`): a C++ kernel called through `jax.ffi` that reads int8 weights kept in an
"int8 panel order" of their own, beside the bf16 kernel (`kernels/matmul.py`) and in its style.

The kernel has several paths (`PATHS`), each compiled in where the CPU runs it: "portable"
(plain loops), "avx2" (vpmaddubsw / vpmaddwd, no VNNI), "avx_vnni" (vpdpbusd, VEX, 256-bit),
"avx512_vnni" (vpdpbusd, 512-bit) and "amx_int8" (AMX tiles, tdpbssd; built only where the
CPU has amx_int8). `paths()` lists this machine's; which one (or XLA's int8 dot,
`int8.reference`) runs a given shape and row count is measured (`runtime/kernel_choice.py`).

Why its own order: vpdpbusd multiplies 4 consecutive k's of a column by 4 k's of a row, so
`pack` stores each weight in panels of 64 columns, each panel its K/4 "quad rows" of (k = 4j
.. 4j + 3) for each column: one 64-byte load is the operand of one vpdpbusd (16 columns x 4
k's, 64 multiply-adds) and a panel is one sequential stream (36 KB for K = 576), as the bf16
kernel's pairs are for vdpbf16ps. K % 4 tail rows follow a panel's quads, so any K packs
in place: `pack`/`unpack` keep the shape (and so a weight's sharding), reordering only bytes.

Rows are quantized per token inside the kernel, as `int8.quantize_rows` does (to the bit:
tested), so a call is one op, not an XLA pass over x and then the kernel (`quantized_matmul`
takes codes and scales already made); weights are int8 codes [L, K, N] and scales [L,
N], a stack of layers read in place at a traced index as the bf16 kernel reads them. Every
path computes the same exact int32 sums as XLA's int8 dot, then (f32(acc) * s_w) * s_x. A
custom call cannot be partitioned: on a sharded layout call it inside `jax.shard_map`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.kernels import int8, matmul
from jaxpipe.kernels.build import register

SOURCE = Path(__file__).with_name("int8_matmul.cc")
TARGET = "jaxpipe_int8_matmul"
PANEL = 64  # columns per panel (int8_matmul.cc: kPanel)
QUAD = 4  # k's per column group: vpdpbusd's 4 bytes a lane
PATHS = ("portable", "avx2", "avx_vnni", "avx512_vnni", "amx_int8")  # int8_matmul.cc's Path


@functools.cache
def _library() -> ctypes.CDLL | None:
    return register(SOURCE, "JaxpipeInt8Matmul", TARGET, "the int8 matmul kernel")


def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if it cannot."""
    return _library() is not None


@functools.cache
def paths() -> tuple[str, ...]:
    """The kernel's paths this machine's build has (compiled for this CPU, and for AMX
    granted by the OS), in `PATHS` order; () without the kernel."""
    lib = _library()
    if lib is None:
        return ()
    lib.jaxpipe_int8_matmul_paths.restype = ctypes.c_uint32
    mask = lib.jaxpipe_int8_matmul_paths()
    return tuple(name for i, name in enumerate(PATHS) if mask >> i & 1)


def int8_matmul(x, w, w_scale, layer=None, *, gated: bool = False,
                path: str | None = None) -> jax.Array:
    """y [..., N] f32 = x @ w under dynamic W8A8: x [..., K] (any float dtype; as f32)
    quantized per row inside the kernel exactly as `int8.quantize_rows` does, w [K, N] int8
    codes in int8 panel order (`pack`) with w_scale [N] f32 (`int8.quantize_weight`), or
    stacks w [L, K, N], w_scale [L, N] of which `layer` (python int or traced i32, clamped to
    [0, L)) is used, read in place. Equals `int8.reference` on the unpacked weight (exact
    int32 sums, same scaling); a row with inf or NaN gives NaN.

    `gated`: y [..., N/2] = silu(y's first N/2 columns) * its last N/2 (a gated MLP's gate and
    up projections, `gated_reference`), panel by panel without writing the [..., N] product;
    N must be a multiple of 2 * PANEL. `path`: one of `paths()`; None: the last of them (the
    kernel choice passes its own)."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"int8_matmul: x must be a float array; got {jnp.result_type(x)} "
                         f"(quantized_matmul takes int8 codes)")
    rows = jnp.asarray(x, jnp.float32)
    return _call(rows, jnp.zeros((0,), jnp.float32), w, w_scale, layer, gated, path)


def quantized_matmul(x_codes, x_scale, w, w_scale, layer=None, *, gated: bool = False,
                     path: str | None = None) -> jax.Array:
    """`int8_matmul` on rows already quantized: x_codes [..., K] int8 in [-127, 127],
    x_scale [...] f32 -> y [..., N] f32 = (f32(x_codes @ w) * w_scale) * x_scale."""
    if x_codes.dtype != jnp.int8:
        raise ValueError(f"int8_matmul: x codes must be int8 (int8.quantize_rows); got "
                         f"{x_codes.dtype}")
    if jnp.shape(x_scale) != x_codes.shape[:-1]:
        raise ValueError(f"int8_matmul: x_scale must be x's leading shape "
                         f"{x_codes.shape[:-1]}; got {jnp.shape(x_scale)}")
    scales = jnp.asarray(x_scale, jnp.float32).reshape(-1)
    return _call(x_codes, scales, w, w_scale, layer, gated, path)


def _call(x, x_scale, w, w_scale, layer, gated: bool, path: str | None) -> jax.Array:
    """The custom call: x [..., K] (int8 codes with x_scale [M], or f32 with x_scale [0])."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the int8 matmul kernel cannot be built here; use int8.reference()")
    if path is not None and path not in paths():
        raise ValueError(f"int8_matmul: path {path!r} is not built here; this machine has "
                         f"{', '.join(paths())}")
    _check(x, w, w_scale, layer)
    if gated and w.shape[-1] % (2 * PANEL):
        raise ValueError(f"int8_matmul: gated needs N a multiple of {2 * PANEL}; got w "
                         f"{w.shape}")
    stack, scales = (w, w_scale) if w.ndim == 3 else (w[None], w_scale[None])
    lead, k = x.shape[:-1], x.shape[-1]
    n = stack.shape[2] // 2 if gated else stack.shape[2]
    out = jax.ShapeDtypeStruct((math.prod(lead), n), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    code = -1 if path is None else PATHS.index(path)
    y = jax.ffi.ffi_call(TARGET, out)(x.reshape(math.prod(lead), k), x_scale, stack,
                                      scales.astype(jnp.float32), index, gated=gated,
                                      path=code)  # [M, N or N/2]
    return y.reshape(*lead, n)


def gated_reference(x, w_codes, w_scale) -> jax.Array:
    """XLA's `int8.reference` then the gate (`matmul.silu_gate`)."""
    return matmul.silu_gate(int8.reference(x, w_codes, w_scale))


def pack(w) -> jax.Array:
    """w [..., K, N] (any dtype; int8 codes) in int8 panel order, same shape: columns in
    panels of PANEL (the last one narrower when PANEL does not divide N), each panel its K // 4
    quad rows of (k = 4j .. 4j + 3) for each of its columns, then its K % 4 tail rows as
    (column, tail k) pairs."""
    *lead, k, n = w.shape
    if w.size == 0:
        return w
    full = n // PANEL * PANEL
    parts = [_pack_cols(w[..., :full], PANEL)] if full else []
    if n > full:
        parts.append(_pack_cols(w[..., full:], n - full))
    return jnp.concatenate(parts, axis=-1).reshape(w.shape)


def _pack_cols(w, width: int):
    """w [..., K, P * width] -> [..., P * K * width]: P panels, each its quads then tail."""
    *lead, k, n = w.shape
    panels, kf = n // width, k // QUAD * QUAD
    quads = w[..., :kf, :].reshape(*lead, kf // QUAD, QUAD, panels, width)
    out = [_permute_last4(quads, (2, 0, 3, 1)).reshape(*lead, panels, kf * width)]
    if k > kf:  # [..., rem, P, width] -> [..., P, width, rem]
        tail = w[..., kf:, :].reshape(*lead, k - kf, panels, width)
        out.append(jnp.moveaxis(tail, -3, -1).reshape(*lead, panels, (k - kf) * width))
    return jnp.concatenate(out, axis=-1).reshape(*lead, panels * k * width)


def unpack(w) -> jax.Array:
    """The inverse of `pack`: w [..., K, N] from int8 panel order back to natural order."""
    *lead, k, n = w.shape
    if w.size == 0:
        return w
    full = n // PANEL * PANEL
    flat = w.reshape(*lead, k * n)
    parts = [_unpack_cols(flat[..., :k * full], k, PANEL)] if full else []
    if n > full:
        parts.append(_unpack_cols(flat[..., k * full:], k, n - full))
    return jnp.concatenate(parts, axis=-1)


def _unpack_cols(flat, k: int, width: int):
    """[..., P * K * width] (`_pack_cols`'s order) -> [..., K, P * width]."""
    *lead, size = flat.shape
    panels, kf = size // (k * width), k // QUAD * QUAD
    blocks = flat.reshape(*lead, panels, k * width)
    quads = blocks[..., :kf * width].reshape(*lead, panels, kf // QUAD, width, QUAD)
    out = [_permute_last4(quads, (1, 3, 0, 2)).reshape(*lead, kf, panels * width)]
    if k > kf:  # [..., P, width, rem] -> [..., rem, P, width]
        tail = blocks[..., kf * width:].reshape(*lead, panels, width, k - kf)
        out.append(jnp.moveaxis(tail, -1, -3).reshape(*lead, k - kf, panels * width))
    return jnp.concatenate(out, axis=-2)


def packed_columns(w, cols) -> jax.Array:
    """Columns `cols` [...] of w [K, N] kept in int8 panel order (`pack`), read in place:
    [..., K], equal to `unpack(w)[:, cols]` moved last, without unpacking the rest."""
    k, n = w.shape
    return jnp.take(w.reshape(-1), packed_index(k, n, cols))


def packed_index(k: int, n: int, cols):
    """Where column c's k-th value sits in a [K, N] weight in panel order (flat): its
    panel's start, then a quad row's 4 bytes for each column (k < K // 4 * 4) or, in the
    tail, K % 4 bytes a column. cols [...] -> [..., K] i32."""
    full, kf = n // PANEL * PANEL, k // QUAD * QUAD
    cols = jnp.asarray(cols, jnp.int32)[..., None]
    tail_panel = cols >= full
    width = jnp.where(tail_panel, n - full, PANEL)
    c = jnp.where(tail_panel, cols - full, cols % PANEL)
    start = jnp.where(tail_panel, full, cols // PANEL * PANEL) * k
    j = jnp.arange(k, dtype=jnp.int32)
    quads = j // QUAD * width * QUAD + c * QUAD + j % QUAD
    tail = kf * width + c * (k - kf) + (j - kf)
    return start + jnp.where(j < kf, quads, tail)


def _permute_last4(a, order: tuple[int, ...]):
    """Permute the last four axes of `a` by `order` (indices among those four)."""
    lead = a.ndim - 4
    return a.transpose(*range(lead), *(lead + i for i in order))


def _check(x, w, w_scale, layer) -> None:
    if x.ndim < 1 or w.ndim not in (2, 3) or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"int8_matmul: x must be [..., K] and w [K, N] or [L, K, N]; got x "
                         f"{x.shape}, w {w.shape}")
    if w.dtype != jnp.int8:
        raise ValueError(f"int8_matmul: w must be int8 codes (int8.quantize_weight); got "
                         f"{w.dtype}")
    if jnp.shape(w_scale) != w.shape[:-2] + w.shape[-1:]:
        raise ValueError(f"int8_matmul: w_scale must be [N] (or [L, N] with a stack); got "
                         f"{jnp.shape(w_scale)} for w {w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"int8_matmul: a layer index goes with a stacked w [L, K, N] and only "
                         f"with it; got w {w.shape}, layer {layer!r}")
