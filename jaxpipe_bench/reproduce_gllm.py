"""Reproduce gLLM's throughput comparison (Fig. 10, 12, 13) and ablation (Fig. 15) by
simulation (scripts/reproduce_gllm.py).

Every method serves the same `sharegpt` workload offline (all requests at once: the paper's
"maximum throughput", §4.3, is the plateau its Poisson load reaches) on 4 GPUs with the cost
model's micro-batch timing:

- vLLM (PP): `prefill_first` with Sarathi-Serve chunked prefill (2048-token budget per
  micro-batch) on pp=4, micro-batches with host-driven ticks, and vLLM's host time per
  micro-batch (`hostcost.VLLM_PP`, from SiPipe's profile of vLLM, as the SiPipe
  reproduction's vLLM row: input preparation on the critical path, sampling on the last
  stage's GPUs), scheduled by V0's 4 virtual engines (`virtual_engines=True`: 1/4 of the KV
  and its own requests each). The paper ran vLLM 0.8.1, V1 by default and V0 where V1
  crashed (§4.1); 0.8.1's V1 ran pipeline parallelism on Ray only (one scheduler), its V0 on
  virtual engines, and the paper does not say which served its PP rows.
- gLLM w/ CK: the same policy on gLLM's runtime, which hides the CPU's work behind the
  devices' (§3.3): no host time (the paper: 10% more throughput than vLLM, Fig. 15).
- SGLang (TP): the same chunked-prefill policy on tp=4, no host time (SGLang's scheduler
  overlaps the CPU's work with the GPU's).
- gLLM: `throttle` on pp=4 with the paper's knobs (#T 8, #MaxP 2048, #MinP 32, KV_thresh 0.05).
- Ablations: w/o WT (#T = 1: the waiting-token term no longer throttles), w/o UT (eq. 1, no
  KV-utilisation term), and throttling against a fixed budget (= the gLLM w/ CK row).

Scenarios: intra-node 4x L20 with Qwen2.5-14B and -32B; cross-node 4x A800 (one per node,
73 Gbps) with Llama-3.1-100B (meshes/ and models/ say where each constant comes from). The
paper's Azure dataset is left out (no length statistics beyond its ratios to ShareGPT).
"""

from __future__ import annotations

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.hostcost import VLLM_PP
from jaxpipe.planner.simulate import simulate
from jaxpipe.planner.workloads import synthetic
from jaxpipe.scheduler.throttle import ThrottleKnobs
from jaxpipe_bench.reproduce import ReproduceConfig, against_paper, report_tables

NUM_REQUESTS = 2000
SCENARIOS = (("4xL20, Qwen2.5-14B", "l20x4-pcie", "qwen2.5-14b"),
             ("4xL20, Qwen2.5-32B", "l20x4-pcie", "qwen2.5-32b"),
             ("4xA800 net, Llama3.1-100B", "a800x4-net", "llama3.1-100b"))
TP, PP = Layout(tp=4), Layout(pp=4)
# vLLM's virtual engines and gLLM schedule a micro-batch once the one before it on the same
# sequences landed: pp - 1 in flight while one is formed, not the engine's pp.
FLOW = {"pipelined": True}  # pp - 1 in flight while one is formed, as the engine
CHUNKED = {"chunked": True, "max_prefill_tokens": 2048}
METHODS = {  # name -> (policy, layout, options)
    "vLLM (PP, Sarathi)": ("prefill_first", PP, {**CHUNKED, **FLOW, "host_cost": VLLM_PP,
                                                 "virtual_engines": True}),
    "gLLM w/ CK": ("prefill_first", PP, {**CHUNKED, **FLOW}),
    "SGLang (TP, Sarathi)": ("prefill_first", TP, CHUNKED),
    "gLLM": ("throttle", PP, FLOW),
    "gLLM w/o WT": ("throttle", PP, {"knobs": ThrottleKnobs(iterations=1), **FLOW}),
    "gLLM w/o UT": ("throttle", PP, {"knobs": ThrottleKnobs(by_kv=False), **FLOW}),
}
# The paper's most over vLLM (PP): intra-node (Fig. 10), cross-node (Fig. 13), runtime alone
# (gLLM w/ CK, Fig. 15); the scenarios of each.
PAPER_BEST = {"intra-node": 2.50, "cross-node": 4.98, "runtime alone (w/ CK)": 1.10}
PAPER_SCENARIOS = {"intra-node": ("4xL20, Qwen2.5-14B", "4xL20, Qwen2.5-32B"),
                   "cross-node": ("4xA800 net, Llama3.1-100B",)}
PAPER = ("gLLM over vLLM: maximum throughput (processing capacity) +29% to +150% intra-node "
         "(Fig. 10), +11% to +398% cross-node (Fig. 13), near-linear scaling to 4 GPUs "
         "(Fig. 12); ablation (Fig. 15, latency at a fixed rate): w/o WT +20% E2EL, w/o UT "
         "+38% E2EL, gLLM w/ CK 10% more throughput than vLLM (runtime only).")


def compare(num_requests: int = NUM_REQUESTS) -> list[dict]:
    """Tokens/s of each method per scenario and gLLM's gain over each."""
    w = synthetic("sharegpt", num_requests, seed=0)
    rows = []
    for name, mesh_name, model_name in SCENARIOS:
        model, mesh = resolve_model(model_name).config, load_mesh(mesh_name)
        tps, util = {}, {}
        for method, (policy, layout, opts) in METHODS.items():
            result = simulate(model, mesh, w, policy, layout, **opts)
            tps[method], util[method] = result.throughput, result.utilisation
        rows.append({"scenario": name, "throughput": tps, "utilisation": util,
                     "gain": {m: tps["gLLM"] / tps[m] for m in METHODS if m != "gLLM"}})
    return rows


def format_compare(rows: list[dict]) -> str:
    names = list(METHODS)
    lines = ["gLLM (sharegpt, offline, 4 devices): simulated tokens/s; gLLM's gain over each"]
    lines.append(f"{'scenario':<27}" + "".join(f"{n:>22}" for n in names))
    for r in rows:
        lines.append(f"{r['scenario']:<27}" + "".join(
            f"{r['throughput'][n]:>14.0f}" + (f" ({r['gain'][n]:.2f}x)" if n in r["gain"]
                                               else " " * 8) for n in names))
        util = r["utilisation"]
        lines.append(f"{'  pipeline utilisation':<27}" + "".join(
            f"{util[n]:>22.2f}" if util[n] is not None else f"{'-':>22}" for n in names))
    lines.append(f"paper: {PAPER}")
    lines.append("simulated against the paper's most: " + "; ".join(
        f"{k} {v:.2f}x simulated, paper {PAPER_BEST[k]:.2f}x: {against_paper(v, PAPER_BEST[k])}"
        for k, v in best_gains(rows).items()))
    return "\n".join(lines)


def best_gains(rows: list[dict]) -> dict[str, float]:
    """The most gLLM gains over vLLM (PP) in each group of PAPER_SCENARIOS, and gLLM w/ CK's
    most over vLLM (PP) (the runtime alone), as PAPER_BEST."""
    vllm = "vLLM (PP, Sarathi)"
    out = {group: max(r["gain"][vllm] for r in rows if r["scenario"] in names)
           for group, names in PAPER_SCENARIOS.items()}
    out["runtime alone (w/ CK)"] = max(r["throughput"]["gLLM w/ CK"] / r["throughput"][vllm]
                                       for r in rows)
    return out


def report(config: ReproduceConfig, log=print) -> dict:
    """The comparison at `config`'s request count, logged and written as `config` asks."""
    return report_tables(config, NUM_REQUESTS, {"compare": (compare, format_compare)}, log)
