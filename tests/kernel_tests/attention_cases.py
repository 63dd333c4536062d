"""The cases every ragged-span attention implementation is tested on (the C++ CPU kernel,
the Pallas kernel in interpret mode, the XLA path) and the float64 NumPy textbook reference
they are checked against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.kernels import pallas_attention as pa
from jaxpipe.kernels import ragged_attention as ra
from jaxpipe.kernels.paged import from_storage, to_storage

# Every implementation of the ragged-span contract: the C++ kernel, Pallas in its
# interpreter, the XLA path.
IMPLS = {"cpu": ra.ragged_attention,
         "pallas-interpret": functools.partial(pa.pallas_attention, interpret=True),
         "xla": ra.reference}

# Prime-ish sizes so that a swapped axis fails loudly. A pool of NB blocks of BS tokens; each
# row's table has MB entries (MB * BS = 40 positions); R * MB = 56 < NB: some blocks unused.
H, HKV, D = 6, 2, 16
BS, MB, NB = 5, 8, 61
CAP = MB * BS
# Row r's span: Q_LEN[r] queries ending at position KV_LEN[r] - 1, tokens Q_START[r].. of q.
# Decode (1), spans of 2, 7 (no prefix), 13, 29 and a whole row (40), an idle row (0); tiles of
# 16 split the longer ones; spans cross block boundaries. In q the spans are out of row order,
# with tokens 0, 32, 87, 95, 96 in no span.
Q_LEN = [1, 2, 7, 13, 29, CAP, 0]
KV_LEN = [23, 11, 7, 31, 35, CAP, 11]
Q_START = [73, 30, 88, 74, 1, 33, 5]
R, T = len(Q_LEN), 97
UNCOVERED = [0, 32, 87, 95, 96]


def int16_codes(x):
    """x -> (codes, s), x ~= s * codes: the kernel's int16 quantization (`vnni::quantize16`)
    in float32, as it computes it: s = max|x| * f32(1 / 32767) (1 if all zero), codes =
    round-half-even(x * f32(1 / s))."""
    x32 = np.asarray(x, np.float32)
    amax = np.abs(x32).max()
    s = amax * (np.float32(1) / np.float32(32767)) if amax > 0 else np.float32(1)
    return np.clip(np.rint(x32 * (np.float32(1) / s)), -32767, 32767), np.float32(s)


def numpy_attention(q, k, v, table, q_start, q_len, kv_len, layer=0, window=0, softcap=0.0,
                    scale=None, v_scales=None):
    """Textbook softmax(logits)·v in float64, query by query, each key found by walking the
    row's table: position t is k[layer, table[r, t // BS], :, t % BS]. The query at position
    p sees keys lo .. p, lo = p - window + 1 with a window (> 0), else 0; logits are
    q·kᵀ·scale (default 1/√D), then softcap·tanh(logit / softcap) if softcap > 0. Applies the
    contract's clamping rules itself: a query's keys stop before the first of its blocks (lo's
    .. p's) whose table entry is outside [0, NB).

    `v_scales` ([L, NB, Hkv, BS], an int8 pool's value rows' scales): the kernel's int16
    decode rows (`ragged_attention.int16_decode`) for each query alone in its tile of 16
    (one-query tasks): q per head as int16 codes times their scale, and each head's
    probabilities times the value rows' scales as int16 codes over the query's keys."""
    num_tokens, heads, d = q.shape
    g, bs, nb = heads // k.shape[2], k.shape[3], k.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros((num_tokens, heads, d))
    for r in range(len(q_len)):
        kv = min(max(kv_len[r], 0), table.shape[1] * bs)
        ql = min(max(q_len[r], 0), kv)
        for i in range(ql):
            token, p = q_start[r] + i, kv - ql + i
            lo = max(0, p - window + 1) if window > 0 else 0
            bad = [j for j in range(lo // bs, p // bs + 1) if not 0 <= table[r, j] < nb]
            hi = max(lo, bad[0] * bs) if bad else p + 1
            if not 0 <= token < num_tokens or hi <= lo:
                continue
            where = [(table[r, t // bs], t % bs) for t in range(lo, hi)]
            keys = np.stack([k[layer, b, :, o] for b, o in where], 1)  # [Hkv, n, D]
            vals = np.stack([v[layer, b, :, o] for b, o in where], 1)
            alone = v_scales is not None and i // 16 * 16 == ql - 1
            for head in range(heads):
                qh = q[token, head]
                if alone:
                    codes, qs = int16_codes(qh)
                    qh = codes.astype(np.float64) * np.float64(qs)
                s = keys[head // g] @ qh * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                e = np.exp(s - s.max())
                p = e / e.sum()
                if alone:
                    vs = np.array([v_scales[layer, b, head // g, o] for b, o in where])
                    codes, ws = int16_codes(p.astype(np.float32) * vs.astype(np.float32))
                    p = codes.astype(np.float64) * np.float64(ws) / vs
                out[token, head] = p @ vals[head // g]
    return out


def shuffled_table(seed=0):
    """[R, MB]: each row's blocks scattered over the pool; NB - R * MB blocks unused."""
    perm = np.random.default_rng(seed).permutation(NB)
    return perm[: R * MB].reshape(R, MB).astype(np.int32)


def inputs(storage, seed=0, head_dim=D, layers=1, heads=H, kv_heads=HKV, tokens=T):
    """q [T, H, D] f32; k, v [layers, NB, Hkv, BS, D] in `storage` (float32, uint16 = bf16
    bits, or bfloat16; int8: rows [..., D + 2] of codes and a scale)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(tokens, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(layers, NB, kv_heads, BS, head_dim)).astype(np.float32)
    v = rng.normal(size=(layers, NB, kv_heads, BS, head_dim)).astype(np.float32)
    store = jnp.zeros((1,), storage)
    return jnp.asarray(q), to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)


def f64(*arrays):
    """float64 copies (a u16 pool holds bf16 bits; an int8 pool rows of codes and a bf16
    scale, read back here by `numpy_dequantize`, not by the code under test)."""
    return [numpy_dequantize(np.asarray(a)) if jnp.asarray(a).dtype == jnp.int8
            else np.asarray(from_storage(jnp.asarray(a)), np.float64) for a in arrays]


def numpy_row_scales(rows):
    """int8 rows [..., D + 2] -> their scales [...] (the bf16 after the codes), float64."""
    tail = rows[..., -2:].view(np.uint8).astype(np.uint32)
    bits = (tail[..., 0] | tail[..., 1] << 8) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def numpy_dequantize(rows):
    """int8 rows [..., D + 2] (D codes, then a bf16 scale: low byte, high byte) -> float64
    [..., D] codes * scale: the int8 KV cache's format (kernels/kv_int8.py) in NumPy."""
    return rows[..., :-2].astype(np.float64) * numpy_row_scales(rows)[..., None]


def i32(*arrays):
    return [jnp.asarray(a, jnp.int32) for a in arrays]


def want(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, int16=False,
         **options):
    """The float64 reference; options: window, softcap, scale. `int16`: an int8 pool's
    one-query tasks as the kernel's int16 decode rows compute them (`numpy_attention`'s
    `v_scales`)."""
    v_scales = numpy_row_scales(np.asarray(v)) if int16 else None
    return numpy_attention(*f64(q, k, v), np.asarray(table), q_start, q_len, kv_len, layer,
                           v_scales=v_scales, **options)


def int16_rows(path, kv_dtype, head_dim) -> bool:
    """Whether kernel `path` (None: the default) runs an int8 pool's one-query tasks by int16
    products on this build."""
    path = path or ra.path_for(kv_dtype, head_dim)
    return (jnp.dtype(kv_dtype) == jnp.dtype(jnp.int8) and path in ("avx512_bf16", "amx")
            and head_dim in ra.VECTOR_DIMS and ra.int16_decode())


def xla(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, max_kv=None,
        window=0, **static):
    """The XLA path under jit (window traced); static: softcap, scale."""
    fn = jax.jit(functools.partial(ra.reference, max_kv=max_kv, **static))
    return np.asarray(fn(q, k, v, *i32(table, q_start, q_len, kv_len), jnp.int32(layer),
                         window=jnp.int32(window)))


def close(got, expected, tol=2e-5):
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol)
