"""Attention of ragged query spans over a paged KV pool: a C++ CPU kernel called through
`jax.ffi`, and the same contract in plain jnp (`reference`, the XLA path).

A step is a flat batch of T query tokens. Each row (sequence) contributes a span of consecutive
tokens of it: a prefill chunk of any length, or one token for decode. Row r's queries are
tokens q_start[r] .. q_start[r] + q_len[r] - 1 (spans do not overlap and may come in any
order); they sit at positions kv_len[r] - q_len[r] .. kv_len[r] - 1 of the row, and query i of
the span (0-based), at position p = kv_len[r] - q_len[r] + i, attends, causally, over keys
0 .. p. The span's own keys and values are already in the pool: the caller writes them before
the call. Decode is q_len = 1, kv_len = position + 1.

Three options shape the attention (defaults: the plain causal softmax(q.k / sqrt(D)) v):
  - window (a traced i32 scalar, so that it can vary per layer in a `lax.scan`; <= 0: none):
    HF's sliding window, query p attends only over keys p - window < t <= p (the last
    `window`, its own included). Blocks wholly before a span's first query's window start
    are never read, whatever their table entries hold, on every path of the C++ kernel and
    in the Pallas kernel: a scheduler may free the blocks behind a sequence's window, and
    their entries may then name another sequence's block or lie out of range. A long
    context costs the window, not the context. (The XLA path, `reference`, masks instead:
    it reads every entry, clamped into the pool, and needs what they hold to be finite);
  - scale (static; None: 1 / sqrt(D)): the logits are scale * q.k (Gemma:
    query_pre_attn_scalar ** -0.5);
  - softcap (static; <= 0: none): the logits become softcap * tanh(logit / softcap) (Gemma
    2's soft-capping), before the softmax.

The pool is [L, NB, Hkv, BS, D]: L layers (a pipeline stage's whole stack, so that a `lax.scan`
over layers passes it unsliced and names the layer with a traced index), NB blocks of BS tokens.
Position t of row r is k[layer, table[r, t // BS], :, t % BS].

Out-of-range inputs are defined, never read out of bounds:
  - kv_len is clamped to [0, MB * BS] (MB = table.shape[1]), then q_len to [0, kv_len];
  - a span's tokens outside [0, T) are skipped; tokens in no span get zeros;
  - if a block a query needs (those of its keys: from its window start's block to its own)
    has a table entry outside [0, NB), the query attends only to the keys before that block
    (zeros if that is its first): `key_ranges`; entries of blocks no query needs are never
    looked at;
  - layer is clamped to [0, L).

The kernel's task is a tile of up to 16 queries of one span and the G = H / Hkv query heads of
one kv head: each K/V block is read once for all of them, and blocks past the tile's last query
(or before its first query's window) are never read, so a decode row reads its own kv_len
positions (or its window) and a prefill chunk reads each block once per tile (figures in
scripts/bench_attention.py). The kernel has paths (`PATHS`; `paths()` says which this build
has): "portable" loops for every call, and "avx2" (decode rows), "avx512_bf16" (decode rows
and prefill tiles, vdpbf16ps) and "amx" (avx512_bf16's, with prefill tiles on AMX tiles,
tdpbf16ps; CPUs with amx_bf16) for bf16 pools of head dim 64, 128 or 256; each honours the
window, softcap and scale. An int8 pool (`kv_cache_dtype="int8"`: rows of D codes and a bf16
scale, `kernels/kv_int8.py`) runs on "portable", which dequantizes each row as it loads it,
and, with head dim 64, 128 or 256, on "avx2" (decode rows: codes widened to f32 8 at a time,
times the row's scale) and "avx512_bf16" (decode rows by int16 products, avx512_vnni's
vpdpwssd, `int16_decode`: the codes exact as int16, q and each head's probabilities times the
value rows' scales quantized per head to int16, sums exact in int32; an int8 row's values
are not bf16 numbers, so no vdpbf16ps; tiles of several queries by vdpbf16ps products of
the codes as exact bf16 numbers, q and the probabilities times the value rows' scales each
split into two bf16 parts, so within 2^-17 of the portable path's f32), and on "amx" (its
default where built: avx512_bf16's decode rows, and the same tiles' products on AMX tiles);
`write_and_attend` quantizes the rows it writes, as `kv_int8.quantize` does.
A call runs `path_for`'s path unless it names one (`path`), and
fails if that one cannot run it. A custom call cannot be partitioned by the SPMD partitioner:
on a sharded layout call it inside `jax.shard_map`, heads split over the tensor-parallel axis.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.kernels import attention_math
from jaxpipe.kernels.build import register
from jaxpipe.kernels.paged import OUT_OF_RANGE, from_storage, gather, head_dim_of, to_storage

SOURCE = Path(__file__).with_name("ragged_attention.cc")
TARGET = "jaxpipe_ragged_attention"
WRITE_TARGET = "jaxpipe_ragged_attention_write"
PATHS = ("portable", "avx2", "avx512_bf16", "amx")  # ragged_attention.cc's Path, by index
VECTOR_DIMS = (64, 128, 256)  # the head dims the avx and amx paths take (bf16 and int8 pools)


@functools.cache
def _library() -> ctypes.CDLL | None:
    what = "the ragged attention kernel"
    lib = register(SOURCE, "JaxpipeRaggedAttention", TARGET, what)
    if lib is not None and register(SOURCE, "JaxpipeRaggedAttentionWrite", WRITE_TARGET, what):
        return lib
    return None


def available() -> bool:
    """Build (once per machine) and register the kernels; False, with a warning, if they
    cannot be built."""
    return _library() is not None


@functools.cache
def paths() -> tuple[str, ...]:
    """The kernel's paths this machine's build has, in `PATHS` order; () without the kernel.
    "portable" runs every call; "avx2" (decode rows; tiles of several queries on the portable
    code; bf16 and int8 pools), "avx512_bf16" (every tile of a bf16 or an int8 pool) and
    "amx" (tiles of several queries on AMX tiles, where the CPU has amx_bf16 and Linux lets
    the process use them; bf16 and int8 pools) take head dim 64, 128 or 256."""
    lib = _library()
    if lib is None:
        return ()
    lib.jaxpipe_attention_paths.restype = ctypes.c_uint32
    mask = lib.jaxpipe_attention_paths()
    return tuple(name for i, name in enumerate(PATHS) if mask >> i & 1)


@functools.cache
def int16_decode() -> bool:
    """Whether this build's "avx512_bf16" and "amx" paths run an int8 pool's decode rows (one
    query a tile) by int16 products (avx512_vnni's vpdpwssd): q quantized per head to int16,
    and each head's probabilities times the value rows' scales quantized to int16 over its keys
    (the arithmetic `tests/kernel_tests/attention_cases.numpy_attention` models with `v_scales`);
    elsewhere those rows are f32 products of the widened codes."""
    lib = _library()
    if lib is None:
        return False
    lib.jaxpipe_attention_int16_decode.restype = ctypes.c_uint32
    return bool(lib.jaxpipe_attention_int16_decode())


def path_for(kv_dtype, head_dim: int) -> str | None:
    """The path a call on a pool of `kv_dtype` with head dim `head_dim` runs by default: the
    last of `paths()` that takes it; None without the kernel."""
    usable = [p for p in paths() if takes(p, kv_dtype, head_dim)]
    return usable[-1] if usable else None


def takes(path: str, kv_dtype, head_dim: int) -> bool:
    """Whether kernel path `path` runs a pool of `kv_dtype` and head dim `head_dim`."""
    bf16 = jnp.dtype(kv_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
    int8 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.int8)
    return path == "portable" or (head_dim in VECTOR_DIMS and (bf16 or int8))


def ragged_attention(q, k, v, table, q_start, q_len, kv_len, layer=0, *, window=0,
                     softcap: float = 0.0, scale: float | None = None,
                     path: str | None = None) -> jax.Array:
    """Causal attention of each row's span of query tokens over its paged keys and values.

    q [T, H, D] f32: the step's query tokens; k, v [L, NB, Hkv, BS, D] (f32, bf16, or bf16
    stored as u16; or int8 rows [.., D + 2] of codes and a scale, `kv_int8.py`), or
    [NB, Hkv, BS, D] for L = 1; table [R, MB] i32: row r's position t is
    k[layer, table[r, t // BS], :, t % BS]; q_start, q_len, kv_len [R] i32: row r's queries
    are tokens q_start[r] .. q_start[r] + q_len[r] - 1 at positions kv_len[r] - q_len[r] ..
    kv_len[r] - 1, query i attending over keys 0 .. kv_len[r] - q_len[r] + i (q_len 0: idle
    row); layer: python int or traced i32 scalar; window (int or traced i32 scalar, <= 0:
    none), softcap (<= 0: none) and scale (None: 1 / sqrt(D)): see the module docstring;
    path: one of `paths()` that takes the pool (None: `path_for`'s). Returns [T, H, D] f32,
    zeros for tokens in no span. Out-of-range inputs: see the module docstring."""
    if not available():  # builds and registers the kernel on first use
        raise RuntimeError("the ragged attention kernel cannot be built here; use reference()")
    k, v = _as_pool(k), _as_pool(v)
    _check_shapes(q, k, v, table, q_start, q_len, kv_len)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), k, v, i32(table), i32(q_start),
                                         i32(q_len), i32(kv_len), i32(layer), i32(window),
                                         **_attributes(softcap, scale, path, k))


def write_and_attend(q, kv, cos, sin, k, v, table, q_start, q_len, kv_len, layer=0, *,
                     window=0, softcap: float = 0.0, scale: float | None = None,
                     path: str | None = None):
    """The step's own keys and values written into the pool, then `ragged_attention`, in one
    kernel call: q [T, H, D] and kv [T, 2, Hkv, D] (k, v) f32 are the step's projections
    before RoPE; cos, sin [T, D/2] f32 the rotation of each token's position. Each span token
    (as `ragged_attention`'s spans say) gets its q and k rotated (HF's rotate-half) and its
    k and v written at its position of layer `layer` (in the pool's storage dtype; a position
    whose block's table entry is out of range is not written), then the spans attend.
    Returns (out [T, H, D] f32, k, v): the pool updated in place (donate it: the call aliases
    its outputs to the pool). window, softcap, scale, path: as `ragged_attention`.
    `write_and_attend_reference` is the same in plain jnp."""
    if not available():
        raise RuntimeError("the ragged attention kernel cannot be built here; use "
                           "write_and_attend_reference()")
    k5, v5 = _as_pool(k), _as_pool(v)
    _check_shapes(q, k5, v5, table, q_start, q_len, kv_len)
    t, _, d = q.shape
    if kv.shape != (t, 2, k5.shape[2], d) or cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"write_and_attend: need kv [T, 2, Hkv, D] and cos, sin [T, D/2] for q "
                         f"{q.shape} and a pool of {k5.shape[2]} kv heads; got kv {kv.shape}, "
                         f"cos {cos.shape}, sin {sin.shape}")
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
              jax.ShapeDtypeStruct(k5.shape, k5.dtype), jax.ShapeDtypeStruct(v5.shape, v5.dtype))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    out, k5, v5 = jax.ffi.ffi_call(WRITE_TARGET, shapes, input_output_aliases={4: 1, 5: 2})(
        f32(q), f32(kv), f32(cos), f32(sin), k5, v5, i32(table), i32(q_start), i32(q_len),
        i32(kv_len), i32(layer), i32(window), **_attributes(softcap, scale, path, k5))
    return out, k5.reshape(k.shape), v5.reshape(v.shape)


def write_and_attend_reference(q, kv, cos, sin, k, v, table, q_start, q_len, kv_len, layer=0,
                               max_kv: int | None = None, *, window=0, softcap: float = 0.0,
                               scale: float | None = None):
    """`write_and_attend` in plain jnp: `attention_math.apply_rope`, a scatter of each span token's
    k and v at its position (`token_rows`), then `reference`."""
    k5, v5 = _as_pool(k), _as_pool(v)
    num_layers, num_blocks, _, block_size, _ = k5.shape
    full = (jnp.concatenate([cos, cos], -1)[:, None], jnp.concatenate([sin, sin], -1)[:, None])
    q = attention_math.apply_rope(q.astype(jnp.float32), *full)
    new_k, new_v = attention_math.apply_rope(kv[:, 0].astype(jnp.float32), *full), kv[:, 1]
    rows, pos = token_rows(q_start, q_len, kv_len, q.shape[0], table.shape[1] * block_size)
    block = jnp.asarray(table)[jnp.maximum(rows, 0), jnp.maximum(pos, 0) // block_size]
    bad = (rows < 0) | (block < 0) | (block >= num_blocks)
    block = jnp.where(bad, OUT_OF_RANGE, block)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    k5 = k5.at[layer, block, :, pos % block_size].set(to_storage(new_k, k5), mode="drop")
    v5 = v5.at[layer, block, :, pos % block_size].set(to_storage(new_v, v5), mode="drop")
    out = reference(q, k5, v5, table, q_start, q_len, kv_len, layer, max_kv, window=window,
                    softcap=softcap, scale=scale)
    return out, k5.reshape(k.shape), v5.reshape(v.shape)


def reference(q, k, v, table, q_start, q_len, kv_len, layer=0, max_kv: int | None = None, *,
              window=0, softcap: float = 0.0, scale: float | None = None) -> jax.Array:
    """`ragged_attention` in plain jnp (the XLA path; jit-able with traced spans, layer and
    window): each token gathers its row's first `max_kv` positions (static, default MB * BS;
    it must cover the longest kv_len) and attends with `attention_math.decode_attention`'s math (q
    cast to the cache dtype, probabilities to the value dtype, softmax in f32) over its keys
    (`key_ranges`): the window is a mask here, not a read bound. Memory: [T, Hkv, max_kv, D]
    per k and v."""
    k, v = _as_pool(k), _as_pool(v)
    num_layers, num_blocks, _, block_size, _ = k.shape
    if 0 in table.shape:  # no rows, or no positions: every token is idle
        return jnp.zeros(q.shape, jnp.float32)
    max_kv = table.shape[1] * block_size if max_kv is None else max_kv
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    rows, first, keys = token_keys(table, q_start, q_len, kv_len, q.shape[0], num_blocks,
                                   block_size, window)
    blocks = jnp.clip(table, 0, num_blocks - 1)[jnp.maximum(rows, 0)]  # [T, MB]

    def tokens(pool):  # [L, NB, Hkv, BS, D] -> [T, Hkv, max_kv, D]
        x = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)
        return from_storage(gather(x, blocks, max_kv))

    # Keys first .. keys - 1: the window of that length ending at keys - 1.
    span = window if isinstance(window, int) and window <= 0 else jnp.where(
        jnp.asarray(window) > 0, keys - first, 0)
    out = attention_math.decode_attention(q.astype(jnp.float32), tokens(k), tokens(v), keys - 1,
                                   window=span, softcap=softcap, scale=scale)
    return jnp.where((keys > first)[:, None, None], out, 0.0)


def token_rows(q_start, q_len, kv_len, num_tokens: int, max_len: int):
    """Where each of a step's tokens sits: (rows [T] i32, positions [T] i32), -1 for tokens in
    no span. kv_len [R] is clamped to [0, max_len] and q_len [R] to [0, kv_len] first."""
    kv = jnp.clip(jnp.asarray(kv_len, jnp.int32), 0, max_len)  # [R]
    ql = jnp.clip(jnp.asarray(q_len, jnp.int32), 0, kv)
    start = jnp.asarray(q_start, jnp.int32)
    offset = jnp.arange(num_tokens, dtype=jnp.int32)[:, None] - start[None, :]  # [T, R]
    inside = (offset >= 0) & (offset < ql[None, :])
    row = jnp.argmax(inside, axis=1).astype(jnp.int32)  # [T]
    pos = kv[row] - ql[row] + jnp.take_along_axis(offset, row[:, None], axis=1)[:, 0]
    covered = inside.any(axis=1)
    return jnp.where(covered, row, -1), jnp.where(covered, pos, -1)


def token_keys(table, q_start, q_len, kv_len, num_tokens: int, num_blocks: int,
               block_size: int, window=0):
    """(rows, first, keys) [T] i32: each token's row (-1: no span) and the row's positions
    first .. keys - 1 it attends over (`key_ranges`; 0, 0 for tokens in no span)."""
    rows, pos = token_rows(q_start, q_len, kv_len, num_tokens, table.shape[1] * block_size)
    first, keys = key_ranges(table, rows, pos, num_blocks, block_size, window)
    return rows, first, keys


def key_ranges(table, rows, positions, num_blocks: int, block_size: int, window=0):
    """(lo, hi) [N] i32: the keys lo .. hi - 1 that queries of rows [N] (-1: none; lo = hi =
    0) at positions [N] attend over: their window (p - window < t <= p; all t <= p if window
    <= 0), cut before the first of its blocks whose table [R, MB] entry is outside
    [0, num_blocks) (hi = lo if that is the first)."""
    rows = jnp.asarray(rows, jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    window = jnp.asarray(window, jnp.int32)
    lo = jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)
    block = jnp.arange(table.shape[1], dtype=jnp.int32)[None, :]  # [1, MB]
    bad = ((table < 0) | (table >= num_blocks))[jnp.maximum(rows, 0)]  # [N, MB]
    bad &= (block >= (lo // block_size)[:, None]) & (block * block_size <= pos[:, None])
    cut = jnp.where(bad.any(axis=1), jnp.argmax(bad, axis=1) * block_size, pos + 1)
    hi = jnp.minimum(pos + 1, jnp.maximum(cut, lo))
    live = rows >= 0
    return jnp.where(live, lo, 0), jnp.where(live, hi, 0)


def _attributes(softcap: float, scale: float | None, path: str | None, pool) -> dict:
    """The kernel's attributes: scale (0: 1 / sqrt(D), computed in the kernel as before the
    option existed) and softcap (0: none), as float32; path (PATHS index; -1: `path_for`'s,
    chosen in the kernel) for the pool [L, NB, Hkv, BS, D]."""
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"ragged_attention: scale must be a finite number > 0 (or None for "
                         f"1 / sqrt(head_dim)); got {scale!r}")
    if not math.isfinite(softcap):
        raise ValueError(f"ragged_attention: softcap must be finite (<= 0: none); got "
                         f"{softcap!r}")
    if path is not None and not (path in paths() and takes(path, pool.dtype, head_dim_of(pool))):
        raise ValueError(f"ragged_attention: path {path!r} cannot run a {pool.dtype} pool of "
                         f"head dim {head_dim_of(pool)} here; this machine has "
                         f"{', '.join(paths())}, and the avx paths take head dim "
                         f"{' or '.join(map(str, VECTOR_DIMS))} (bf16 and int8 pools)")
    return {"scale": np.float32(scale or 0.0), "softcap": np.float32(max(softcap, 0.0)),
            "path": np.int64(-1 if path is None else PATHS.index(path))}



def _as_pool(x):
    """A rank-4 pool [NB, Hkv, BS, D] -> [1, NB, Hkv, BS, D] (a free reshape); rank 5 as is."""
    return x[None] if x.ndim == 4 else x


def _check_shapes(q, k, v, table, q_start, q_len, kv_len) -> None:
    if q.ndim != 3 or k.ndim != 5 or k.shape != v.shape or head_dim_of(k) != q.shape[-1]:
        raise ValueError(f"ragged_attention: q must be [T, H, D] and k, v [L, NB, Hkv, BS, D] "
                         f"or [NB, Hkv, BS, D] with the same D (int8 pools: rows of D + 2, "
                         f"codes and scale); got q {q.shape}, k {k.shape} {k.dtype}, "
                         f"v {v.shape}")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"ragged_attention: {q.shape[1]} query heads is not a multiple of "
                         f"{k.shape[2]} kv heads")
    r = table.shape[0] if table.ndim == 2 else None
    spans = {"q_start": q_start.shape, "q_len": q_len.shape, "kv_len": kv_len.shape}
    if r is None or any(s != (r,) for s in spans.values()):
        raise ValueError(f"ragged_attention: table must be [R, MB] and q_start, q_len, kv_len "
                         f"[R]; got table {table.shape}, "
                         + ", ".join(f"{n} {s}" for n, s in spans.items()))
    if k.dtype != v.dtype or k.dtype not in (jnp.float32, jnp.bfloat16, jnp.uint16, jnp.int8):
        raise ValueError(f"ragged_attention: k and v must both be float32, bfloat16, uint16 "
                         f"(bf16 bits) or int8 (codes and scales, `kv_int8.py`); got {k.dtype} "
                         f"and {v.dtype}")
