"""Which implementation runs each of the step's matmuls, and its attention, on this machine:
every candidate the machine can run is timed on the model's own shapes, once per machine, and
the fastest is used. A CPU flag only says which candidates exist (`matmul.paths()`: the
kernel's paths compiled for this CPU); it never picks one.

Matmul candidates, for a bf16 weight [K, N] (one device's shard) and a number of rows M:
"xla" (XLA's dot on the weight in natural order, sliced from the stacked layers as the step
does) and each kernel path (`kernels/matmul.py`, the weight in panel order). A weight is
stored in one order, so its order is chosen first: the order whose best candidate is the
lesser factor behind the fastest over the measured row counts (the geometric mean, so that
each row count counts alike); each row count then runs the fastest
candidate that reads that order. An int8 weight (`quantization="int8"`, `Matmul.quant`) is
offered the same way, at the same row counts: "xla" (XLA's int8 dot, `kernels/int8.py`, on
the codes in natural order) and each path of the int8 kernel (`kernels/int8_matmul.py`, codes
in int8 panel order), rows quantized per token inside every candidate. A weight kept in
GGUF's quantized blocks (`quantization="gguf"`, `Matmul.quant` the format: "q4_1", "q8_0",
"q4_0", "q4_k", "q6_k") is offered "xla" (`kernels/gguf_blocks.py`'s reference) and each
path of the GGUF kernel (`kernels/gguf_matmul.py`); both read the file's block order, so
there is no order to choose, only the fastest at each row count. A step of T tokens
uses the choice measured at the smallest measured row count >= T (the largest past them).
Attention candidates: "kernel" (the C++ ragged-span kernel, which also writes the step's
K/V) and "xla" (its jnp reference), timed on a decode and a prefill step of the model's
heads; the lower sum wins. MoE experts
(`model/moe.py`) candidates: "dense" (every expert on every token, XLA's dots) and "grouped"
(the C++ grouped kernel on the kernel's default path, `matmul.grouped_matmul`), timed at a few
token counts of the model's expert shapes (`EXPERT_TOKENS`: rows per expert T * k / X from
well under one, decode, to many, prefill), on a stack of layers read at a traced layer index
as the step reads them (grouped in place, dense on a slice); a step takes the choice at the
nearest count at or above its own tokens. XLA's `ragged_dot` is not a candidate on CPU: it
lowers to k times the dense path's FLOPs there (`scripts/bench_moe_kernel.py` times all
three).

Timings are cached in `~/.cache/jaxpipe/kernel_choice/` under a key of the CPU model, its flags,
jaxlib's version and the kernels' sources; a new entry is measured the first time an engine
needs it (a few seconds per weight shape). `python -m jaxpipe.runtime.kernel_choice` prints the
table for a model. `EngineConfig.matmul` names one implementation for every matmul instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxpipe.config.cache_dir import cache_dir
from jaxpipe.config.engine import EngineConfig
from jaxpipe.kernels import gguf_blocks, gguf_matmul, int8, int8_matmul, matmul, ragged_attention
from jaxpipe.kernels.build import cpu_flags
from jaxpipe.kernels.paged import to_storage
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.model import moe
from jaxpipe.model.loading import source_config
from jaxpipe.model.presets import resolve_model
from jaxpipe.runtime import memory

XLA = "xla"
ROWS = (1, 8, 32, 64, 128, 256, 512, 2048)  # the row counts each matmul is timed at
HEAD_ROWS = (1, 8, 32, 64, 128, 256)  # the LM head's (it runs on the sampled rows only)
PRUNE_FACTOR = 10  # `beaten`: how much slower than the fastest, twice, drops a candidate
EXPERT_TOKENS = (1, 8, 64, 256)  # the token counts each MoE layer's experts are timed at
PANEL_ORDER, NATURAL_ORDER = "panel", "natural"
# A weight's storage: bf16, dynamic W8A8 int8 codes + scales, or a GGUF block format.
QUANTS = ("none", "int8", *gguf_blocks.FORMATS)


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One weight's multiplication as a device runs it: its shard [K, N] (`gated`: N holds
    the gate and up halves and the product is silu(gate) * up), stored as `quant` ("none":
    bf16; "int8": int8 codes with a scale per column, rows quantized per token; a GGUF
    format such as "q4_1": the file's blocks, rows quantized per block as llama.cpp does)."""

    name: str
    k: int
    n: int
    gated: bool = False
    quant: str = "none"

    def __post_init__(self):
        if self.quant not in QUANTS:
            raise ValueError(f"Matmul.quant must be one of {', '.join(QUANTS)}; got "
                             f"{self.quant!r}")

    def key(self) -> str:
        quant = "" if self.quant == "none" else f":{self.quant}"
        return f"{self.name}:{self.k}x{self.n}{':gated' if self.gated else ''}{quant}"


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A step's attention as the timing runs it: `rows` sequences of `q_len` new tokens
    after `context` tokens each, H query heads over Hkv kv heads of head_dim D."""

    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    q_len: int
    context: int

    def key(self) -> str:
        return (f"attention:{self.heads}/{self.kv_heads}x{self.head_dim}:"
                f"{self.rows}x{self.q_len}@{self.context}")


@dataclasses.dataclass(frozen=True)
class ExpertsCase:
    """An MoE layer's experts on one device: X `experts` of hidden E -> gated `inter` F ->
    E, each token to `k` of them, bf16 weights."""

    experts: int
    k: int
    hidden: int
    inter: int

    def key(self) -> str:
        return f"experts:{self.experts}x{self.hidden}x{self.inter}:top{self.k}"


def candidates(quant: str = "none") -> tuple[str, ...]:
    """The matmul implementations this machine can run for a weight stored as `quant`: XLA's
    dot and the paths of that weight's kernel (bf16's, the int8 kernel's or the GGUF one's)."""
    if quant in gguf_blocks.FORMATS:
        return (XLA, *gguf_matmul.paths())
    return (XLA, *(int8_matmul.paths() if quant == "int8" else matmul.paths()))


def order_of(impl: str, quant: str = "none") -> str:
    """The weight order an implementation reads (GGUF blocks: the file's, for every one)."""
    return NATURAL_ORDER if impl == XLA or quant in gguf_blocks.FORMATS else PANEL_ORDER


def nearest_rows(rows: int, measured: Iterable[int] = ROWS) -> int:
    """The measured row count whose choice a matmul of `rows` rows takes: the smallest >= rows,
    else the largest."""
    measured = sorted(measured)
    return next((m for m in measured if m >= rows), measured[-1])


def choose_order(seconds: dict[int, dict[str, float]], quant: str = "none") -> str:
    """A weight's order from its timings {rows: {impl: seconds}}: the order whose best
    implementation is the lesser factor slower than the fastest candidate over the row counts
    (the geometric mean of those factors; natural on a tie).
    Each row count weighs alike whatever its size, since a step of each runs: a sum of
    seconds let 2048 rows decide alone, and on an AMX Xeon kept XLA's order (with a layer
    copy a step) where the kernel is 1.3-10x faster at the 1-64 rows of decode steps."""
    def log_slowdown(order: str) -> float:
        total = 0.0
        for by_impl in seconds.values():
            own = min((s for i, s in by_impl.items() if order_of(i, quant) == order),
                      default=np.inf)
            total += float(np.log(own / min(by_impl.values())))
        return total

    return PANEL_ORDER if log_slowdown(PANEL_ORDER) < log_slowdown(NATURAL_ORDER) \
        else NATURAL_ORDER


def beaten(table: dict[str, dict[str, float]], quant: str = "none") -> frozenset[str]:
    """The candidates not worth timing at the next row count, from `table` {rows: {impl:
    seconds}} at the row counts before it (ascending): those that took more than PRUNE_FACTOR
    times the fastest at each of the last two (a kernel's portable GGUF path runs 10-100x the
    vector paths at every row count, 0.9 s a call at 2048 rows). XLA's fixed cost per call
    makes it up to 8x the kernels at 1 and 8 rows and close at 2048, hence two counts and 10x;
    and the fastest of each weight order is always timed, so both orders keep a time at
    every row count."""
    slow: dict[str, int] = {}  # impl -> row counts in a row it lost by PRUNE_FACTOR (or skipped)
    for by_impl in table.values():
        fastest, own_best = min(by_impl.values()), {}
        for i, s in by_impl.items():
            own_best[order_of(i, quant)] = min(s, own_best.get(order_of(i, quant), np.inf))
        slow |= {i: slow.get(i, 0) + 1 if s > PRUNE_FACTOR * fastest
                 and s > own_best[order_of(i, quant)] else 0 for i, s in by_impl.items()}
    return frozenset(i for i, n in slow.items() if n >= 2)


def choose_impl(by_impl: dict[str, float], order: str, quant: str = "none") -> str:
    """The fastest implementation reading `order` among timings {impl: seconds}."""
    usable = {i: s for i, s in by_impl.items() if order_of(i, quant) == order}
    if not usable:
        raise ValueError(f"no implementation reading the {order} order was timed: {by_impl}")
    return min(usable, key=usable.get)


class KernelChoice:
    """The measured choices for one machine (`table`), or one forced implementation.

    `force`: None (measure), "xla", or a kernel path of `matmul.paths()` or
    `int8_matmul.paths()` or `gguf_matmul.paths()`; it applies to the weights whose kernel
    has it ("xla" to all),
    the others are measured. Timings come from `timings` (injected: tests) or are measured
    and cached as shapes are asked for."""

    def __init__(self, force: str | None = None, timings: dict[str, dict] | None = None,
                 cache: Path | None = None):
        if force is not None:  # (only then: listing the int8 paths builds that kernel)
            every = dict.fromkeys((*candidates(), *candidates("int8"), *candidates("q4_1")))
            if force not in every:
                raise ValueError(f"matmul={force!r} cannot run here; this machine has "
                                 f"{', '.join(every)}")
        self.force = force
        self.cache = cache if timings is None else None
        self.timings: dict[str, dict] = dict(timings or {})
        if self.cache is not None and self.cache.is_file():
            self.timings.update(json.loads(self.cache.read_text()).get("timings", {}))

    # -- matmuls -----------------------------------------------------------------------------

    def seconds(self, mm: Matmul) -> dict[int, dict[str, float]]:
        """{rows: {impl: seconds}} of `mm`, measuring (and caching) it the first time."""
        if mm.key() not in self.timings:
            rows = HEAD_ROWS if mm.name == "lm_head" else ROWS
            timer = {"none": time_matmul, "int8": time_int8_matmul}.get(mm.quant,
                                                                        time_gguf_matmul)
            table: dict[str, dict[str, float]] = {}
            for m in rows:  # ascending: what lost badly at fewer rows is not timed at more
                table[str(m)] = timer(mm, m, skip=beaten(table, mm.quant))
            self._record(mm.key(), table)
        return {int(m): by_impl for m, by_impl in self.timings[mm.key()].items()}

    def order(self, mm: Matmul) -> str:
        """The order `mm`'s weight is kept in."""
        if self.forced(mm) is not None:
            return order_of(self.forced(mm), mm.quant)
        return choose_order(self.seconds(mm), mm.quant)

    def impl(self, mm: Matmul, rows: int) -> str:
        """The implementation a call of `rows` rows runs (one reading `order(mm)`)."""
        if self.forced(mm) is not None:
            return self.forced(mm)
        seconds = self.seconds(mm)
        return choose_impl(seconds[nearest_rows(rows, seconds)], self.order(mm), mm.quant)

    def forced(self, mm: Matmul) -> str | None:
        """The forced implementation where `mm`'s kernel has it (None: measured)."""
        if self.force is None or self.force not in candidates(mm.quant):
            return None
        return self.force

    # -- attention ---------------------------------------------------------------------------

    def attention(self, cases: Iterable[AttentionCase], kv_dtype) -> str:
        """"kernel" or "xla": the lower total time over `cases` (decode and prefill steps)."""
        totals = {"kernel": 0.0, XLA: 0.0}
        for case in cases:
            key = f"{case.key()}:{jnp.dtype(kv_dtype).name}"
            if key not in self.timings:
                self._record(key, time_attention(case, kv_dtype))
            for impl, s in self.timings[key].items():
                totals[impl] += s
        return min(totals, key=totals.get)

    # -- MoE experts ------------------------------------------------------------------------

    def experts(self, case: ExpertsCase, tokens: int) -> str:
        """"dense" or "grouped" for a step of `tokens` tokens: the faster at the nearest
        measured token count (measured and cached the first time). A forced "xla" is dense,
        a forced kernel path grouped."""
        if self.force is not None:
            return "dense" if self.force == XLA else "grouped"
        if case.key() not in self.timings:
            self._record(case.key(), {str(t): time_experts(case, t) for t in EXPERT_TOKENS})
        by_tokens = {int(t): s for t, s in self.timings[case.key()].items()}
        seconds = by_tokens[nearest_rows(tokens, by_tokens)]
        return min(seconds, key=seconds.get)

    # -- the table ---------------------------------------------------------------------------

    def rows(self, matmuls: Iterable[Matmul]) -> list[dict]:
        """One record per (matmul, measured row count): GFLOP/s of each candidate, the
        order and the choice."""
        out = []
        for mm in matmuls:
            order = self.order(mm)
            for m, by_impl in sorted(self.seconds(mm).items()):
                flops = 2.0 * m * mm.k * mm.n
                out.append({"matmul": mm.key(), "rows": m, "order": order,
                            "chosen": self.impl(mm, m),
                            "gflops": {i: flops / s / 1e9 for i, s in by_impl.items()}})
        return out

    def _record(self, key: str, timings: dict) -> None:
        """Keep (and cache) a new measurement, and give what its inputs took back to the OS:
        malloc keeps most of it otherwise (the timings' buffers are freed, not returned), and
        an engine's first start on a machine peaked up to 0.3 GB over one with the timings
        cached (tests/runtime/test_memory.py's figures)."""
        self.timings[key] = timings
        self._save()
        memory.release_freed_memory()

    def _save(self) -> None:
        if self.cache is None:
            return
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": machine(), "timings": self.timings}, indent=1))
        tmp.replace(self.cache)


def format_table(records: list[dict]) -> str:
    """The kernel choices as a fixed-width table (GFLOP/s of each candidate)."""
    impls = sorted({i for r in records for i in r["gflops"]}, key=lambda i: (i != XLA, i))
    head = f"{'matmul [K x N]':<28} {'rows':>5} " + " ".join(f"{i:>12}" for i in impls)
    lines = [head + f" {'order':>8} {'chosen':>12}", "-" * (len(head) + 22)]
    for r in records:
        cells = " ".join(f"{r['gflops'].get(i, float('nan')):>12.1f}" for i in impls)
        lines.append(f"{r['matmul']:<28} {r['rows']:>5} {cells} {r['order']:>8} "
                     f"{r['chosen']:>12}")
    return "\n".join(lines)


# -- the machine and its cache ---------------------------------------------------------------


def machine() -> dict:
    """What the timings depend on: the CPU (model and flags), jaxlib, the kernels' sources."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor())
    sources = b"".join(p.read_bytes() for p in (matmul.SOURCE, int8_matmul.SOURCE,
                                                 gguf_matmul.SOURCE, ragged_attention.SOURCE))
    return {"cpu": model, "isa": isa(), "jaxlib": jaxlib.__version__,
            "flags": hashlib.sha256(cpu_flags().encode()).hexdigest()[:12],
            "kernels": hashlib.sha256(sources).hexdigest()[:12]}


def isa() -> list[str]:
    """The matmul-relevant ISA extensions the CPU reports (what a benchmark names)."""
    flags = set(cpu_flags().split())
    return [f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni",
                        "avx512f", "avx2", "fma") if f in flags]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cache_path() -> Path:
    """This machine's timings file."""
    key = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir("kernel_choice") / f"{key}.json"


def experts_path(tokens: int, k: int, w_gate_up, w_down,
                     chosen: KernelChoice | None = None) -> str:
    """The MoE experts' path for a step (`moe.experts_mlp`'s chooser, called at trace
    time): "grouped" or "dense", this machine's faster for T = `tokens` tokens on these
    shapes (timed once per machine at a few token counts and cached; a step takes the choice
    of the nearest count at or above its own); dense where the grouped kernel cannot run;
    the platform's default (`moe.EXPERTS_PATH`) off CPU or where it names one path.
    `chosen`: the engine's kernel choice (None: `for_machine()`), whose forced matmul
    (EngineConfig.matmul) decides: "xla" dense, a kernel path grouped. Across processes
    (multi-host) every process must trace the same program while each would time on its
    own: there, unforced, grouped, faster at every point `model/moe.py`'s docstring lists."""

    default = moe.experts_path_for(jax.default_backend())
    if default != "measured":  # not CPU, or one path set for every step
        return default
    if not moe.grouped_fits(w_gate_up, w_down):
        return "dense"
    chosen = chosen or for_machine()
    if chosen.force is None and jax.process_count() > 1:
        return "grouped"
    x, e, _, f = w_gate_up.shape
    case = ExpertsCase(experts=x, k=k, hidden=e, inter=f)
    with jax.ensure_compile_time_eval():  # a first measurement runs now, not in the trace
        return chosen.experts(case, tokens)


@functools.cache
def for_machine(force: str | None = None) -> KernelChoice:
    """The process's kernel choice: this machine's cached timings, measured as needed."""
    return KernelChoice(force, cache=cache_path())


# -- timing ----------------------------------------------------------------------------------


def _seconds(fn, *args, min_seconds: float = 0.01, repeats: int = 3) -> float:
    """The fastest of `repeats` timings of `fn(*args)`, after a first call that compiles;
    each timing runs enough calls to last `min_seconds`. The minimum, since what slows a run
    on a shared machine is other work. Refused inside a trace (a jit being traced), where
    `fn` would only be staged and the timings would measure the tracing."""
    out = fn(*args)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((out, args))):
        raise RuntimeError("kernel_choice: a kernel timing was asked for inside a trace; "
                           "measure before tracing the step (KernelChoice.seconds)")
    jax.block_until_ready(out)
    best, inner = np.inf, 1
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / inner
        best, inner = min(best, seconds), max(1, int(min_seconds / max(seconds, 1e-6)))
    return float(best)


def _normal(shape: tuple[int, ...], dtype=np.float32, seed: int = 0,
            scale: float = 1.0, chunk: int = 1 << 22) -> jax.Array:
    """Seeded standard-normal timing inputs times `scale` in `dtype`, drawn as float32 a
    chunk at a time into the array: NumPy's float64 draw of an LM head's two-layer stack (the
    default model's) was 0.45 GB on top of an engine's start on a machine with no timings
    cached yet, and XLA's random draw takes several times its output."""
    rng = np.random.default_rng(seed)
    out = np.empty(shape, jnp.dtype(dtype))
    flat = out.reshape(-1)
    for i in range(0, flat.size, chunk):
        n = min(chunk, flat.size - i)
        flat[i:i + n] = rng.standard_normal(n, np.float32) * np.float32(scale)
    return jnp.asarray(out)


def time_matmul(mm: Matmul, rows: int, layers: int = 2,
                skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Seconds per call of each candidate for `mm` at `rows` rows (but those in `skip`), on a
    stack of `layers` weights read at a traced layer index, as the step reads them."""
    w = _normal((layers, mm.k, mm.n), jnp.bfloat16)
    x = _normal((rows, mm.k), seed=1)
    layer = jnp.int32(layers - 1)

    def xla(x, w, layer):
        w_l = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
        return (matmul.gated_reference if mm.gated else matmul.reference)(x, w_l)

    out = {} if XLA in skip else {XLA: _seconds(jax.jit(xla), x, w, layer)}
    packed = jax.jit(matmul.pack)(w)  # one copy; eager, each reshape and transpose was one
    del w
    for path in _timed(matmul.paths(), skip):
        fn = jax.jit(functools.partial(matmul.bf16_matmul, gated=mm.gated, path=path))
        out[path] = _seconds(fn, x, packed, layer)
    return out


def _timed(paths: Iterable[str], skip: frozenset[str]) -> list[str]:
    return [p for p in paths if p not in skip]


def time_int8_matmul(mm: Matmul, rows: int, layers: int = 2,
                     skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Seconds per call of each int8 candidate (but those in `skip`) for `mm` at `rows` rows
    (x f32, quantized per row inside the call), on a stack of `layers` int8 weights read at a
    traced layer index as the step reads them: XLA's int8 dot on the sliced codes (natural
    order), each int8 kernel path on the stack in place (panel order). Gated: silu(gate) * up
    after XLA's, in the kernel (`gated=True`) for its paths."""
    codes, scales = int8.quantize_weight(_normal((layers, mm.k, mm.n)))
    x = _normal((rows, mm.k), seed=1)
    layer = jnp.int32(layers - 1)
    def xla(x, w, s, layer):
        pick = functools.partial(jax.lax.dynamic_index_in_dim, index=layer, keepdims=False)
        dot = int8_matmul.gated_reference if mm.gated else int8.reference
        return dot(x, pick(w), pick(s))

    def kernel(x, w, s, layer, path):
        return int8_matmul.int8_matmul(x, w, s, layer, gated=mm.gated, path=path)

    out = {} if XLA in skip else {XLA: _seconds(jax.jit(xla), x, codes, scales, layer)}
    packed = jax.jit(int8_matmul.pack)(codes)
    del codes
    for path in _timed(int8_matmul.paths(), skip):
        out[path] = _seconds(jax.jit(functools.partial(kernel, path=path)), x, packed, scales,
                             layer)
    return out


def time_gguf_matmul(mm: Matmul, rows: int, layers: int = 2,
                     skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Seconds per call of each GGUF candidate (but those in `skip`) for `mm` (its format
    `mm.quant`) at `rows` rows (x f32, quantized per block inside the call), on a stack of
    `layers` weights in GGUF rows [layers, N, R] read at a traced layer index as the step
    reads them: XLA's reference on the sliced rows, each kernel path on the stack in place.
    Gated: silu(gate) * up after the product, in XLA, for every candidate (the kernel has no
    gated mode)."""
    fmt = gguf_blocks.format_of(mm.quant)
    w = jnp.asarray(gguf_blocks.random_blocks(fmt, (layers, mm.n, mm.k)))
    x = _normal((rows, mm.k), seed=1)
    layer = jnp.int32(layers - 1)

    def gate(y):
        return matmul.silu_gate(y) if mm.gated else y

    def xla(x, w, layer):
        return gate(gguf_blocks.reference(x, jax.lax.dynamic_index_in_dim(w, layer, 0, False),
                                          fmt))

    def kernel(x, w, layer, path):
        return gate(gguf_matmul.gguf_matmul(x, w, fmt.name, layer, path=path))

    out = {} if XLA in skip else {XLA: _seconds(jax.jit(xla), x, w, layer)}
    for path in _timed(gguf_matmul.paths(), skip):
        out[path] = _seconds(jax.jit(functools.partial(kernel, path=path)), x, w, layer)
    return out


def time_experts(case: ExpertsCase, tokens: int, layers: int = 2) -> dict[str, float]:
    """Seconds per call of `moe.experts_mlp` on the "dense" and "grouped" paths for
    `tokens` tokens routed by a random router (bf16 weights), on a stack of `layers` layers'
    experts read at a traced layer index, as the step reads them (`matmul.StackedWeight`:
    grouped reads it in place, dense slices it)."""

    c = case
    h = _normal((tokens, c.hidden))
    router = _normal((c.hidden, c.experts), seed=1)
    gate_up = _normal((layers, c.experts, c.hidden, 2, c.inter), jnp.bfloat16, 2,
                      c.hidden ** -0.5)
    down = _normal((layers, c.experts, c.inter, c.hidden), jnp.bfloat16, 3, c.inter ** -0.5)
    weights, experts = moe.route(h, router, c.k, True)
    layer = jnp.int32(layers - 1)

    def run(h, weights, experts, gate_up, down, layer, path):
        return moe.experts_mlp(h, weights, experts, matmul.StackedWeight(gate_up, layer),
                               matmul.StackedWeight(down, layer), path)

    return {d: _seconds(jax.jit(functools.partial(run, path=d)), h, weights, experts,
                        gate_up, down, layer) for d in ("dense", "grouped")}


def time_attention(case: AttentionCase, kv_dtype) -> dict[str, float]:
    """Seconds per call of the kernel (`write_and_attend`) and the XLA reference for one
    step of `case` (each row's keys in its own blocks of the pool)."""

    c = case
    per_row = -(-(c.context + c.q_len) // BLOCK)
    tokens = c.rows * c.q_len
    pool_shape = (1, c.rows * per_row, c.kv_heads, BLOCK, c.head_dim)
    zeros = jnp.zeros(pool_shape, jnp.float32)
    k = to_storage(_normal(pool_shape), zeros.astype(kv_dtype))
    v = to_storage(_normal(pool_shape, seed=1), zeros.astype(kv_dtype))
    q = _normal((tokens, c.heads, c.head_dim), seed=2)
    kv = _normal((tokens, 2, c.kv_heads, c.head_dim), seed=3)
    angles = jnp.asarray(np.random.default_rng(4).uniform(size=(tokens, c.head_dim // 2)),
                         jnp.float32)
    table = jnp.arange(c.rows * per_row, dtype=jnp.int32).reshape(c.rows, per_row)
    q_start = jnp.arange(c.rows, dtype=jnp.int32) * c.q_len
    q_len = jnp.full((c.rows,), c.q_len, jnp.int32)
    kv_len = jnp.full((c.rows,), c.context + c.q_len, jnp.int32)
    args = (q, kv, jnp.cos(angles), jnp.sin(angles), k, v, table, q_start, q_len, kv_len)
    ref = functools.partial(ragged_attention.write_and_attend_reference,
                            max_kv=per_row * BLOCK)
    out = {XLA: _seconds(jax.jit(ref), *args)}
    if ragged_attention.available():
        out["kernel"] = _seconds(jax.jit(ragged_attention.write_and_attend), *args)
    return out


def main() -> None:
    """Print the kernel choices' table for a model preset's shapes on one device."""


    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--quant", choices=QUANTS, default="none",
                   help="the weights' storage: bf16 (none), int8 (W8A8), a GGUF format")
    args = p.parse_args()
    cfg = source_config(resolve_model(args.model))
    d = for_machine()
    print(f"{machine()}\n{format_table(d.rows(model_matmuls(cfg, quant=args.quant)))}")


def model_matmuls(cfg, tp: int = 1, quant: str = "none") -> list[Matmul]:
    """The step's matmuls of a model on one device of a tp-way split (unpadded shapes; no
    dense MLP's for an MoE model without a shared expert, whose experts are XLA's), its
    weights stored as `quant`."""
    e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    f, v = cfg.mlp_width, cfg.vocab_size
    mm = functools.partial(Matmul, quant=quant)
    mlp = [mm("w_gate_up", e, 2 * f // tp, gated=True), mm("w_down", f // tp, e)]
    return [mm("wq", e, h * d // tp), mm("wkv", e, 2 * kv * d // tp),
            mm("wo", h * d // tp, e), *(mlp if f else []), mm("lm_head", e, v // tp)]


if __name__ == "__main__":
    main()
