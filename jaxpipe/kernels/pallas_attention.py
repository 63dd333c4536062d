"""Paged ragged-span attention in Pallas, for accelerators: the contract of
`ragged_attention.ragged_attention` (its module docstring: spans, causal positions, the
paged pool, out-of-range rules), lowered by Pallas' Triton backend on GPU and tested on CPU
in Pallas' interpret mode against the float64 NumPy reference the C++ kernel is tested with.

Work is cut into *tiles* of up to TQ queries of one row's span (a decode row is one tile of one
query); TQ and Triton's warps and stages are a `Tiles`, looked up per GPU kind in
`TILES_BY_DEVICE` (measured by `scripts/bench_pallas_tiles.py`; 16 queries and Triton's
defaults where the kind has no entry). The grid is (tile, kv head): a program reads the K/V
blocks its tile needs, once for its TQ queries and the G = H / Hkv query heads of its kv head,
with an online softmax over blocks, from the block of its first query's window start (block 0
without a window) to the block of its last query (a decode row reads its own kv_len positions,
or its window). The tiles are laid out by a few small XLA ops around the kernel: a static count
bounds them (each row gives ceil(q_len / TQ) tiles, so R + ceil(T / TQ) suffice), the step's
queries are gathered into [tiles, Hkv, M, D] (M = TQ * G rounded up to a power of two and to at
least 16, as Triton's blocks must be) beside each query vector's keys [tiles, 2, M]
(`ragged_attention.key_ranges`: its window, causal end and out-of-range cut, applied as a mask
per query vector), and the tiles' outputs are put back in token order. Every load and store in
the kernel is then a whole block, without masks. A block inside a tile's range whose table
entry is out of range (only possible with a window, between one query's keys and a later
query's window start) is read at a clamped index, its keys masked for every query and its
values zeroed.

Numerics follow the XLA path (`attention_math.decode_attention`): q cast to the cache dtype, scores
(times the scale, soft-capped if asked) and the softmax in f32, probabilities cast to the
value dtype for P @ V, accumulation in f32. The probabilities are rounded before
normalisation (online softmax), so a bf16 pool agrees with the XLA path to bf16 rounding, not
bit for bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpipe.kernels import kv_int8
from jaxpipe.kernels.ragged_attention import _as_pool, _check_shapes, key_ranges


@dataclass(frozen=True)
class Tiles:
    """How the kernel cuts its work: `tq` queries of one span per tile (a decode row is one
    tile, padded to `tq` queries), and Triton's `num_warps` / `num_stages` for the program
    (None: Triton's defaults). `scripts/bench_pallas_tiles.py` measures them on a GPU."""

    tq: int = 16
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        if self.tq < 1 or self.tq & (self.tq - 1):
            raise ValueError(f"Tiles.tq must be a power of two >= 1, got {self.tq}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Tiles.{name} must be None or >= 1, got {value}")


DEFAULT_TILES = Tiles()
# The measured best tiles per GPU kind (jax's device_kind), from scripts/bench_pallas_tiles.py;
# a kind not listed gets DEFAULT_TILES. Empty until a GPU run fills it (issue 46).
TILES_BY_DEVICE: dict[str, Tiles] = {}
MIN_ROWS = 16  # Triton's dot needs at least 16 rows: a tile's query vectors are padded to it


def tiles_for(device_kind: str) -> Tiles:
    """The tiles for a device kind: the measured table's entry, else the default."""
    return TILES_BY_DEVICE.get(device_kind, DEFAULT_TILES)


def pallas_attention(q, k, v, table, q_start, q_len, kv_len, layer=0, *, window=0,
                     softcap: float = 0.0, scale: float | None = None,
                     interpret: bool = False, tiles: Tiles | None = None) -> jax.Array:
    """Causal attention of each row's span of query tokens over its paged keys and values;
    arguments and result as `ragged_attention.ragged_attention` (q [T, H, D]; k, v
    [L, NB, Hkv, BS, D] or [NB, Hkv, BS, D], f32, bf16 or bf16 bits as u16; table [R, MB];
    q_start, q_len, kv_len [R]; layer an int or traced i32; window an int or traced i32
    (<= 0: none), softcap (<= 0: none), scale (None: 1 / sqrt(D))). Blocks wholly before a
    tile's earliest window start are never read. `interpret`: run the kernel in Pallas'
    interpreter (any backend; for tests). `tiles`: how the work is cut (None: `tiles_for`
    the first device's kind)."""
    k, v = _as_pool(k), _as_pool(v)
    _check_shapes(q, k, v, table, q_start, q_len, kv_len)
    num_tokens, heads, d = q.shape
    num_layers, num_blocks, kv_heads, block, _ = k.shape
    if 0 in table.shape or num_tokens == 0:
        return jnp.zeros(q.shape, jnp.float32)
    g = heads // kv_heads
    cut = tiles or tiles_for(jax.devices()[0].device_kind)
    tiles = _tiles(table, q_start, q_len, kv_len, num_tokens, num_blocks, block, window, cut.tq)
    q_tiles = _gather_queries(q.astype(jnp.float32), tiles, kv_heads, cut.tq)
    bounds = _vector_bounds(tiles, g, q_tiles.shape[2])
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1).reshape(1)
    kernel = functools.partial(_kernel, block=block, scale=1 / math.sqrt(d) if scale is None
                               else scale, softcap=softcap)
    out = _call_kernel(kernel, cut, interpret, tiles["meta"], layer,
                       jnp.asarray(table, jnp.int32), q_tiles, bounds, k, v)
    return _scatter_outputs(out, tiles, num_tokens, heads, g, cut.tq)


def _call_kernel(kernel, cut: Tiles, interpret: bool, meta, layer, table, q_tiles, bounds, k, v):
    """`kernel` over the grid (tile, kv head): each program gets its tile's query vectors
    (q_tiles [n, Hkv, M, D]) and their key bounds (bounds [n, 2, M]), and the whole of the
    rest (meta [n, 3], layer [1], table [R, MB], the pools k, v); out [n, Hkv, M, D] f32."""
    n, kv_heads, m, d = q_tiles.shape
    whole = pl.no_block_spec  # the whole array: the kernel indexes it (pool, table, scalars)
    return pl.pallas_call(
        kernel,
        grid=(n, kv_heads),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((1, 1, m, d), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((1, 2, m), lambda i, h: (i, 0, 0)),
                  whole, whole],
        out_specs=pl.BlockSpec((1, 1, m, d), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n, kv_heads, m, d), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(cut),
    )(meta, layer, table, q_tiles, bounds, k, v)


def _triton_params(cut: Tiles):
    """Triton's compiler parameters for `cut` (None where it sets none)."""
    if cut.num_warps is None and cut.num_stages is None:
        return None
    return plgpu.CompilerParams(num_warps=cut.num_warps, num_stages=cut.num_stages)


def _tiles(table, q_start, q_len, kv_len, num_tokens: int, num_blocks: int, block: int,
           window, tq: int):
    """Each tile's row and the blocks it reads, first .. end - 1 ("meta" [n, 3]), its first
    token ("token0" [n]), query count ("count" [n]) and each query's keys lo .. hi - 1 ("lo",
    "hi" [n, TQ]; 0, 0 past count), for a static n = R + ceil(T / TQ) tiles of TQ = `tq`
    queries (unused ones: 0 queries). Spans are clamped as the contract says."""
    rows = table.shape[0]
    cap = table.shape[1] * block
    kv = jnp.clip(jnp.asarray(kv_len, jnp.int32), 0, cap)
    ql = jnp.clip(jnp.asarray(q_len, jnp.int32), 0, kv)
    per_row = -(-ql // tq)
    ends = jnp.cumsum(per_row)  # [R] one past each row's last tile
    n = rows + -(-num_tokens // tq)
    tile = jnp.arange(n, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(ends, tile, side="right"), 0, rows - 1).astype(jnp.int32)
    offset = (tile - (ends[row] - per_row[row])) * tq  # the tile's first query in its span
    count = jnp.where(tile < ends[-1], jnp.minimum(tq, ql[row] - offset), 0)
    pos0 = kv[row] - ql[row] + offset
    query = jnp.arange(tq, dtype=jnp.int32)[None, :]
    rows = jnp.where(query < count[:, None], row[:, None], -1)  # [n, TQ]
    lo, hi = key_ranges(table, rows.reshape(-1), (pos0[:, None] + query).reshape(-1),
                        num_blocks, block, window)
    lo, hi = lo.reshape(n, tq), hi.reshape(n, tq)
    # lo and hi grow with the position: the first query starts the reads, the last ends them.
    first = lo[:, 0] // block
    end = jnp.where(count > 0, (hi.max(axis=1) + block - 1) // block, 0)
    token0 = jnp.asarray(q_start, jnp.int32)[row] + offset
    meta = jnp.stack([row, first, end], axis=1).astype(jnp.int32)
    return {"meta": meta, "token0": token0, "count": count, "lo": lo, "hi": hi}


def _vector_bounds(tiles, g: int, m: int):
    """[n, 2, M]: the keys lo, hi of each query vector of a tile (row j * G + gi: query j;
    padding rows 0, 0: no keys)."""
    lo, hi = (jnp.repeat(tiles[x], g, axis=1) for x in ("lo", "hi"))  # [n, TQ * G]
    bounds = jnp.stack([lo, hi], axis=1)
    return jnp.pad(bounds, ((0, 0), (0, 0), (0, m - bounds.shape[2])))


def _token_index(tiles, num_tokens: int, tq: int):
    """[n, TQ] token of each tile query, and whether it is one (in the tile and in [0, T))."""
    idx = tiles["token0"][:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
    ok = (jnp.arange(tq)[None, :] < tiles["count"][:, None]) & (idx >= 0) & (idx < num_tokens)
    return jnp.clip(idx, 0, num_tokens - 1), ok


def _gather_queries(q, tiles, kv_heads: int, tq: int):
    """q [T, H, D] -> [n, Hkv, M, D]: tile i, kv head h, row j * G + gi = query j's head
    h * G + gi; rows past TQ * G (padding to M: a power of two, at least MIN_ROWS) and queries
    not in the tile are zeros."""
    num_tokens, heads, d = q.shape
    g = heads // kv_heads
    idx, ok = _token_index(tiles, num_tokens, tq)
    x = jnp.where(ok[:, :, None, None], q[idx], 0.0)  # [n, TQ, H, D]
    x = x.reshape(-1, tq, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads,
                                                                            tq * g, d)
    m = max(MIN_ROWS, pl.next_power_of_2(tq * g))
    return jnp.pad(x, ((0, 0), (0, 0), (0, m - tq * g), (0, 0)))


def _scatter_outputs(out, tiles, num_tokens: int, heads: int, g: int, tq: int):
    """The kernel's [n, Hkv, M, D] back to [T, H, D] in token order (zeros: no span)."""
    n, kv_heads, _, d = out.shape
    x = out[:, :, :tq * g].reshape(n, kv_heads, tq, g, d).transpose(0, 2, 1, 3, 4)
    x = x.reshape(n * tq, heads, d)
    idx, ok = _token_index(tiles, num_tokens, tq)
    target = jnp.where(ok, idx, num_tokens).reshape(-1)  # num_tokens: dropped
    return jnp.zeros((num_tokens, heads, d), jnp.float32).at[target].set(x, mode="drop")


def _kernel(meta_ref, layer_ref, table_ref, q_ref, bounds_ref, k_ref, v_ref, o_ref, *,
            block: int, scale: float, softcap: float):
    """One tile's query vectors (q_ref [1, 1, M, D]) of kv head program_id(1) over their
    row's blocks meta first .. end - 1, each vector over its keys (bounds_ref [1, 2, M]: lo,
    hi), online softmax; o_ref [1, 1, M, D]."""
    i, h = pl.program_id(0), pl.program_id(1)
    row, first, num = (meta_ref[i, c] for c in range(3))
    layer, num_blocks = layer_ref[0], k_ref.shape[1]
    q = q_ref[0, 0]  # [M, D] f32
    lo, hi = bounds_ref[0, 0], bounds_ref[0, 1]  # [M]
    m_rows = q.shape[0]

    def step(j, carry):
        entry = table_ref[row, j]
        b = jnp.clip(entry, 0, num_blocks - 1)  # out of range: no query's keys (masked)
        kb, vb = _values(k_ref[layer, b, h]), _values(v_ref[layer, b, h])  # [BS, D]
        vb = jnp.where((entry >= 0) & (entry < num_blocks), vb, jnp.zeros_like(vb))
        s = jax.lax.dot_general(q.astype(kb.dtype), kb, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [M, BS]
        if softcap > 0:
            s = softcap * jnp.tanh(s / softcap)
        k_pos = j * block + jnp.arange(block, dtype=jnp.int32)
        ok = (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] < hi[:, None])
        return _online_softmax(carry, jnp.where(ok, s, -jnp.inf), vb)

    init = (jnp.full((m_rows,), -jnp.inf, jnp.float32), jnp.zeros((m_rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    _, l_sum, acc = jax.lax.fori_loop(first, num, step, init)
    o_ref[0, 0] = jnp.where(l_sum[:, None] > 0, acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None],
                            0.0)


def _online_softmax(carry, s, vb):
    """One block's step of the online softmax: the running max [M], sum [M] and
    accumulator [M, D] (f32) of `carry` updated with the scores s [M, BS] (-inf: not one of
    the vector's keys) and the block's values vb [BS, D]."""
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key so far: -inf - -inf is nan
    p = jnp.exp(s - base[:, None])
    alpha = jnp.exp(m_prev - base)
    pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc + pv


def _values(x):
    """A block read from the pool -> its compute dtype (u16 holds bf16 bits; int8 rows of
    codes and a scale are dequantized to f32 in the tile, `kv_int8.py`)."""
    if x.dtype == jnp.int8:
        return kv_int8.dequantize(x)
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x
