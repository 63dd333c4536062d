"""Attention kernels against the XLA path, on SmolLM2's head shapes.

`measure_spans` times the ragged-span kernel (`kernels.ragged_attention`) on one step of spans
(decode: one query per row; prefill: chunks of queries) against its jnp `reference` (each
token gathers its row's positions through the table) and, for decode, against the old decode
kernel, on the same bf16 (u16) pool, table and data. `measure` below is the older decode sweep.

Both read one layer's bf16 (stored as u16) keys and values for B rows of random lengths. The
kernel reads them from a paged pool of BS-token blocks through a block table (`identity`: row
b's blocks are b*MB..(b+1)*MB-1, a dense cache; `shuffled`: scattered over the pool), each row
over its own length. The XLA path attends over the same data laid out dense [B, Hkv, S, D],
up to the static length bucket of the longest row (as the fallback runner does per block).
Medians of repeated calls, same process.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def _median_seconds(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians(calls: dict, repeats: int) -> dict:
    """name -> (fn, args): median seconds of each, timed in turns (round r runs every fn once)
    so that load from other processes falls on all of them alike."""
    import jax

    times = {name: [] for name in calls}
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(rows: int, mean_len: int, seq: int = 2048, block_size: int = 16,
            table: str = "identity", repeats: int = 5, seed: int = 0) -> dict:
    """One (rows, mean length) point: milliseconds per layer for each path and their ratio.
    `table`: "identity" or "shuffled" (how the rows' blocks lie in the kernel's pool)."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.kernels import decode_attention as da
    from jaxpipe.kv.device_cache import from_storage
    from jaxpipe.model import llama

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, rows), 1, seq)
    blocks = block_table(rows, -(-seq // block_size), table, rng)  # [B, MB]
    pool = (blocks.size, KV_HEADS, block_size, HEAD_DIM)  # [NB, Hkv, BS, D]
    k = jnp.asarray(rng.integers(0x3c00, 0x3f80, pool), jnp.uint16)
    v = jnp.asarray(rng.integers(0x3c00, 0x3f80, pool), jnp.uint16)
    q = jnp.asarray(rng.normal(size=(rows, HEADS, HEAD_DIM)), jnp.float32)
    bucket = min(seq, 1 << int(np.ceil(np.log2(lengths.max()))))
    dense_k, dense_v = (dense(x, blocks) for x in (k, v))  # [B, Hkv, S, D], built once

    def xla(q, k, v, pos):
        kk, vv = from_storage(k[:, :, :bucket]), from_storage(v[:, :, :bucket])
        return llama.decode_attention(q, kk, vv, pos)

    lens = jnp.asarray(lengths, jnp.int32)
    t_xla = _median_seconds(jax.jit(xla), (q, dense_k, dense_v, lens - 1), repeats)
    t_kernel = _median_seconds(jax.jit(da.decode_attention),
                               (q, k, v, lens, jnp.asarray(blocks)), repeats)
    tokens = int(lengths.sum())
    return {"rows": rows, "mean_len": float(lengths.mean()), "table": table,
            "block_size": block_size, "xla_bucket": bucket, "xla_ms": t_xla * 1e3,
            "kernel_ms": t_kernel * 1e3, "speedup": t_xla / t_kernel,
            "kernel_gb_per_s": tokens * KV_HEADS * HEAD_DIM * 2 * 2 / t_kernel / 1e9}


SPAN_CASES = {  # name -> (q_len per row, kv_len per row)
    "decode 32x512": ([1] * 32, [512] * 32),
    "prefill 4x256 after 256": ([256] * 4, [512] * 4),
    "prefill 1x512": ([512], [512]),
}


def measure_spans(name: str, q_len: list[int], kv_len: list[int], block_size: int = 16,
                  table: str = "shuffled", repeats: int = 5, seed: int = 0) -> dict:
    """One step of spans (row r: q_len[r] queries ending at position kv_len[r] - 1, rows laid
    out in q in order): milliseconds per layer for the ragged kernel, the XLA reference and,
    when every span is one token, the old decode kernel."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.kernels import decode_attention as da
    from jaxpipe.kernels import ragged_attention as ra

    rng = np.random.default_rng(seed)
    rows, tokens = len(q_len), int(sum(q_len))
    blocks = block_table(rows, -(-max(kv_len) // block_size), table, rng)  # [R, MB]
    pool = (blocks.size, KV_HEADS, block_size, HEAD_DIM)  # [NB, Hkv, BS, D]
    k = jnp.asarray(rng.integers(0x3c00, 0x3f80, pool), jnp.uint16)
    v = jnp.asarray(rng.integers(0x3c00, 0x3f80, pool), jnp.uint16)
    q = jnp.asarray(rng.normal(size=(tokens, HEADS, HEAD_DIM)), jnp.float32)
    spans = [jnp.asarray(x, jnp.int32) for x in (blocks, np.cumsum([0, *q_len[:-1]]), q_len,
                                                  kv_len)]
    args = (q, k, v, *spans)
    calls = {"ragged": (jax.jit(ra.ragged_attention), args), "xla": (jax.jit(ra.reference), args)}
    if set(q_len) == {1}:
        calls["decode"] = (jax.jit(da.decode_attention), (q, k, v, spans[3], spans[0]))
    t = _interleaved_medians(calls, repeats)
    t_ragged, t_ref, t_old = t["ragged"], t["xla"], t.get("decode")
    return {"case": name, "rows": rows, "tokens": tokens, "mean_kv": float(np.mean(kv_len)),
            "table": table, "block_size": block_size, "xla_ms": t_ref * 1e3,
            "decode_kernel_ms": None if t_old is None else t_old * 1e3,
            "ragged_ms": t_ragged * 1e3, "vs_xla": t_ref / t_ragged,
            "vs_decode_kernel": None if t_old is None else t_old / t_ragged}


def format_spans(points: list[dict]) -> str:
    head = (f"{'case':<24} {'tokens':>6} {'mean kv':>7} {'XLA ref ms':>10} "
            f"{'decode kernel ms':>16} {'ragged ms':>9} {'vs XLA':>7} {'vs decode':>9}")
    lines = [head, "-" * len(head)]
    for p in points:
        old = p["decode_kernel_ms"]
        old_ms = "-" if old is None else f"{old:.2f}"
        ratio = "-" if old is None else f"{p['vs_decode_kernel']:.2f}x"
        lines.append(f"{p['case']:<24} {p['tokens']:>6} {p['mean_kv']:>7.0f} "
                     f"{p['xla_ms']:>10.2f} {old_ms:>16} {p['ragged_ms']:>9.2f} "
                     f"{p['vs_xla']:>6.1f}x {ratio:>9}")
    return "\n".join(lines)


def block_table(rows: int, max_blocks: int, kind: str, rng) -> np.ndarray:
    """[rows, max_blocks] i32 over a pool of rows * max_blocks blocks: "identity" gives row b
    blocks b*MB..(b+1)*MB-1 in order, "shuffled" a random permutation of the pool."""
    ids = np.arange(rows * max_blocks, dtype=np.int32)
    if kind == "shuffled":
        ids = rng.permutation(ids).astype(np.int32)
    elif kind != "identity":
        raise ValueError(f"table must be 'identity' or 'shuffled', got {kind!r}")
    return ids.reshape(rows, max_blocks)


def dense(pool, table: np.ndarray):
    """A pool [NB, Hkv, BS, D] read through table [B, MB] -> [B, Hkv, MB * BS, D] (a copy)."""
    x = pool[table]  # [B, MB, Hkv, BS, D]
    b, mb, hkv, bs, d = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(b, hkv, mb * bs, d)


def format_table(points: list[dict]) -> str:
    head = (f"{'rows':>5} {'mean len':>9} {'table':>9} {'XLA bucket':>10} {'XLA ms':>8} "
            f"{'kernel ms':>10} {'speedup':>8} {'kernel GB/s':>12}")
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['rows']:>5} {p['mean_len']:>9.0f} {p['table']:>9} {p['xla_bucket']:>10} "
                     f"{p['xla_ms']:>8.1f} {p['kernel_ms']:>10.2f} {p['speedup']:>7.1f}x "
                     f"{p['kernel_gb_per_s']:>12.1f}")
    return "\n".join(lines)
