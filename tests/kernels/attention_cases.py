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


def numpy_attention(q, k, v, table, q_start, q_len, kv_len, layer=0, window=0, softcap=0.0,
                    scale=None):
    """Textbook softmax(logits)·v in float64, query by query, each key found by walking the
    row's table: position t is k[layer, table[r, t // BS], :, t % BS]. The query at position
    p sees keys lo .. p, lo = p - window + 1 with a window (> 0), else 0; logits are
    q·kᵀ·scale (default 1/√D), then softcap·tanh(logit / softcap) if softcap > 0. Applies the
    contract's clamping rules itself: a query's keys stop before the first of its blocks (lo's
    .. p's) whose table entry is outside [0, NB)."""
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
            for head in range(heads):
                s = keys[head // g] @ q[token, head] * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                e = np.exp(s - s.max())
                out[token, head] = (e / e.sum()) @ vals[head // g]
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


def numpy_dequantize(rows):
    """int8 rows [..., D + 2] (D codes, then a bf16 scale: low byte, high byte) -> float64
    [..., D] codes * scale: the int8 KV cache's format (kernels/kv_int8.py) in NumPy."""
    tail = rows[..., -2:].view(np.uint8).astype(np.uint32)
    bits = (tail[..., 0] | tail[..., 1] << 8) << 16
    scale = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return rows[..., :-2].astype(np.float64) * scale[..., None]


def i32(*arrays):
    return [jnp.asarray(a, jnp.int32) for a in arrays]


def want(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, **options):
    """The float64 reference; options: window, softcap, scale."""
    return numpy_attention(*f64(q, k, v), np.asarray(table), q_start, q_len, kv_len, layer,
                           **options)


def xla(q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, max_kv=None,
        window=0, **static):
    """The XLA path under jit (window traced); static: softcap, scale."""
    fn = jax.jit(functools.partial(ra.reference, max_kv=max_kv, **static))
    return np.asarray(fn(q, k, v, *i32(table, q_start, q_len, kv_len), jnp.int32(layer),
                         window=jnp.int32(window)))


def close(got, expected, tol=2e-5):
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol)
