"""The arithmetic of `quantization="gguf"`, in jnp: GGUF's quantized blocks as they are stored,
the activations quantized as llama.cpp quantizes them for each weight format, and XLA's
reference dot of the quantized pair (the portable path and the numerics reference every
C++ path of `gguf_matmul` matches).

A GGUF matrix of N rows (output columns) by K (input) is N rows of K / 32 blocks, each block
32 consecutive k's of one row (ggml's block layouts, little-endian, f16 scales):

- q8_0 (34 bytes): d f16, then 32 int8 codes q; w = d * q.
- q4_0 (18 bytes): d f16, then 16 bytes: byte i holds code i in its low nibble and code
  i + 16 in its high one; w = d * (q - 8).
- q4_1 (20 bytes): d f16, m f16, then the 16 nibble bytes as q4_0's; w = d * q + m.

A row of x [..., K] is quantized per block of 32 (llama.cpp's `quantize_row_q8_0` /
`quantize_row_q8_1`): d = amax * f32(1 / 127) (llama.cpp divides by 127; the product is
the one every implementation here reproduces to the bit, as `int8.py` says), codes =
round half away from zero (C's roundf) of x * (1 / d), 0 for an all-zero block; the scale
the dot uses is d rounded to f16 (llama.cpp stores it so). Q8_1, which q4_1 pairs with,
also keeps s = f16(d * sum of the block's codes), for the weight's m.

The dot of a row with a weight row, per block b, as llama.cpp's vec_dot: an exact integer sum
sumi_b = sum_i qx_i qw_i (q4_0: qw - 8), then y = sum_b (dx_b dw_b) sumi_b (+ mw_b sx_b for
q4_1), in f32.

q4_k (144 bytes a super-block of 256): d f16, dmin f16, 12 bytes of eight 6-bit sub-block
scales sc_j and minimums m_j (ggml's `get_scale_min_k4` packing), then 128 bytes of nibbles:
bytes 32c .. 32c + 31 hold sub-block 2c in their low nibbles and 2c + 1 in their high ones;
w = (d sc_j) q - (dmin m_j). Its activations are q8_k (llama.cpp's `quantize_row_q8_K`): per
256, the value of largest magnitude v (the first), iscale = -127 / v, codes = round half to
even of iscale x, d = 1 / iscale in f32 (no f16), and each sub-block of 32's code sum. The dot,
per super-block: isum = sum_j sc_j sumi_j and msum = sum_j m_j xsum_j, both exact integers,
then y += (dx d) isum - (dx dmin) msum.

q6_k (210 bytes a super-block): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
scales (one per 16 weights), d f16; in each half of 128 weights (64 ql bytes, 32 qh bytes),
weight 32u + l (u = 0..3, l < 32) is ql[l + 32 (u % 2)]'s low nibble (u < 2) or high one,
with bits 2u, 2u + 1 of qh[l] above it; w = (d sc_(i / 16)) (q - 32). With q8_k: isum =
sum_i sc_i sum (q - 32) x over each 16, exact, then y += (dx d) isum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # weights (and activation codes) per block of every format here
STEP = np.float32(1 / 127)  # an activation block's d is amax * STEP


SUPER = 256  # weights per k-quant super-block (8 sub-blocks of BLOCK)


@dataclasses.dataclass(frozen=True)
class Format:
    """A GGUF block format: its name (`Matmul.quant`), GGML type id, bytes per block of
    `block` weights, and the activation quantization llama.cpp pairs it with."""

    name: str
    ggml_type: int
    block_bytes: int
    activations: str  # "q8_0", "q8_1" (with the block's code sum times d) or "q8_k"
    block: int = BLOCK


FORMATS = {f.name: f for f in (Format("q8_0", 8, 34, "q8_0"), Format("q4_0", 2, 18, "q8_0"),
                               Format("q4_1", 3, 20, "q8_1"),
                               Format("q4_k", 12, 144, "q8_k", SUPER),
                               Format("q6_k", 14, 210, "q8_k", SUPER))}


def format_of(name: str) -> Format:
    """The Format named `name` (e.g. "q4_1"), or a clear error listing those supported."""
    if name not in FORMATS:
        raise ValueError(f"GGUF format {name!r} has no block kernel; supported: "
                         f"{', '.join(FORMATS)}")
    return FORMATS[name]


def row_bytes(fmt: Format, k: int) -> int:
    """Bytes of one GGUF row of K weights (K a multiple of the format's block)."""
    if k % fmt.block:
        raise ValueError(f"GGUF {fmt.name}: K must be a multiple of {fmt.block}; got {k}")
    return k // fmt.block * fmt.block_bytes


def _f16(lo, hi) -> jax.Array:
    """Little-endian f16 bytes (uint8 arrays) -> f32 values."""
    bits = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(qs) -> jax.Array:
    """16 packed bytes [..., 16] -> 32 codes [..., 32] (low nibbles first), uint8 0..15."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def random_blocks(fmt: Format, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random GGUF rows [..., N, R] uint8 for weights of `shape` [..., N, K]: random codes,
    block scales (and q4_1 minimums) of about 1 / 64 as f16 (timing inputs, not a model's)."""
    rng = np.random.default_rng(seed)
    *lead, n, k = shape
    blocks = rng.integers(0, 256, size=(*lead, n, k // fmt.block, fmt.block_bytes),
                          dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, size=(*blocks.shape[:-1], 2)) / 64).astype(np.float16)
    if fmt.name == "q6_k":  # d last; scales int8 in [-64, 64)
        blocks[..., 208:] = scales.view(np.uint8)[..., :2]
        scales = rng.integers(-64, 64, size=(*blocks.shape[:-1], 16)).astype(np.int8)
        blocks[..., 192:208] = scales.view(np.uint8)
        return blocks.reshape(*lead, n, -1)
    head = 4 if fmt.name in ("q4_1", "q4_k") else 2  # q4_k: d, dmin
    blocks[..., :head] = scales.view(np.uint8)[..., :head]
    return blocks.reshape(*lead, n, -1)


def decode(w, fmt: Format) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """GGUF rows w [..., N, R] uint8 (R = K / 32 blocks of fmt.block_bytes) -> (codes
    [..., N, K / 32, 32] int8 as the dot multiplies them (q4_0: q - 8; q4_1: 0..15), d
    [..., N, K / 32] f32, m [..., N, K / 32] f32 for q4_1 else None)."""
    w = jnp.asarray(w)
    if w.dtype != jnp.uint8 or w.ndim < 2 or w.shape[-1] % fmt.block_bytes:
        raise ValueError(f"GGUF {fmt.name}: w must be uint8 rows [..., N, blocks * "
                         f"{fmt.block_bytes}]; got {w.dtype} {w.shape}")
    b = w.reshape(*w.shape[:-1], w.shape[-1] // fmt.block_bytes, fmt.block_bytes)
    d = _f16(b[..., 0], b[..., 1])
    if fmt.name == "q8_0":
        return jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8), d, None
    if fmt.name == "q4_0":
        return _nibbles(b[..., 2:]).astype(jnp.int8) - 8, d, None
    return _nibbles(b[..., 4:]).astype(jnp.int8), d, _f16(b[..., 2], b[..., 3])


def decode_k(w, fmt: Format) -> tuple[jax.Array, ...]:
    """q4_k rows w [..., N, R] uint8 -> (codes [..., N, S, 8, 32] uint8 0..15, sc and m
    [..., N, S, 8] int32 (6 bits each), d and dmin [..., N, S] f32), S = K / 256."""
    w = jnp.asarray(w)
    if w.dtype != jnp.uint8 or w.ndim < 2 or w.shape[-1] % fmt.block_bytes:
        raise ValueError(f"GGUF {fmt.name}: w must be uint8 rows [..., N, blocks * "
                         f"{fmt.block_bytes}]; got {w.dtype} {w.shape}")
    b = w.reshape(*w.shape[:-1], w.shape[-1] // fmt.block_bytes, fmt.block_bytes)
    d, dmin = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    s = b[..., 4:16].astype(jnp.int32)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    m = jnp.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 1, 32)
    codes = jnp.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)
    return codes, sc, m, d, dmin


def decode_k6(w, fmt: Format) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q6_k rows w [..., N, R] uint8 -> (codes [..., N, S, 16, 16] int8 (q - 32, in [-32, 32)),
    sc [..., N, S, 16] int32 (each 16 weights' int8 scale), d [..., N, S] f32)."""
    w = jnp.asarray(w)
    if w.dtype != jnp.uint8 or w.ndim < 2 or w.shape[-1] % fmt.block_bytes:
        raise ValueError(f"GGUF {fmt.name}: w must be uint8 rows [..., N, blocks * "
                         f"{fmt.block_bytes}]; got {w.dtype} {w.shape}")
    b = w.reshape(*w.shape[:-1], w.shape[-1] // fmt.block_bytes, fmt.block_bytes)
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 1, 64)  # [.., half, nibble, 64]
    ql = jnp.concatenate([ql & 15, ql >> 4], axis=-2).reshape(*lead, 2, 4, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = jnp.concatenate([(qh >> (2 * u)) & 3 for u in range(4)], axis=-2)  # [.., 2, 4, 32]
    codes = (ql | (qh << 4)).astype(jnp.int8) - 32
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.int32)
    return codes.reshape(*lead, 16, 16), sc, _f16(b[..., 208], b[..., 209])


def dequantize(w, fmt: Format) -> jax.Array:
    """GGUF rows w [..., N, R] uint8 -> weights [..., N, K] f32 (equal to
    `gguf.quants.dequantize`: d * q, then + m; q4_k: (d sc) q - dmin m)."""
    if fmt.name == "q6_k":
        codes, sc, d = decode_k6(w, fmt)
        scale = d[..., None] * sc.astype(jnp.float32)
        y = scale[..., None] * codes.astype(jnp.float32)
        return y.reshape(*y.shape[:-3], -1)
    if fmt.activations == "q8_k":
        codes, sc, m, d, dmin = decode_k(w, fmt)
        scale = d[..., None] * sc.astype(jnp.float32)
        y = scale[..., None] * codes.astype(jnp.float32) - (dmin[..., None] * m)[..., None]
        return y.reshape(*y.shape[:-3], -1)
    codes, d, m = decode(w, fmt)
    y = d[..., None] * codes.astype(jnp.float32)
    if m is not None:
        y = y + m[..., None]
    return y.reshape(*y.shape[:-2], -1)


def round_away(v) -> jax.Array:
    """C's roundf: to nearest, halves away from zero (v - trunc(v) is exact in f32)."""
    t = jnp.trunc(v)
    return t + jnp.where(jnp.abs(v - t) >= 0.5, jnp.sign(v), 0)


def quantize_rows(x, activations: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """x [..., K] (K a multiple of 32) -> llama.cpp's q8_0 / q8_1 blocks: (codes [..., K / 32,
    32] int8, d [..., K / 32] f32 (the f16-rounded scale), s [..., K / 32] f32 =
    f16(d * sum codes) for "q8_1", else None)."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"GGUF activations: x must be [..., K], K a multiple of {BLOCK}; got "
                         f"{x.shape}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    d = jnp.max(jnp.abs(blocks), axis=-1) * STEP
    inv = jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 0)
    codes = jnp.clip(round_away(blocks * inv[..., None]), -127, 127).astype(jnp.int8)
    d16 = d.astype(jnp.float16).astype(jnp.float32)
    if activations == "q8_0":
        return codes, d16, None
    sums = jnp.sum(codes.astype(jnp.int32), axis=-1).astype(jnp.float32)
    return codes, d16, (d * sums).astype(jnp.float16).astype(jnp.float32)


def quantize_rows_k(x) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., K] (K a multiple of 256) -> llama.cpp's q8_k: (codes [..., S, 256] int8, d
    [..., S] f32, sums [..., S, 8] int32: each sub-block of 32's code sum)."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim < 1 or x.shape[-1] % SUPER:
        raise ValueError(f"GGUF q8_k activations: x must be [..., K], K a multiple of {SUPER}; "
                         f"got {x.shape}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // SUPER, SUPER)
    first = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]  # the first of largest magnitude
    top = jnp.take_along_axis(blocks, first, axis=-1)[..., 0]
    safe = jnp.where(top == 0, 1, top)
    iscale = jnp.float32(-127) / safe
    codes = jnp.minimum(jnp.round(blocks * iscale[..., None]), 127)
    codes = jnp.where(top[..., None] == 0, 0, codes).astype(jnp.int8)
    d = jnp.where(top == 0, 0, 1 / iscale)
    sums = codes.reshape(*codes.shape[:-1], 8, BLOCK).astype(jnp.int32).sum(-1)
    return codes, d, sums


def reference_k6(x, w, fmt: Format) -> jax.Array:
    """x [M, K] @ q6_k rows w [N, R] -> [M, N] f32 (llama.cpp's q6_K x q8_K dot): per
    super-block, isum = sum_i sc_i ((q - 32) . x) over each 16 as one int32 dot of x's codes
    with the codes times their scale, then y += (dx d) isum."""
    codes, sc, d = decode_k6(w, fmt)
    x_codes, x_d, _ = quantize_rows_k(x)
    scaled = (codes.astype(jnp.int32) * sc[..., None]).astype(jnp.int16)  # <= 32 x 128
    scaled = scaled.reshape(*scaled.shape[:-2], SUPER)

    def block(acc, b):
        xq, xd, wq, wd = b
        isum = jax.lax.dot_general(xq.astype(jnp.int16), wq, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)
        return acc + (xd[:, None] * wd[None, :]) * isum.astype(jnp.float32), None

    per_block = tuple(jnp.moveaxis(a, 1, 0) for a in (x_codes, x_d, scaled, d))
    acc = jnp.zeros((x_codes.shape[0], codes.shape[0]), jnp.float32)
    return jax.lax.scan(block, acc, per_block)[0]


def reference_k(x, w, fmt: Format) -> jax.Array:
    """x [M, K] @ q4_k rows w [N, R] -> [M, N] f32 (llama.cpp's q4_K x q8_K dot): per
    super-block, isum = sum_j sc_j (x_j . q_j) as one int32 dot of x's codes with the codes
    times their sub-block scale, msum = sum_j m_j xsum_j, y += (dx d) isum - (dx dmin) msum."""
    codes, sc, m, d, dmin = decode_k(w, fmt)
    x_codes, x_d, x_sums = quantize_rows_k(x)
    scaled = (codes.astype(jnp.int32) * sc[..., None]).astype(jnp.int16)  # <= 15 x 63

    def block(acc, b):
        xq, xd, xs, wq, wsc_m, wd, wdmin = b
        isum = jax.lax.dot_general(xq.astype(jnp.int16), wq.reshape(wq.shape[0], -1),
                                   (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        msum = jax.lax.dot_general(xs, wsc_m, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)
        term = (xd[:, None] * wd[None, :]) * isum.astype(jnp.float32)
        return acc - (xd[:, None] * wdmin[None, :]) * msum.astype(jnp.float32) + term, None

    per_block = (jnp.moveaxis(x_codes, 1, 0), jnp.moveaxis(x_d, 1, 0),
                 jnp.moveaxis(x_sums, 1, 0), jnp.moveaxis(scaled, 1, 0), jnp.moveaxis(m, 1, 0),
                 jnp.moveaxis(d, 1, 0), jnp.moveaxis(dmin, 1, 0))
    acc = jnp.zeros((x_codes.shape[0], codes.shape[0]), jnp.float32)
    return jax.lax.scan(block, acc, per_block)[0]


def quantized_reference(x_codes, x_d, x_s, w_codes, w_d, w_m) -> jax.Array:
    """XLA's dot of a quantized pair: x (codes [M, B, 32], d [M, B], s [M, B] or None), w
    (codes [N, B, 32], d [N, B], m [N, B] or None) -> y [M, N] f32: per block an exact int32
    sum, then y += (dx dw) sumi (+ mw sx), block by block."""
    def block(acc, b):
        xq, xd, wq, wd = b[0], b[1], b[2], b[3]
        sumi = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)  # [M, N]
        term = (xd[:, None] * wd[None, :]) * sumi.astype(jnp.float32)
        if len(b) == 6:
            term = term + b[5][None, :] * b[4][:, None]
        return acc + term, None

    per_block = [jnp.moveaxis(a, 1, 0) for a in (x_codes, x_d, w_codes, w_d)]
    if w_m is not None:
        per_block += [jnp.moveaxis(x_s, 1, 0), jnp.moveaxis(w_m, 1, 0)]
    acc = jnp.zeros((x_codes.shape[0], w_codes.shape[0]), jnp.float32)
    return jax.lax.scan(block, acc, tuple(per_block))[0]


def reference(x, w, fmt: Format) -> jax.Array:
    """x [..., K] (any float dtype) @ GGUF rows w [N, R] uint8 of format `fmt` -> [..., N]
    f32: x quantized as llama.cpp does for `fmt`, then `quantized_reference` (`reference_k`
    for q4_k)."""
    if fmt.activations == "q8_k":
        k, n = jnp.shape(x)[-1], jnp.shape(w)[-2]
        if jnp.shape(w)[-1] != row_bytes(fmt, k):
            raise ValueError(f"GGUF {fmt.name}: x's K {k} does not match w {jnp.shape(w)}")
        dot = reference_k6 if fmt.name == "q6_k" else reference_k
        y = dot(jnp.reshape(x, (-1, k)), w, fmt)
        return y.reshape(*jnp.shape(x)[:-1], n)
    w_codes, w_d, w_m = decode(w, fmt)
    if jnp.shape(x)[-1] != w_codes.shape[-2] * BLOCK:
        raise ValueError(f"GGUF {fmt.name}: x's K {jnp.shape(x)[-1]} is not w's "
                         f"{w_codes.shape[-2] * BLOCK} (w {jnp.shape(w)})")
    lead = jnp.shape(x)[:-1]
    x_codes, x_d, x_s = quantize_rows(jnp.reshape(x, (-1, jnp.shape(x)[-1])), fmt.activations)
    y = quantized_reference(x_codes, x_d, x_s, w_codes, w_d, w_m)
    return y.reshape(*lead, w_codes.shape[-3])
