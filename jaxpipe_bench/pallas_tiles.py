"""The Pallas ragged attention kernel's tile sizes swept over decode and prefill shapes
(`scripts/bench_pallas_tiles.py`), on the GPU JAX sees (or interpreted, for a CPU smoke run).

Each point is one shape (decode: `rows` rows of one query each over `context` positions;
prefill: one row's chunk of `chunk` new tokens) and one `pallas_attention.Tiles` (queries per
tile, Triton's warps and stages), timed as the median of `repeats` calls after a compile, with
its result checked against the XLA path (`ragged_attention.reference`, timed too as the peer).
A decode point's GB/s counts the K and V it must read once (rows x context x Hkv x D x 2 x the
pool's item size), so it reads against the device's measured bandwidth; a prefill point also
gives TFLOP/s (4 x H x D per query and key it attends over). The best tiles are chosen per
shape and, over all shapes of a kind, as the tiles whose time is the least geometric mean of
their ratio to each shape's best. The record is rewritten after every point, so a run cut
short by its time limit keeps what it measured.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from jaxpipe.config.checks import check_counts

BLOCK = 16  # tokens per pool block, as the engine's pool


@dataclass(frozen=True)
class SweepConfig:
    """What `scripts/bench_pallas_tiles.py` sweeps (its flags).

    heads, kv_heads, head_dim: the attention's shape (default: the 1.1B Llama of
        scripts/make_checkpoint.py, 32 query heads over 4 kv heads of 64)
    decode_rows: rows of one decode query each
    contexts: positions each decode row attends over
    prefill_chunks: new tokens of one prefill row (a fresh context of that length)
    tq: queries per tile to try (powers of two)
    num_warps: Triton warps per program to try (0: Triton's default)
    num_stages: Triton pipeline stages to try (0: Triton's default)
    repeats: timed calls per point (their median is taken)
    seed: the random queries, pool and block table
    interpret: run the kernel in Pallas' interpreter (a CPU smoke run of the sweep)
    json_path: write the record here (rewritten after every point)
    """

    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 64
    decode_rows: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (128, 512, 2048, 8192)
    prefill_chunks: tuple[int, ...] = (512, 2048)
    tq: tuple[int, ...] = (2, 4, 8, 16, 32)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (0,)
    repeats: int = 10
    seed: int = 0
    interpret: bool = False
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_counts(self, "heads", "kv_heads", "head_dim", "repeats")
        if self.heads % self.kv_heads:
            raise ValueError(f"SweepConfig.heads={self.heads} must be a multiple of kv_heads="
                             f"{self.kv_heads}")
        for name in ("decode_rows", "contexts", "prefill_chunks", "tq"):
            if min(getattr(self, name), default=1) < 1:
                raise ValueError(f"SweepConfig.{name} must be integers >= 1, got "
                                 f"{getattr(self, name)!r}")
        for name in ("num_warps", "num_stages"):
            if not getattr(self, name) or min(getattr(self, name)) < 0:
                raise ValueError(f"SweepConfig.{name} must be one or more integers >= 0 (0: "
                                 f"Triton's default), got {getattr(self, name)!r}")

    def tile_choices(self) -> list:
        """Every Tiles the sweep tries (0 warps or stages: Triton's default)."""
        from jaxpipe.kernels.pallas_attention import Tiles

        return [Tiles(tq, w or None, s or None)
                for tq, w, s in itertools.product(self.tq, self.num_warps, self.num_stages)]


def decode_shapes(cfg: SweepConfig) -> list[dict]:
    """Decode points: every rows x context."""
    return [{"kind": "decode", "rows": r, "q_len": [1] * r, "kv_len": [c] * r, "context": c}
            for r in cfg.decode_rows for c in cfg.contexts]


def prefill_shapes(cfg: SweepConfig) -> list[dict]:
    """Prefill points: one row's fresh chunk of each length."""
    return [{"kind": "prefill", "rows": 1, "q_len": [n], "kv_len": [n], "chunk": n}
            for n in cfg.prefill_chunks]


class Pool:
    """A bf16 pool [1, NB, Hkv, BS, D] big enough for every shape, a shuffled block table over
    it, and random queries, on the default device."""

    def __init__(self, cfg: SweepConfig, shapes: list[dict]):
        import jax.numpy as jnp

        rng = np.random.default_rng(cfg.seed)
        self.max_blocks = max(-(-max(s["kv_len"]) // BLOCK) for s in shapes)  # MB
        self.max_rows = max(s["rows"] for s in shapes)
        num_blocks = self.max_blocks * self.max_rows
        shape = (1, num_blocks, cfg.kv_heads, BLOCK, cfg.head_dim)
        self.k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
        self.v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
        self.table = rng.permutation(num_blocks).astype(np.int32).reshape(self.max_rows, -1)
        self.max_tokens = max(sum(s["q_len"]) for s in shapes)
        self.q = jnp.asarray(rng.standard_normal((self.max_tokens, cfg.heads, cfg.head_dim),
                                                 np.float32))

    def args(self, shape: dict) -> tuple:
        """The kernel's arguments for one shape (rows laid out in q in order)."""
        import jax.numpy as jnp

        q_len, kv_len = shape["q_len"], shape["kv_len"]
        tokens = int(sum(q_len))
        starts = np.cumsum([0, *q_len[:-1]])
        spans = [jnp.asarray(x, jnp.int32) for x in (self.table[:len(q_len)], starts, q_len,
                                                     kv_len)]
        return (self.q[:tokens], self.k, self.v, *spans)


def kv_bytes(cfg: SweepConfig, shape: dict, itemsize: int = 2) -> int:
    """K and V bytes a shape must read once: every row's kv_len positions."""
    return int(sum(shape["kv_len"])) * cfg.kv_heads * cfg.head_dim * 2 * itemsize


def attention_flops(cfg: SweepConfig, shape: dict) -> int:
    """Q.K and P.V multiply-adds x 2 of every query over the keys it attends (causal)."""
    keys = sum(sum(range(kv - q + 1, kv + 1)) for q, kv in zip(shape["q_len"], shape["kv_len"],
                                                                strict=True))
    return 4 * cfg.heads * cfg.head_dim * keys


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall time of `repeats` calls of fn(*args) after one (compiling) call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_point(cfg: SweepConfig, pool: Pool, shape: dict, tiles, want) -> dict:
    """One shape under one Tiles: ms, GB/s, TFLOP/s and the largest difference from `want`
    (the XLA path's output); a failure (lowering, compile, run) is recorded, not raised."""
    import jax

    from jaxpipe.kernels.pallas_attention import pallas_attention

    point = {k: v for k, v in shape.items() if k not in ("q_len", "kv_len")}
    point["tiles"] = asdict(tiles)
    fn = jax.jit(lambda *a: pallas_attention(*a, interpret=cfg.interpret, tiles=tiles))
    args = pool.args(shape)
    try:
        seconds = median_seconds(fn, args, cfg.repeats)
        err = float(np.max(np.abs(np.asarray(fn(*args)) - want)))
    except Exception as e:  # noqa: BLE001 - a tile the backend cannot lower is a result
        return {**point, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {**point, **rates(cfg, shape, seconds), "max_abs_err": err}


def rates(cfg: SweepConfig, shape: dict, seconds: float) -> dict:
    return {"ms": seconds * 1e3, "gbs": kv_bytes(cfg, shape) / seconds / 1e9,
            "tflops": attention_flops(cfg, shape) / seconds / 1e12}


def measure_reference(cfg: SweepConfig, pool: Pool, shape: dict):
    """The XLA path on one shape: its output (the points' reference) and its rates."""
    import jax

    from jaxpipe.kernels.ragged_attention import reference

    max_kv = -(-max(shape["kv_len"]) // BLOCK) * BLOCK
    fn = jax.jit(lambda *a: reference(*a, max_kv=max_kv))
    args = pool.args(shape)
    seconds = median_seconds(fn, args, cfg.repeats)
    return np.asarray(fn(*args)), rates(cfg, shape, seconds)


def best_tiles(points: list[dict], kind: str) -> dict | None:
    """Over one kind's points: the Tiles that ran every shape with the least geometric mean of
    its time over each shape's best time (None if no Tiles ran them all)."""
    ok = [p for p in points if p["kind"] == kind and "ms" in p]
    shapes = {_shape_key(p) for p in points if p["kind"] == kind}
    best = {s: min(p["ms"] for p in ok if _shape_key(p) == s) for s in shapes
            if any(_shape_key(p) == s for p in ok)}
    by_tiles: dict[str, list[float]] = {}
    for p in ok:
        by_tiles.setdefault(json.dumps(p["tiles"], sort_keys=True), []).append(
            p["ms"] / best[_shape_key(p)])
    complete = {t: r for t, r in by_tiles.items() if len(r) == len(shapes)}
    if not complete:
        return None
    tiles, ratios = min(complete.items(), key=lambda kv: _geomean(kv[1]))
    return {"tiles": json.loads(tiles), "geomean_vs_best": _geomean(ratios),
            "worst_vs_best": max(ratios)}


def _shape_key(p: dict) -> tuple:
    return (p["kind"], p["rows"], p.get("context"), p.get("chunk"))


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sweep(cfg: SweepConfig, save=lambda record: None, log=print) -> dict:
    """Every shape x Tiles; `save(record)` after each point."""
    import jax

    from jaxpipe_bench.gpu_check import measured_bandwidth

    shapes = decode_shapes(cfg) + prefill_shapes(cfg)
    pool = Pool(cfg, shapes)
    device = jax.devices()[0]
    record = {"config": asdict(cfg), "device": device.device_kind, "platform": device.platform,
              "jax": jax.__version__, "points": [], "reference": []}
    record["measured_bandwidth_gbs"] = measured_bandwidth(1 << 30 if not cfg.interpret
                                                          else 1 << 22) / 1e9
    for shape in shapes:
        want, ref = measure_reference(cfg, pool, shape)
        key = {k: v for k, v in shape.items() if k not in ("q_len", "kv_len")}
        record["reference"].append({**key, **ref})
        for tiles in cfg.tile_choices():
            point = measure_point(cfg, pool, shape, tiles, want)
            record["points"].append(point)
            log(f"[tiles] {point}")
            record["best"] = {k: best_tiles(record["points"], k) for k in ("decode", "prefill")}
            save(record)
    return record


def format_table(record: dict) -> str:
    """The best Tiles per shape beside the XLA path, and the best per kind."""
    bw = record["measured_bandwidth_gbs"]
    head = (f"{'shape':<22} {'best tiles (tq/warps/stages)':<29} {'ms':>8} {'GB/s':>8} "
            f"{'of HBM':>7} {'TFLOP/s':>8} {'XLA ms':>8}")
    lines = [f"{record['device']} ({record['platform']}), jax {record['jax']}, measured "
             f"bandwidth {bw:.0f} GB/s", head, "-" * len(head)]
    for ref in record["reference"]:
        ran = [p for p in record["points"] if _shape_key(p) == _shape_key(ref) and "ms" in p]
        name = (f"decode {ref['rows']}x{ref['context']}" if ref["kind"] == "decode"
                else f"prefill chunk {ref['chunk']}")
        if not ran:
            lines.append(f"{name:<22} every tile failed")
            continue
        p = min(ran, key=lambda x: x["ms"])
        t = p["tiles"]
        cut = f"{t['tq']}/{t['num_warps'] or '-'}/{t['num_stages'] or '-'}"
        lines.append(f"{name:<22} {cut:<29} "
                     f"{p['ms']:>8.3f} {p['gbs']:>8.1f} {p['gbs'] / bw:>7.0%} "
                     f"{p['tflops']:>8.2f} {ref['ms']:>8.3f}")
    for kind, best in record.get("best", {}).items():
        lines.append(f"best {kind}: {best}")
    failed = [p for p in record["points"] if "error" in p]
    if failed:
        lines.append(f"{len(failed)} points failed; first: {failed[0]['error']}")
    return "\n".join(lines)


def run(cfg: SweepConfig, log=print) -> dict:
    """`sweep`, the record written to `cfg.json_path` after every point, its table printed."""
    record = sweep(cfg, (lambda r: write(r, cfg.json_path)) if cfg.json_path else
                   (lambda r: None), log)
    log(format_table(record))
    return record


def write(record: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
