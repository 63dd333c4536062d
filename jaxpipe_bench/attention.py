"""The ragged-span attention kernel against the XLA path, per layer, on a model's head shapes.

`measure_spans` times the C++ kernel (`kernels.ragged_attention`) on one step of spans
(decode: one query per row; prefill: chunks of queries) on its default path, on each kernel
path asked for by name (`paths`: e.g. "portable", what a windowed call on a bf16 pool ran
before the avx512_bf16 path took windows, against "avx512_bf16"), and its jnp `reference`
(each token gathers its row's positions through the table; `xla=False` leaves it out: it
gathers [T, Hkv, MB * BS, D] f32 per K and V), all on the same bf16 (u16) pool, block table
(`identity`: row b's blocks are b*MB..(b+1)*MB-1; `shuffled`: scattered over the pool) and
data, one layer, with a sliding `window` (0: none). Medians of calls timed in turns, same
process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np

from jaxpipe.config.checks import check_counts
from jaxpipe_bench.cli import check_names

HEADS = {  # name -> (query heads, kv heads, head dim)
    "smollm2": (9, 3, 64),  # SmolLM2-135M
    "mistral": (32, 8, 128),  # Mistral-7B
    "gemma": (8, 4, 256),  # Gemma 2 2B, Gemma 3 4B
}


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
    "decode 64x2048": ([1] * 64, [2048] * 64),
    "decode 256x2048": ([1] * 256, [2048] * 256),
    "prefill 1x512 after 1536": ([512], [2048]),
}


TABLES = ("identity", "shuffled")
KV_DTYPES = ("bf16", "int8")
SpanCase = Literal[tuple(SPAN_CASES)]
Table = Literal[TABLES]
HeadShapes = Literal[tuple(HEADS)]


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What `scripts/bench_attention.py` times (its flags, jaxpipe.config.flags).

    cases: the span cases (SPAN_CASES), comma-separated
    tables: the block tables: identity (row b's blocks in order) or shuffled (scattered)
    block_size: tokens per pool block
    heads: the model whose head shapes to use (HEADS)
    windows: sliding windows to time (0: none)
    paths: kernel paths to time by name as well (e.g. portable,avx512_bf16)
    kv_dtypes: the pools' dtypes, each timed in turn: bf16, int8 (`kv_cache_dtype="int8"`: the
      same values quantized, kernels/kv_int8.py)
    xla: time the XLA reference too (its gather needs [T, Hkv, MB*BS, D] f32 per K and V)
    repeats: timed calls of each (the median is kept)
    json_path: write the points here (none: only the table)
    """

    cases: tuple[SpanCase, ...] = tuple(SPAN_CASES)[:3]
    tables: tuple[Table, ...] = ("shuffled",)
    block_size: int = 16
    heads: HeadShapes = "smollm2"
    windows: tuple[int, ...] = (0,)
    paths: tuple[str, ...] = ()
    kv_dtypes: tuple[str, ...] = ("bf16",)
    xla: bool = True
    repeats: int = 5
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_names(self, "cases", SPAN_CASES)
        check_names(self, "tables", TABLES)
        check_names(self, "kv_dtypes", KV_DTYPES)
        check_counts(self, "block_size", "repeats")
        if not self.windows or min(self.windows) < 0:
            raise ValueError(f"AttentionBenchConfig.windows must be one or more integers >= 0 "
                             f"(0: none), got {self.windows!r}")


def run(config: AttentionBenchConfig) -> list[dict]:
    """One point per (case, table, window, kv dtype) of `config`, in that order."""
    return [measure_spans(c, *SPAN_CASES[c], config.block_size, t, config.repeats,
                          window=w, heads=config.heads, paths=config.paths, xla=config.xla,
                          kv_dtype=d)
            for c in config.cases for t in config.tables for w in config.windows
            for d in config.kv_dtypes]


def measure_spans(name: str, q_len: list[int], kv_len: list[int], block_size: int = 16,
                  table: str = "shuffled", repeats: int = 5, seed: int = 0, window: int = 0,
                  heads: str = "smollm2", paths: tuple[str, ...] = (),
                  xla: bool = True, kv_dtype: str = "bf16") -> dict:
    """One step of spans (row r: q_len[r] queries ending at position kv_len[r] - 1, rows laid
    out in q in order) over the last `window` keys of each query (0: all), with `heads`'
    shapes (a key of HEADS), on a `kv_dtype` pool (KV_DTYPES): milliseconds per layer of the
    kernel ("ragged": its default path; each of `paths` by name) and of the XLA reference (if
    `xla`)."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.kernels import kv_int8
    from jaxpipe.kernels import ragged_attention as ra

    num_heads, kv_heads, head_dim = HEADS[heads]
    rng = np.random.default_rng(seed)
    rows, tokens = len(q_len), int(sum(q_len))
    blocks = block_table(rows, -(-max(kv_len) // block_size), table, rng)  # [R, MB]
    pool = (blocks.size, kv_heads, block_size, head_dim)  # [NB, Hkv, BS, D]
    k, v = (jnp.asarray(rng.integers(0x3c00, 0x3f80, pool, dtype=np.uint16)) for _ in "kv")
    if kv_dtype == "int8":
        k, v = (kv_int8.quantize(jax.lax.bitcast_convert_type(x, jnp.bfloat16)) for x in (k, v))
    q = jnp.asarray(rng.normal(size=(tokens, num_heads, head_dim)), jnp.float32)
    spans = [jnp.asarray(x, jnp.int32) for x in (blocks, np.cumsum([0, *q_len[:-1]]), q_len,
                                                  kv_len)]
    args = (q, k, v, *spans, jnp.int32(0), jnp.int32(window))

    def call(fn):  # window traced, as the step passes it
        return jax.jit(lambda *a: fn(*a[:-1], window=a[-1])), args

    calls = {"ragged": call(ra.ragged_attention)}
    calls |= {p: call(partial(ra.ragged_attention, path=p)) for p in paths}
    if xla:
        calls["xla"] = call(ra.reference)
    t = _interleaved_medians(calls, repeats)
    return {"case": name, "heads": heads, "kv": kv_dtype, "window": window, "rows": rows,
            "tokens": tokens,
            "mean_kv": float(np.mean(kv_len)), "table": table, "block_size": block_size,
            "path": ra.path_for(k.dtype, head_dim), "ms": {c: s * 1e3 for c, s in t.items()}}


def format_spans(points: list[dict]) -> str:
    """The points as a table: milliseconds per layer of each timed call, and the default
    path's speedup over the slowest of them."""
    calls = list(dict.fromkeys(c for p in points for c in p["ms"]))
    head = (f"{'case':<26} {'heads':>8} {'kv':>4} {'window':>6} {'table':>9} {'tokens':>6} "
            f"{'mean kv':>7} " + " ".join(f"{c + ' ms':>15}" for c in calls)
            + f" {'vs slowest':>10}")
    lines = [head, "-" * len(head)]
    for p in points:
        ms = p["ms"]
        cells = " ".join(f"{ms[c]:>15.2f}" if c in ms else f"{'-':>15}" for c in calls)
        lines.append(f"{p['case']:<26} {p['heads']:>8} {p['kv']:>4} {p['window']:>6} "
                     f"{p['table']:>9} "
                     f"{p['tokens']:>6} {p['mean_kv']:>7.0f} {cells} "
                     f"{max(ms.values()) / ms['ragged']:>9.2f}x")
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
