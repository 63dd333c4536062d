"""Calibrate the cost model on this machine: measure the CPU preset's constants, then set the
cost model's prefill and decode step times beside the real engine's.

Constants (the `meshes/*.toml` [hardware] keys), each the best a jitted JAX program was seen to
do here, median over repeats, so that they play the role of a datasheet peak:
  peak_tflops  bf16 x bf16 matmul with f32 accumulation (`jaxpipe_bench.matmul`, max over the
               model's MLP shapes and a large square one);
  hbm_gbps     bytes moved per second by a large-array row sum (read) or a donated in-place
               scale (read + write), the larger of the two;
  host_link_gbps, p2p_gbps, allreduce_gbps
               on one CPU device "host <-> device" and "stage to stage" are memory copies: the
               in-place scale's bandwidth.
`memory_gb` is a budget, not a speed, and is left as the preset has it.

Step times are those of the engine's `Runner` (the device part of `Engine.step`: embed, every
layer, LM head, sampling, tokens back on the host) on SmolLM2-135M in bf16 with one device,
after a warm-up call per shape (compilation excluded), median over repeats. Decode rows sit at
position context-1, so the attention kernel reads `context` positions of every row.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpipe.config.checks import check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import MESH_DIR, Hardware, load_mesh
from jaxpipe.config.model import ModelConfig
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.runtime import synthetic_step

PREFILL_BATCHES = (1, 4, 16)
PROMPT_LEN = 128
DECODE_BATCHES = (16, 64, 128)
DECODE_CONTEXT = 256
BANDWIDTH_BYTES = 256 * 2**20  # large next to the 2-core machine's caches
MEASURED_KEYS = ("hbm_gbps", "peak_tflops", "host_link_gbps", "p2p_gbps", "allreduce_gbps")
REPEATS = 5  # timed steps per shape


@dataclass(frozen=True)
class CalibrateConfig:
    """What `scripts/calibrate_cpu.py` does (its flags, jaxpipe.config.flags).

    json_path: write the results as JSON here (none: only the tables)
    write_preset: set the measured constants in meshes/cpu-1.toml, and the same machine split
        8 ways in meshes/cpu-8.toml (comments kept)
    repeats: timed steps per shape (the median is kept)
    """

    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})
    write_preset: bool = False
    repeats: int = REPEATS

    def __post_init__(self):
        check_counts(self, "repeats")


@dataclass(frozen=True)
class Shape:
    """One calibrated step: `batch` prompts of `tokens` (prefill) or `batch` sequences each
    attending over `tokens` positions (decode)."""

    phase: str  # "prefill" | "decode"
    batch: int
    tokens: int


def calibration_shapes(prefill_batches: Sequence[int] = PREFILL_BATCHES,
                       prompt_len: int = PROMPT_LEN,
                       decode_batches: Sequence[int] = DECODE_BATCHES,
                       context: int = DECODE_CONTEXT) -> list[Shape]:
    """The steps calibrated: prefill at each batch, then decode at each batch."""
    return ([Shape("prefill", b, prompt_len) for b in prefill_batches]
            + [Shape("decode", b, context) for b in decode_batches])


def step_flops(cost: CostModel, shape: Shape) -> float:
    """FLOPs the cost model counts for `shape`: linear layers, attention and the LM head."""
    m, b, t = cost.model, shape.batch, shape.tokens
    tokens, pairs = (b * t, b * t * (t + 1) / 2) if shape.phase == "prefill" else (b, b * t)
    dense = len(m.dense_layers)  # a mixed model's dense layers: their MLP, no experts
    linear = (m.num_layers - dense) * cost.layer_params + dense * cost.dense_layer_params
    experts = cost.moe_layers * m.num_experts_per_tok * cost.expert_params  # 0 when dense
    attention = m.num_layers * 4 * pairs * m.num_heads * m.head_dim
    return 2 * tokens * (linear + experts) + attention + 2 * b * m.vocab_size * m.hidden_size


def predict(cost: CostModel, shape: Shape) -> float:
    """The cost model's seconds for `shape`."""
    if shape.phase == "prefill":
        return cost.prefill_time(shape.batch, shape.tokens)
    return cost.decode_time(shape.batch, shape.tokens)


# ---- machine constants ----------------------------------------------------------------------


def measure_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 7) -> dict:
    """GB/s of a jitted row sum of an f32 array (bytes read) and of a donated in-place scale
    (bytes read + written)."""
    import jax
    import jax.numpy as jnp

    n = nbytes // 4
    x = jnp.ones((1024, n // 1024), jnp.float32)
    row_sum = jax.jit(lambda a: jnp.sum(a, axis=1))
    read = synthetic_step.median_seconds(lambda: row_sum(x).block_until_ready(), repeats)
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    state = [x]

    def step():
        state[0] = scale(state[0])
        state[0].block_until_ready()

    copy = synthetic_step.median_seconds(step, repeats)
    return {"bytes": 4 * x.size, "read_gbps": 4 * x.size / read / 1e9,
            "copy_gbps": 2 * 4 * x.size / copy / 1e9}


def measure_constants(repeats: int = 7) -> dict:
    """This machine's [hardware] constants (see the module docstring) and how they were got."""
    from jaxpipe_bench.matmul import measure_peak_gflops

    matmul = measure_peak_gflops("bfloat16", repeats=repeats)
    bandwidth = measure_bandwidth(repeats=repeats)
    copy = round(bandwidth["copy_gbps"], 1)
    hardware = {"hbm_gbps": round(max(bandwidth["read_gbps"], bandwidth["copy_gbps"]), 1),
                "peak_tflops": round(matmul["peak_gflops"] / 1e3, 4),
                "host_link_gbps": copy, "p2p_gbps": copy, "allreduce_gbps": {1: copy}}
    return {"hardware": hardware, "matmul": matmul, "bandwidth": bandwidth}


def with_constants(hardware: Hardware, values: dict) -> Hardware:
    """`hardware` with the measured [hardware] `values` (TOML units) in place of its own."""
    giga = 1e9
    return dataclasses.replace(
        hardware, hbm_bandwidth=values["hbm_gbps"] * giga,
        peak_flops=values["peak_tflops"] * 1e12,
        host_link_bandwidth=values["host_link_gbps"] * giga,
        p2p_bandwidth=values["p2p_gbps"] * giga,
        allreduce_bandwidth={int(k): v * giga for k, v in values["allreduce_gbps"].items()})


def split(values: dict, ways: int) -> dict:
    """The machine's constants per device when it is split into `ways` virtual devices that
    share its cores and memory (all-reduce bandwidths are not split: they are not measured)."""
    keys = ("hbm_gbps", "peak_tflops", "host_link_gbps", "p2p_gbps")
    digits = {"peak_tflops": 5}
    return {k: round(values[k] / ways, digits.get(k, 3)) for k in keys}


# ---- the preset file ------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """A [hardware] value as the presets write it: numbers, or an inline {degree = GB/s} table."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {float(v)}" for k, v in value.items()) + " }"
    return repr(value)


def format_hardware(values: dict) -> str:
    """`values` as the lines of a [hardware] table."""
    return "\n".join(["[hardware]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()])


def update_hardware(text: str, values: dict) -> str:
    """The preset `text` with each `key = value` line of its [hardware] table that names a key
    of `values` set to the new value; comments, order and other lines kept. Raises ValueError if
    a key is not in the table."""
    lines, section, seen = text.splitlines(keepends=True), None, set()
    for i, line in enumerate(lines):
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            section = header.group(1).strip()
            continue
        m = re.match(r"(\s*)([A-Za-z_]\w*)(\s*=\s*)(\{[^}]*\}|[^#\s]+)(.*)", line, re.S)
        if section == "hardware" and m and m.group(2) in values:
            indent, key, eq, _, rest = m.groups()
            lines[i] = f"{indent}{key}{eq}{toml_value(values[key])}{rest}"
            seen.add(key)
    missing = sorted(set(values) - seen)
    if missing:
        raise ValueError(f"the preset's [hardware] table has no {missing}; keys updated in place "
                         "must already be there")
    return "".join(lines)


def write_preset(values: dict, name: str = "cpu-1", mesh_dir: Path = MESH_DIR) -> Path:
    """Set the measured `values` in `mesh_dir/<name>.toml`, keeping its comments."""
    path = Path(mesh_dir) / f"{name}.toml"
    path.write_text(update_hardware(path.read_text(), values))
    return path


# ---- the real engine ------------------------------------------------------------------------


def step_args(shape: Shape) -> tuple[int, int, int]:
    """(batch, length, start) of the synthetic step of `shape`: b prompts of t tokens
    (prefill), or b decode tokens at position t - 1 attending over t positions (decode)."""
    b, t = shape.batch, shape.tokens
    return (b, t, 0) if shape.phase == "prefill" else (b, 1, t - 1)


def step_call(runner, shape: Shape) -> Callable[[], Any]:
    """One real step of `shape` on `runner`, its LM head over every sequence (blocks until
    the logits are there)."""
    return synthetic_step.step_call(runner, *step_args(shape))


def make_engine(shapes: Iterable[Shape], model: str = EngineConfig.model, **overrides):
    """An engine (bf16, one CPU device, no warm-up) with room for every shape."""
    from jaxpipe.engine.engine import Engine

    shapes = list(shapes)
    longest = max(s.tokens for s in shapes)
    most = max(s.batch for s in shapes)
    config = dict(model=model, dtype="bfloat16", max_model_len=2 * longest, max_num_seqs=most,
                  max_num_batched_tokens=max(s.batch * s.tokens for s in shapes),
                  kv_cache_tokens=most * 2 * longest, warmup=False, show_progress=False)
    return Engine(EngineConfig(**(config | overrides)))


def measure_steps(engine, shapes: Sequence[Shape], repeats: int = REPEATS) -> list[float]:
    """Median seconds of each shape's step on the engine's runner, compilation excluded."""
    return [synthetic_step.median_seconds(step_call(engine.runner, s), repeats) for s in shapes]


# ---- the comparison -------------------------------------------------------------------------


def comparison(shapes: Sequence[Shape], predicted: Sequence[float], measured: Sequence[float],
               flops: Sequence[float]) -> list[dict]:
    """One row per shape: predicted and measured ms, measured/predicted, and the GFLOP/s the
    engine achieved (the step's `flops` over its measured time)."""
    return [{"phase": s.phase, "batch": s.batch, "tokens": s.tokens,
             "predicted_ms": 1e3 * p, "measured_ms": 1e3 * m, "ratio": m / p,
             "achieved_gflops": f / m / 1e9}
            for s, p, m, f in zip(shapes, predicted, measured, flops, strict=True)]


def format_table(rows: Sequence[dict]) -> str:
    """The comparison as a text table."""
    out = [f"{'phase':<8}{'batch':>6}{'tokens':>8}{'predicted ms':>14}{'measured ms':>13}"
           f"{'measured/predicted':>20}{'achieved GFLOP/s':>18}"]
    for r in rows:
        out.append(f"{r['phase']:<8}{r['batch']:>6}{r['tokens']:>8}{r['predicted_ms']:>14.1f}"
                   f"{r['measured_ms']:>13.1f}{r['ratio']:>20.2f}{r['achieved_gflops']:>18.0f}")
    return "\n".join(out)


def compare(model: ModelConfig, hardware: Hardware, shapes: Sequence[Shape],
            measured: Sequence[float]) -> list[dict]:
    """The comparison rows for `measured` seconds against the cost model on one device."""
    cost = CostModel(model, hardware, Layout())
    return comparison(shapes, [predict(cost, s) for s in shapes], measured,
                      [step_flops(cost, s) for s in shapes])


def calibrate(shapes: Sequence[Shape] | None = None, repeats: int = REPEATS, mesh: str = "cpu-1",
              model: str = EngineConfig.model, log: Callable[[str], None] = print) -> dict:
    """Measure the constants, time the engine's steps, and compare with the cost model.
    Returns JSON-able results: the constants, the measurements behind them and the table."""
    shapes = list(shapes or calibration_shapes())
    log("measuring matmul throughput and memory bandwidth ...")
    constants = measure_constants()
    log(format_hardware(constants["hardware"]))
    hardware = with_constants(load_mesh(mesh).hardware, constants["hardware"])
    log(f"timing {len(shapes)} engine steps ({model}, bf16, 1 device) ...")
    engine = make_engine(shapes, model)
    measured = measure_steps(engine, shapes, repeats)
    rows = compare(engine.model_config, hardware, shapes, measured)
    log(format_table(rows))
    return {"mesh": mesh, "model": model, "dtype": "bfloat16", "repeats": repeats,
            "statistic": "median", **constants, "steps": rows}


def run(config: CalibrateConfig, log: Callable[[str], None] = print) -> dict:
    """`calibrate` with `config`'s repeats; the results written as JSON and into the cpu-1 and
    cpu-8 presets as `config` asks."""
    from jaxpipe_bench.report import write_json

    result = calibrate(repeats=config.repeats, log=log)
    if config.json_path:
        log(f"wrote {write_json(result, config.json_path)}")
    if config.write_preset:
        hardware = result["hardware"]
        log(f"wrote {write_preset(hardware, 'cpu-1')}")
        log(f"wrote {write_preset(split(hardware, 8), 'cpu-8')}")
    return result
