"""Choose the prefill and decode layouts (c_p, c_d) from the cost model.

Every (pp, tp) factorisation of the mesh's devices whose weights and at least one whole request
of KV fit is a candidate; for a mixture-of-experts model, every (pp, tp, ep) one, with ep
dividing both the device count and the expert count (the cost model's docstring says how it
prices ep: experts spread, attention replicated, one all-reduce over ep per MoE layer). For
each, the cost model predicts prefill throughput (prompt tokens/s at a full pipeline of prefill
micro-batches) and decode throughput (tokens/s at the largest decode batch the KV store
holds at the workload's mean context, and no larger than the mean batch a run can sustain:
total output / longest output). A pair (c_p, c_d) serves a request in
prompt/prefill_tps(c_p) + output/decode_tps(c_d) seconds plus its share of the re-shards
(two per host-tier refill); a static layout is the pair (c, c) without re-shards. The
planner picks the pair with the highest predicted end-to-end throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import MeshPreset
from jaxpipe.config.model import ModelConfig
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.workloads import Workload, make_workload

MAX_NUM_SEQS = 256  # sequences per pipeline micro-batch scheduler (vLLM's max_num_seqs)
PREFILL_TOKENS_PER_MICROBATCH = 4096  # prompt tokens a prefill step gives each stage
HOST_KV_GB = 256  # host KV tier (GB of pinned host memory), the same for every scenario


def layout_name(layout: Layout) -> str:
    """Layout(pp=2, tp=4) -> 'tp4pp2'; Layout(pp=8) -> 'pp8'; Layout(tp=2, ep=4) ->
    'tp2ep4' (the JSON names)."""
    parts = [f"{a}{getattr(layout, a)}" for a in ("dp", "tp", "ep", "pp")
             if getattr(layout, a) > 1]
    return "".join(parts) or "tp1"


def paper_label(layout: Layout) -> str:
    """The Seesaw paper's style: Layout(pp=2, tp=4) -> 'T4P2' (ep: 'E')."""
    label = layout_name(layout).upper()
    for axis in ("TP", "EP", "PP", "DP"):
        label = label.replace(axis, axis[0])
    return label


def candidate_layouts(num_devices: int, num_experts: int = 0) -> list[Layout]:
    """Every Layout(pp, tp, ep) with pp * tp * ep == num_devices (dp = 1), ep dividing
    `num_experts` (ep = 1 only for a dense model, num_experts 0); by ep, then pp-heavy first."""
    eps = [ep for ep in range(1, num_devices + 1)
           if num_devices % ep == 0 and (ep == 1 or (num_experts and num_experts % ep == 0))]
    return [Layout(pp=num_devices // (ep * tp), tp=tp, ep=ep) for ep in eps
            for tp in range(1, num_devices // ep + 1) if (num_devices // ep) % tp == 0]


@dataclass(frozen=True)
class LayoutEstimate:
    """Cost-model predictions for one layout on one workload."""

    layout: Layout
    kv_tokens: int  # KV capacity of the replica
    prefill_tps: float  # prompt tokens/s
    decode_tps: float  # generated tokens/s
    decode_batch: int  # sequences per decode step assumed for decode_tps
    cost: CostModel

    @property
    def name(self) -> str:
        return layout_name(self.layout)


def estimate(model: ModelConfig, mesh: MeshPreset, layout: Layout, w: Workload) -> LayoutEstimate:
    """Predicted prefill and decode throughput of `layout` at `w`'s mean lengths."""
    cm = CostModel(model, mesh.hardware, layout)
    kv = cm.kv_capacity_tokens()
    s = max(1, round(w.mean_prompt))
    b_p = max(1, min(layout.pp * max(1, PREFILL_TOKENS_PER_MICROBATCH // s), kv // s))
    ctx = max(1, round(w.mean_prompt + w.mean_output / 2))  # mean context while decoding
    # Decoding lasts at least as many steps as the longest output, so the mean batch is at
    # most total output / longest output, however much KV there is.
    longest = max(o for _, o in w.requests)
    b_d = max(1, min(kv // ctx, MAX_NUM_SEQS * layout.pp, w.total_output // longest))
    return LayoutEstimate(layout, kv, b_p * s / cm.prefill_time(b_p, s),
                          b_d / cm.decode_time(b_d, ctx), b_d, cm)


def feasible(model: ModelConfig, mesh: MeshPreset, w: Workload) -> list[LayoutEstimate]:
    """Estimates of every candidate layout that holds the weights and the longest request."""
    out = []
    for layout in candidate_layouts(mesh.num_devices, model.num_experts):
        if CostModel(model, mesh.hardware, layout).fits(w.max_len):
            out.append(estimate(model, mesh, layout, w))
    if not out:
        axes = "(pp, tp, ep)" if model.is_moe else "(pp, tp)"
        raise ValueError(f"no {axes} layout of {mesh.num_devices} devices of {mesh.name} "
                         f"holds the model's weights plus {w.max_len} tokens of KV")
    return out


def host_kv_tokens(model: ModelConfig, host_kv_gb: float = HOST_KV_GB) -> int:
    """Tokens the host tier holds (KV stored once, without TP replication)."""
    per_token = model.kv_bytes_per_token(2)
    return int(host_kv_gb * 1e9 // per_token)


def pair_throughput(p: LayoutEstimate, d: LayoutEstimate, w: Workload,
                    host_kv_gb: float = HOST_KV_GB) -> float:
    """Predicted total tokens/s serving `w` with prefill on `p` and decode on `d`."""
    seconds = w.total_prompt / p.prefill_tps + w.total_output / d.decode_tps
    if p.layout != d.layout:
        refills = math.ceil(w.total_prompt / host_kv_tokens(p.cost.model, host_kv_gb))
        seconds += refills * (p.cost.reshard_seconds(d.layout) + d.cost.reshard_seconds(p.layout))
    return (w.total_prompt + w.total_output) / seconds


@dataclass(frozen=True)
class Plan:
    """The planner's answer: every feasible layout's estimate, the pair, the best static."""

    workload: Workload
    estimates: tuple[LayoutEstimate, ...]
    prefill: LayoutEstimate
    decode: LayoutEstimate
    throughput: float  # predicted tokens/s of (prefill, decode)
    best_static: LayoutEstimate
    static_throughput: float


def plan(model: ModelConfig, mesh: MeshPreset, workload: Workload | str,
         host_kv_gb: float = HOST_KV_GB) -> Plan:
    """Predict every feasible layout and pick the best (c_p, c_d) pair and static layout."""
    w = make_workload(workload)
    ests = feasible(model, mesh, w)
    pairs = [(pair_throughput(p, d, w, host_kv_gb), i, j)
             for i, p in enumerate(ests) for j, d in enumerate(ests)]
    tps, i, j = max(pairs)
    static_tps, k, _ = max((t, i, j) for t, i, j in pairs if i == j)
    return Plan(w, tuple(ests), ests[i], ests[j], tps, ests[k], static_tps)


def choose_layouts(model_config: ModelConfig, mesh_preset: MeshPreset,
                   workload: Workload | str = "sharegpt") -> tuple[Layout, Layout]:
    """(prefill layout, decode layout) predicted best for `workload` — what
    `EngineConfig(prefill="auto", decode="auto")` resolves to."""
    p = plan(model_config, mesh_preset, workload)
    return p.prefill.layout, p.decode.layout


def format_plan(p: Plan, model_name: str = "", mesh_name: str = "") -> str:
    """The planner's table: one row per feasible layout, then the choice."""
    w = p.workload.describe()
    lines = [f"model {model_name}  mesh {mesh_name}  workload {p.workload.name} "
             f"({w['num_requests']} requests, mean prompt {w['prompt']['mean']}, "
             f"mean output {w['output']['mean']})",
             f"{'layout':<10}{'KV tokens':>12}{'prefill tok/s':>15}{'decode tok/s':>14}"
             f"{'decode batch':>14}{'static tok/s':>14}"]
    for e in p.estimates:
        static = pair_throughput(e, e, p.workload)
        lines.append(f"{e.name:<10}{e.kv_tokens:>12}{e.prefill_tps:>15.0f}{e.decode_tps:>14.0f}"
                     f"{e.decode_batch:>14}{static:>14.0f}")
    lines.append(f"chosen: prefill {p.prefill.name} -> decode {p.decode.name}  "
                 f"({p.throughput:.0f} tok/s predicted)")
    if p.prefill.cost.model.is_moe:
        lines.append("chosen (pp, tp, ep): " + ", ".join(
            f"{phase} ({e.layout.pp}, {e.layout.tp}, {e.layout.ep})"
            for phase, e in (("prefill", p.prefill), ("decode", p.decode))))
    lines.append(f"best static: {p.best_static.name}  ({p.static_throughput:.0f} tok/s predicted,"
                 f" seesaw x{p.throughput / p.static_throughput:.2f})")
    return "\n".join(lines)
