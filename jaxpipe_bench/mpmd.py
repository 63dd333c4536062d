"""The flowing pipeline two ways (issue 48's design choice, `scripts/bench_mpmd.py`):

  - "spmd", design (b), the engine's: the engine's own tick program
    (`pipeline.tick_program`, what its Runner dispatches) over the whole [pp, tp] mesh: every
    stage runs its slot's micro-batch, then `lax.ppermute` moves the activations one stage on
    into a donated [pp, T, E] buffer carried to the next tick. Every slot is padded to the
    largest micro-batch in flight (T tokens, R rows).
  - "mpmd", design (a): one jitted program per stage on its own sub-mesh of tp devices,
    holding only that stage's layers and KV; a tick dispatches the pp stage programs in
    pipeline order (stage s on micro-batch k - s), each on its micro-batch's own size, and
    hands each output to the next stage's devices with `jax.device_put`, all asynchronous:
    the host blocks only after the timed ticks.

Both run the engine's own stage (`pipeline.stage_layers`: `decoder.layer` with the paged
attention, the tp psum inside a stage) on the same padded weights (`sharding.pad_values`),
the same KV pools and the same per-micro-batch inputs (`step_inputs.build`, passed as NumPy
on every call, as `Ticks._tick` does), so they compute the same activations (`agreement`)
and the timings compare equal work. The embedding: spmd's tick embeds the entering tokens
(a gather of T rows, as the engine's does); mpmd's first stage starts from those
activations, precomputed and resident. Left out of both: the LM head and sampling.

Every micro-batch is decode: T rows of one token at position `context - 1` (each row's table
covers `context` keys). A case names the sizes of the micro-batches as they enter, cycling:
"16/128" alternates 16 and 128 tokens, which spmd runs as ticks of 128 and mpmd as they are.
In steady state one micro-batch leaves per tick: useful tokens per tick are the case's mean
size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.kv.device_cache import BLOCK, KVCache
from jaxpipe.model import decoder
from jaxpipe.model.decoder import LAYER_PARAMS, HeadParams, LayerParams, param_decls
from jaxpipe.runtime import pipeline, sharding, step_inputs
from jaxpipe.runtime.step_inputs import Piece, StepInputs

KEYS = ("rows", "positions", "table", "q_start", "q_len", "kv_len", "last")
DESIGNS = ("spmd", "mpmd")


@dataclass(frozen=True)
class MpmdBenchConfig:
    """What `scripts/bench_mpmd.py` times (its flags, jaxpipe.config.flags).

    layout: the pipeline layout on the virtual CPU devices: pp stages of tp devices each
        (one per run: a tuple flag would split 'pp=4,tp=2' at its comma)
    cases: micro-batch sizes in tokens as they enter, '/'-separated and cycling ('16/128':
        alternating 16 and 128)
    context: keys each decode row attends to (its position + 1)
    ticks: ticks timed per repeat, after the pipeline has filled (a tick of pp=8 over
        SmolLM2 took 0.2-0.8 s on 2 loaded EPYC cores)
    repeats: timed repeats of each design, interleaved (the median is kept)
    model: model preset or path (its architecture only: seeded random weights)
    json_path: write the points here, with the machine (none: only the table)
    """

    layout: str = "pp=8"
    cases: tuple[str, ...] = ("16", "64", "16/128")
    context: int = 128
    ticks: int = 4
    repeats: int = 3
    model: str = "smollm2-135m"
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        Layout.parse(self.layout)
        for case in self.cases:
            case_sizes(case)
        for name in ("context", "ticks", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"MpmdBenchConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)!r}")


def case_sizes(case: str) -> tuple[int, ...]:
    """'16/128' -> (16, 128), else a ValueError naming the case."""
    parts = case.split("/")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"case {case!r} is not positive token counts joined by '/' "
                         "(e.g. '16' or '16/128')")
    return tuple(map(int, parts))


@dataclass(frozen=True)
class Workload:
    """The micro-batches: the k-th to enter has `sizes[k % len(sizes)]` decode rows, row r
    reading blocks r * B .. r * B + B - 1 (B = `blocks_per_row`: micro-batches of one size
    share their rows' blocks, and each writes the same slot its attention then reads, so
    every run of a micro-batch computes the same numbers)."""

    sizes: tuple[int, ...]
    context: int
    vocab: int

    @property
    def blocks_per_row(self) -> int:
        return -(-self.context // BLOCK)

    @property
    def num_blocks(self) -> int:
        return max(self.sizes) * self.blocks_per_row

    @property
    def tick_tokens(self) -> int:
        """spmd's bucket: the largest size (in flight on every steady tick once pp >= the
        number of sizes)."""
        return max(self.sizes)

    def size(self, k: int) -> int:
        return self.sizes[k % len(self.sizes)]

    def inputs(self, k: int) -> StepInputs:
        """Micro-batch k's inputs (T = R = its size)."""
        return _decode_inputs(self.tokens(self.size(k)), self.context, self.blocks_per_row)

    def tokens(self, size: int) -> tuple[int, ...]:
        """The token ids fed in by a micro-batch of `size` rows (seeded)."""
        return tuple(int(t) for t in np.random.default_rng(size).integers(0, self.vocab, size))


_INPUTS: dict[tuple, StepInputs] = {}


def _decode_inputs(tokens: tuple[int, ...], context: int, blocks: int) -> StepInputs:
    key = (tokens, context, blocks)
    if key not in _INPUTS:
        rows = len(tokens)
        pieces = [Piece([t], context - 1, list(range(r * blocks, (r + 1) * blocks)))
                  for r, t in enumerate(tokens)]
        _INPUTS[key] = step_inputs.build(pieces, rows, rows, blocks)
    return _INPUTS[key]


def layer_specs(cfg: ModelConfig, layout: Layout) -> LayerParams:
    """Each layer weight's PartitionSpec under `layout` (None: a weight the model has not)."""
    decls = param_decls(cfg)
    return LayerParams(*(sharding.spec(decls[n].axes, layout) if n in decls else None
                         for n in LAYER_PARAMS))


def place_layers(cfg: ModelConfig, padded: dict, layout: Layout, mesh) -> LayerParams:
    """The stacked layer weights `padded` (name -> host array) on `mesh` under `layout`."""
    specs = layer_specs(cfg, layout)
    return LayerParams(*(None if spec is None else
                         jax.device_put(padded[n], NamedSharding(mesh, spec))
                         for n, spec in zip(LAYER_PARAMS, specs, strict=True)))


def zeros_cache(shape: tuple[int, ...], place: NamedSharding) -> KVCache:
    """Empty K and V pools of `shape` [L', NB, Hkv', BLOCK, D] f32, made in place."""
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=place)
    return KVCache(zeros(), zeros())


def stage_program(cfg: ModelConfig, layout: Layout, mesh, opts: pipeline.StageOptions,
                  last: bool):
    """jit(layers, x [Tm, E], mb {KEYS}, cache) -> (y [Tm, E], or with `last` the residual
    of each row's last token [R, E]; cache, donated): one stage of mpmd on its own `mesh`
    (`layout` has pp = 1: the stage's tp devices)."""
    kv = sharding.spec(sharding.KV_AXES, layout)

    def body(layers, x, mb, cache):
        y, cache = pipeline.stage_layers(cfg, layers, x, mb, cache, layout, opts)
        return (y[mb["last"]] if last else y), cache

    staged = jax.shard_map(body, mesh=mesh, check_vma=False,
                           in_specs=(layer_specs(cfg, layout), P(), {k: P() for k in KEYS},
                                     KVCache(kv, kv)),
                           out_specs=(P(), KVCache(kv, kv)))
    return jax.jit(staged, donate_argnums=3)


def _fields(inputs: StepInputs) -> dict:
    return {k: getattr(inputs, k) for k in KEYS}


class Spmd:
    """Design (b): the engine's tick program (`pipeline.tick_program`) over the whole mesh,
    every slot padded to the workload's `tick_tokens` tokens and rows; `tick(t)` -> the
    hidden of micro-batch t - (pp - 1) ([tick_tokens, E], its first rows real) or None while
    the pipeline fills."""

    def __init__(self, cfg: ModelConfig, layout: Layout, values: dict, work: Workload,
                 opts: pipeline.StageOptions, devices):
        self.pp, self.work, self.mesh = layout.pp, work, sharding.make_mesh(layout, devices)
        padding = sharding.padding_for(cfg, [layout])
        places = sharding.param_shardings(cfg, padding, layout, self.mesh)
        self.params = {n: jax.device_put(sharding.pad_value(d, values[n], padding), places[n])
                       for n, d in param_decls(cfg).items()}
        self.cache = zeros_cache(sharding.kv_shape(cfg, padding, work.num_blocks),
                                 sharding.kv_sharding(cfg, padding, layout, self.mesh,
                                                      work.num_blocks))
        tokens = work.tick_tokens
        act = np.zeros((layout.pp, tokens, cfg.hidden_size), np.float32)  # [pp, T, E]
        self.act = jax.device_put(act, NamedSharding(self.mesh, P("pp")))
        self.prev = jax.device_put(np.zeros(tokens, np.int32), NamedSharding(self.mesh, P()))
        self.program = pipeline.tick_program(cfg, layout, self.mesh, opts, out_rows=tokens)

    def tick(self, t: int):
        tokens = self.work.tick_tokens
        slots = [self.work.inputs(t - s) if t >= s else None for s in range(self.pp)]
        stacked = step_inputs.stack(slots, tokens, tokens)
        hidden, self.cache, self.act = self.program(self.params, self.cache, self.act, stacked,
                                                    self.prev)
        return hidden if t >= self.pp - 1 else None

    def state(self) -> list:
        return [self.act, self.cache]


class Mpmd:
    """Design (a): stage s's program on devices s*tp .. s*tp + tp - 1 with its layers and KV
    only; `tick(t)` dispatches stage s on micro-batch t - s (skipped while the pipeline
    fills) and `device_put`s its output to stage s + 1; -> the hidden [R, E] of micro-batch
    t - (pp - 1), or None."""

    def __init__(self, cfg: ModelConfig, layout: Layout, values: dict, work: Workload,
                 opts: pipeline.StageOptions, devices):
        pp, tp = layout.pp, layout.tp
        padded = padded_layers(cfg, values, layout)
        stage = Layout(tp=tp)
        padding = sharding.padding_for(cfg, [layout])
        shape = sharding.kv_shape(cfg, padding, work.num_blocks)
        per = shape[0] // pp
        shape = (per, *shape[1:])
        self.pp, self.work = pp, work
        self.meshes = [sharding.make_mesh(stage, devices[s * tp:(s + 1) * tp])
                       for s in range(pp)]
        self.places = [NamedSharding(m, P()) for m in self.meshes]
        kv = sharding.spec(sharding.KV_AXES, stage)
        self.layers, self.caches, self.programs = [], [], []
        for s, mesh in enumerate(self.meshes):
            mine = {n: a[s * per:(s + 1) * per] for n, a in padded.items()}
            self.layers.append(place_layers(cfg, mine, stage, mesh))
            self.caches.append(zeros_cache(shape, NamedSharding(mesh, kv)))
            self.programs.append(stage_program(cfg, stage, mesh, opts, last=s == pp - 1))
        head = HeadParams(jnp.asarray(values["embed"]), None, None)
        self.x0 = {n: jax.device_put(decoder.embed(head, jnp.asarray(work.tokens(n)),
                                                   cfg.embed_scale), self.places[0])
                   for n in set(work.sizes)}
        self.carry: list = [None] * pp

    def tick(self, t: int):
        carry, out = [None] * self.pp, None
        for s in range(min(t + 1, self.pp)):
            k = t - s
            x = self.x0[self.work.size(k)] if s == 0 else self.carry[s]
            y, self.caches[s] = self.programs[s](self.layers[s], x,
                                                 _fields(self.work.inputs(k)), self.caches[s])
            if s + 1 < self.pp:
                carry[s + 1] = jax.device_put(y, self.places[s + 1])
            else:
                out = y
        self.carry = carry
        return out

    def state(self) -> list:
        return [self.caches, self.carry]


def padded_layers(cfg: ModelConfig, values: dict, layout: Layout) -> dict[str, np.ndarray]:
    """The layer weights of `values` padded for `layout` (`sharding.padding_for`): identity
    layers to a multiple of pp, heads and mlp columns to a multiple of tp."""
    decls, padding = param_decls(cfg), sharding.padding_for(cfg, [layout])
    return {n: sharding.pad_value(decls[n], values[n], padding) for n in LAYER_PARAMS
            if n in decls}


def build(cfg: ModelConfig, values: dict, layout: Layout, work: Workload,
          attention: str = "xla", devices=None) -> dict[str, Spmd | Mpmd]:
    """Both designs of `layout` over the first pp * tp `devices` (default: JAX's), on the
    same padded weights, the stages' attention `attention` (`pipeline.attend`; the benchmark
    runs "xla"): {"spmd": ..., "mpmd": ...}."""
    devices = list(jax.devices() if devices is None else devices)
    if layout.num_devices > len(devices) or layout.ep * layout.dp > 1:
        raise ValueError(f"layout {layout} needs pp*tp = {layout.num_devices} devices (no ep "
                         f"or dp); JAX sees {len(devices)} (on CPU: XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8)")
    opts = pipeline.StageOptions(attention, max_kv=work.blocks_per_row * BLOCK)
    return {"spmd": Spmd(cfg, layout, values, work, opts, devices),
            "mpmd": Mpmd(cfg, layout, values, work, opts, devices)}


def run_ticks(design: Spmd | Mpmd, start: int, count: int) -> list:
    """Ticks start .. start + count - 1, blocked on at the end: the hiddens that left."""
    out = [design.tick(t) for t in range(start, start + count)]
    return jax.block_until_ready(out)


def leaving(work: Workload, pp: int, outs: list, start: int = 0) -> dict[int, np.ndarray]:
    """micro-batch k -> its real rows' hidden [R_k, E], from the outputs of ticks start ..."""
    return {t - (pp - 1): np.asarray(h)[:work.size(t - (pp - 1))]
            for t, h in enumerate(outs, start) if h is not None}


def warm(designs: dict, work: Workload, pp: int, ticks: int) -> tuple[dict, float]:
    """Run each design from an empty pipeline for `ticks` ticks (compiling every program):
    ({design: seconds it took}, the largest absolute difference between their hiddens of
    every micro-batch that left: both must give the same ones)."""
    seconds, out = {}, {}
    for name in DESIGNS:
        began = time.perf_counter()
        out[name] = leaving(work, pp, run_ticks(designs[name], 0, ticks))
        seconds[name] = time.perf_counter() - began
    a, b = (out[d] for d in DESIGNS)
    if a.keys() != b.keys() or not a:
        raise AssertionError(f"micro-batches left: spmd {sorted(a)}, mpmd {sorted(b)}")
    return seconds, max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def measure(cfg: ModelConfig, values: dict, layout: Layout, case: str,
            config: MpmdBenchConfig) -> list[dict]:
    """One point per design for `case` on `layout`: the median seconds per tick over
    `config.repeats` interleaved repeats of `config.ticks` ticks each, after both designs
    ran (compiled) every micro-batch size through the whole pipeline (`warmup_s`: that
    run's seconds, mostly compilation: spmd compiles one program, mpmd pp per size)."""
    sizes = case_sizes(case)
    work = Workload(sizes, config.context, cfg.vocab_size)
    designs = build(cfg, values, layout, work)
    start = layout.pp + 2 * len(sizes)
    warm_s, diff = warm(designs, work, layout.pp, start)
    times: dict[str, list[float]] = {d: [] for d in DESIGNS}
    for _ in range(config.repeats):
        for name in DESIGNS:
            began = time.perf_counter()
            run_ticks(designs[name], start, config.ticks)
            times[name].append((time.perf_counter() - began) / config.ticks)
        start += config.ticks
    useful = statistics.mean(sizes)
    computed = {"spmd": layout.pp * work.tick_tokens, "mpmd": layout.pp * useful}
    return [{"layout": str(layout), "case": case, "sizes": list(sizes), "design": name,
             "ms_per_tick": 1e3 * statistics.median(times[name]),
             "ms_per_tick_all": [1e3 * s for s in times[name]],
             "useful_tokens_per_tick": useful, "computed_tokens_per_tick": computed[name],
             "tokens_per_s": useful / statistics.median(times[name]),
             "warmup_s": warm_s[name], "max_abs_diff": diff} for name in DESIGNS]


def run(cfg: ModelConfig, values: dict, config: MpmdBenchConfig, log=print) -> list[dict]:
    """Every case of `config` on its layout: the points, each case's logged when measured."""
    points, layout = [], Layout.parse(config.layout)
    for case in config.cases:
        points += measure(cfg, values, layout, case, config)
        log("\n".join(format_table(points[-2:]).splitlines()[2:]))
    return points


_COLUMNS = (("layout", 10, "{}"), ("case", 8, "{}"), ("design", 6, "{}"),
            ("ms/tick", 9, "{:.1f}"), ("tok/s", 8, "{:.0f}"), ("computed/tick", 13, "{:.0f}"),
            ("vs spmd", 7, "{:.2f}x"), ("warmup s", 8, "{:.1f}"), ("max|diff|", 9, "{:.1e}"))


def format_table(points: list[dict]) -> str:
    """A fixed-width table of `points` (tok/s: useful tokens per second; computed/tick:
    tokens the stages compute per tick, padding included; vs spmd: spmd's ms/tick over this
    design's, > 1: faster than spmd; warmup s: the compiling run; max|diff|: between the
    designs' hiddens)."""
    spmd = {(p["layout"], p["case"]): p["ms_per_tick"] for p in points
            if p["design"] == "spmd"}
    header = " ".join(f"{h:>{w}}" for h, w, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for p in points:
        base = spmd.get((p["layout"], p["case"]))
        cells = (p["layout"], p["case"], p["design"], p["ms_per_tick"], p["tokens_per_s"],
                 p["computed_tokens_per_tick"],
                 base / p["ms_per_tick"] if base else float("nan"), p["warmup_s"],
                 p["max_abs_diff"])
        lines.append(" ".join(f"{f.format(c):>{w}}" for (_, w, f), c in
                              zip(_COLUMNS, cells, strict=True)))
    return "\n".join(lines)
