"""Decode attention: the C++ kernel against the XLA path, on SmolLM2's head shapes.

Both read one layer's bf16 (stored as u16) cache for B rows of random lengths. The XLA path
attends over the static length bucket of the longest row (as the fallback runner does per
block); the kernel reads each row's own length. Medians of repeated calls, same process.
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


def measure(rows: int, mean_len: int, seq: int = 2048, repeats: int = 5, seed: int = 0) -> dict:
    """One (rows, mean length) point: milliseconds per layer for each path and their ratio."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.kernels import decode_attention as da
    from jaxpipe.kv.device_cache import from_storage
    from jaxpipe.model import llama

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, rows), 1, seq)
    k = jnp.asarray(rng.integers(0x3c00, 0x3f80, (rows, KV_HEADS, seq, HEAD_DIM)), jnp.uint16)
    v = jnp.asarray(rng.integers(0x3c00, 0x3f80, (rows, KV_HEADS, seq, HEAD_DIM)), jnp.uint16)
    q = jnp.asarray(rng.normal(size=(rows, HEADS, HEAD_DIM)), jnp.float32)
    bucket = min(seq, 1 << int(np.ceil(np.log2(lengths.max()))))

    def xla(q, k, v, pos):
        kk, vv = from_storage(k[:, :, :bucket]), from_storage(v[:, :, :bucket])
        return llama.decode_attention(q, kk, vv, pos)

    lens = jnp.asarray(lengths, jnp.int32)
    t_xla = _median_seconds(jax.jit(xla), (q, k, v, lens - 1), repeats)
    t_kernel = _median_seconds(jax.jit(da.decode_attention), (q, k, v, lens), repeats)
    tokens = int(lengths.sum())
    return {"rows": rows, "mean_len": float(lengths.mean()), "xla_bucket": bucket,
            "xla_ms": t_xla * 1e3, "kernel_ms": t_kernel * 1e3, "speedup": t_xla / t_kernel,
            "kernel_gb_per_s": tokens * KV_HEADS * HEAD_DIM * 2 * 2 / t_kernel / 1e9}


def format_table(points: list[dict]) -> str:
    head = (f"{'rows':>5} {'mean len':>9} {'XLA bucket':>10} {'XLA ms':>8} {'kernel ms':>10} "
            f"{'speedup':>8} {'kernel GB/s':>12}")
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['rows']:>5} {p['mean_len']:>9.0f} {p['xla_bucket']:>10} "
                     f"{p['xla_ms']:>8.1f} {p['kernel_ms']:>10.2f} {p['speedup']:>7.1f}x "
                     f"{p['kernel_gb_per_s']:>12.1f}")
    return "\n".join(lines)
