"""x @ w with w in GGUF's quantized blocks, as the file stores them, on the CPU: a C++ kernel
called through `jax.ffi` that decodes the blocks in registers (`gguf_matmul.cc`), beside the
bf16 and int8 kernels and in their style; the arithmetic is `kernels/gguf_blocks.py`'s.

Why the file's own order: a GGUF row is one output column's K weights in blocks of 32 (q4_k,
q6_k: super-blocks of 256), and a block's codes are exactly the operand of one 32-byte multiply
of the activation block's codes; so the kernel reads each row as one sequential stream, no
repacking at load, and the bytes kept in memory are the file's (0.625 bytes a weight for q4_1,
0.5625 for q4_k, 0.8203 for q6_k).

Paths (`PATHS`), each compiled where the CPU runs it: "portable" (plain loops), "avx2"
(vpmaddubsw), "avx_vnni" (vpdpbusd, VEX, 256-bit), "avx512_vnni" (vpdpbusd on 512-bit
vectors). For q8_0, q4_0 and q4_1 from a few rows up, each task decodes its panel of weight
rows once into the int8 kernel's quad order (in a thread's scratch, never stored) and runs
register tiles of rows x columns over it, one int32 lane per output. q4_k and q6_k run one
256-bit tile on every SIMD path (the sub-block scale multiplies vpmaddubsw's s16 pairs:
vpmaddwd, or vpdpwssd on the VNNI paths). `paths()` lists this machine's; which one (or
XLA's reference, `gguf_blocks.reference`) runs a shape and row count is measured
(`runtime/kernel_choice.py`, `Matmul.quant` = the format's name). Rows are quantized per
block inside the kernel exactly as `gguf_blocks.quantize_rows` does, so a call is one op.
Weights are a stack [L, N, R] read in place at a traced layer index, as the other kernels
read theirs. A custom call cannot be partitioned: on a sharded layout call it inside
`jax.shard_map`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpipe.kernels import gguf_blocks
from jaxpipe.kernels.build import register

SOURCE = Path(__file__).with_name("gguf_matmul.cc")
TARGET = "jaxpipe_gguf_matmul"
PATHS = ("portable", "avx2", "avx_vnni", "avx512_vnni")  # gguf_matmul.cc's Path
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q6_k": 4}  # gguf_matmul.cc's Format


@functools.cache
def _library() -> ctypes.CDLL | None:
    return register(SOURCE, "JaxpipeGgufMatmul", TARGET, "the GGUF block matmul kernel")


def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if it cannot."""
    return _library() is not None


@functools.cache
def paths() -> tuple[str, ...]:
    """The kernel's paths this machine's build has, in `PATHS` order; () without the kernel."""
    lib = _library()
    if lib is None:
        return ()
    lib.jaxpipe_gguf_matmul_paths.restype = ctypes.c_uint32
    mask = lib.jaxpipe_gguf_matmul_paths()
    return tuple(name for i, name in enumerate(PATHS) if mask >> i & 1)


def gguf_matmul(x, w, fmt: str, layer=None, *, path: str | None = None) -> jax.Array:
    """y [..., N] f32 = x @ w^T: x [..., K] (any float dtype; as f32), quantized per block
    inside the kernel as llama.cpp does for `fmt`; w GGUF rows [N, R] uint8 of format `fmt`
    (a name of `gguf_blocks.FORMATS`), or a stack [L, N, R] of which `layer` (python int or
    traced i32, clamped to [0, L)) is used, read in place. Equals `gguf_blocks.reference` up
    to the order of the f32 sums over blocks (every block's integer sum exact). `path`: one
    of `paths()`; None: the last of them (the kernel choice passes its own)."""
    form = gguf_blocks.format_of(fmt)
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the GGUF matmul kernel cannot be built here; use "
                           "gguf_blocks.reference()")
    if path is not None and path not in paths():
        raise ValueError(f"gguf_matmul: path {path!r} is not built here; this machine has "
                         f"{', '.join(paths())}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"gguf_matmul: x must be a float array; got {jnp.result_type(x)}")
    _check(x, w, form, layer)
    stack = w if w.ndim == 3 else w[None]
    lead, k = x.shape[:-1], x.shape[-1]
    n = stack.shape[1]
    out = jax.ShapeDtypeStruct((math.prod(lead), n), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    code = -1 if path is None else PATHS.index(path)
    rows = jnp.asarray(x, jnp.float32).reshape(math.prod(lead), k)
    y = jax.ffi.ffi_call(TARGET, out)(rows, stack, index, format=FORMAT_CODES[fmt], path=code)
    return y.reshape(*lead, n)


def _check(x, w, form: gguf_blocks.Format, layer) -> None:
    if x.ndim < 1 or w.ndim not in (2, 3) or w.dtype != jnp.uint8:
        raise ValueError(f"gguf_matmul: x must be [..., K] and w uint8 rows [N, R] or [L, N, "
                         f"R]; got x {x.shape}, w {w.dtype} {w.shape}")
    want = gguf_blocks.row_bytes(form, x.shape[-1])  # (K a multiple of the block)
    if w.shape[-1] != want:
        raise ValueError(f"gguf_matmul: a {form.name} row of K = {x.shape[-1]} is {want} "
                         f"bytes; w has {w.shape[-1]} (w {w.shape})")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"gguf_matmul: a layer index goes with a stacked w [L, N, R] and only "
                         f"with it; got w {w.shape}, layer {layer!r}")
