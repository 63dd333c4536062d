"""The ragged-span attention kernel against the XLA path, on SmolLM2's head shapes.

`measure_spans` times the C++ kernel (`kernels.ragged_attention`) on one step of spans
(decode: one query per row; prefill: chunks of queries) against its jnp `reference` (each
token gathers its row's positions through the table), on the same bf16 (u16) pool, block
table (`identity`: row b's blocks are b*MB..(b+1)*MB-1; `shuffled`: scattered over the pool)
and data, one layer. Medians of calls timed in turns, same process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from jaxpipe.config_checks import check_counts
from jaxpipe_bench.cli import check_names

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


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


SPAN_CASES = {  # name -> (q_len per row, kv_len per row)
    "decode 32x512": ([1] * 32, [512] * 32),
    "prefill 4x256 after 256": ([256] * 4, [512] * 4),
    "prefill 1x512": ([512], [512]),
}
TABLES = ("identity", "shuffled")
SpanCase = Literal[tuple(SPAN_CASES)]
Table = Literal[TABLES]


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What `scripts/bench_attention.py` times (its flags, jaxpipe.config_flags).

    cases: the span cases (SPAN_CASES), comma-separated
    tables: the block tables: identity (row b's blocks in order) or shuffled (scattered)
    block_size: tokens per pool block
    repeats: timed calls of each (the median is kept)
    json_path: write the points here (none: only the table)
    """

    cases: tuple[SpanCase, ...] = tuple(SPAN_CASES)
    tables: tuple[Table, ...] = ("shuffled",)
    block_size: int = 16
    repeats: int = 5
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_names(self, "cases", SPAN_CASES)
        check_names(self, "tables", TABLES)
        check_counts(self, "block_size", "repeats")


def run(config: AttentionBenchConfig) -> list[dict]:
    """One point per (case, table) of `config`, in that order."""
    return [measure_spans(c, *SPAN_CASES[c], config.block_size, t, config.repeats)
            for c in config.cases for t in config.tables]


def measure_spans(name: str, q_len: list[int], kv_len: list[int], block_size: int,
                  table: str, repeats: int, seed: int = 0) -> dict:
    """One step of spans (row r: q_len[r] queries ending at position kv_len[r] - 1, rows laid
    out in q in order): milliseconds per layer for the ragged kernel and the XLA reference."""
    import jax
    import jax.numpy as jnp

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
    t = _interleaved_medians(calls, repeats)
    return {"case": name, "rows": rows, "tokens": tokens, "mean_kv": float(np.mean(kv_len)),
            "table": table, "block_size": block_size, "xla_ms": t["xla"] * 1e3,
            "ragged_ms": t["ragged"] * 1e3, "vs_xla": t["xla"] / t["ragged"]}


def format_spans(points: list[dict]) -> str:
    head = (f"{'case':<24} {'table':>9} {'tokens':>6} {'mean kv':>7} {'XLA ref ms':>10} "
            f"{'ragged ms':>9} {'vs XLA':>7}")
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['case']:<24} {p['table']:>9} {p['tokens']:>6} {p['mean_kv']:>7.0f} "
                     f"{p['xla_ms']:>10.2f} {p['ragged_ms']:>9.2f} {p['vs_xla']:>6.1f}x")
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
