"""The planner's (pp, tp, ep) choice for mixture-of-experts models against every static layout,
in simulation (scripts/reproduce_moe.py), in the style of the Seesaw reproduction.

Static layouts run `prefill_first` with chunked prefill (the paper's vLLM baseline), one run
per (pp, tp, ep) layout of the mesh that holds the weights plus the longest request; the
planner's row runs the `seesaw` policy on the pair `choose_layouts` picks. Nothing is tuned
per scenario: the mesh presets' constants and the planner's. How ep is priced (experts spread,
attention and non-expert weights replicated over ep, one all-reduce over ep of each MoE
layer's output) is in `jaxpipe.planner.costmodel`'s docstring.
"""

from __future__ import annotations

from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.planner import paper_label
from jaxpipe.planner.workloads import synthetic
from jaxpipe_bench.reproduce import ReproduceConfig, static_and_planned, write_results

NUM_REQUESTS = 1000
JSON_PATH = "out/reproduce_moe.json"  # scripts/reproduce_moe.py writes here unless told
# (model preset, mesh preset, workload): the case on both datasets, and a mesh whose
# slow all-reduce makes ep pay
SCENARIOS = (("qwen3-30b-a3b", "h100x8-nvlink", "sharegpt"),
             ("qwen3-30b-a3b", "h100x8-nvlink", "arxiv"),
             ("mixtral-8x7b", "a800x4-net", "sharegpt"))


def scenario(preset: str, mesh_name: str, dataset: str, num_requests: int = NUM_REQUESTS) -> dict:
    """Simulated tokens/s of every feasible static layout and of the planner's pair."""
    model, mesh = resolve_model(preset).config, load_mesh(mesh_name)
    w = synthetic(dataset, num_requests, seed=0)
    static, best, (c_p, c_d), planned = static_and_planned(model, mesh, w)
    return {"model": preset, "mesh": mesh_name, "dataset": dataset,
            "num_requests": num_requests,
            "planner": {"prefill": str(c_p), "decode": str(c_d),
                        "label": f"{paper_label(c_p)} -> {paper_label(c_d)}",
                        "throughput": planned.throughput},
            "best_static": best, "speedup_over_best_static":
                planned.throughput / static[best].throughput,
            "static_throughput": {k: r.throughput for k, r in static.items()},
            "planner_stats": planned.to_dict() | {"host_timeline": None}}


def run(num_requests: int = NUM_REQUESTS) -> list[dict]:
    """Every scenario of `SCENARIOS`."""
    return [scenario(p, m, d, num_requests) for p, m, d in SCENARIOS]


def format_table(rows: list[dict]) -> str:
    """One block per scenario: each static layout's tokens/s, then the planner's pair."""
    lines = ["MoE layouts in simulation: tokens/s (prompt + output), prefill_first (chunked) on "
             "each static layout vs seesaw on the planner's pair"]
    for r in rows:
        lines.append(f"\n{r['model']}  {r['mesh']}  {r['dataset']} ({r['num_requests']} "
                     f"requests)")
        lines.append(f"{'layout':<24}{'tok/s':>10}{'vs best static':>16}")
        best = r["static_throughput"][r["best_static"]]
        ranked = sorted(r["static_throughput"].items(), key=lambda kv: -kv[1])
        for name, tps in ranked:
            lines.append(f"{'static ' + name:<24}{tps:>10.0f}{tps / best:>15.2f}x")
        p = r["planner"]
        lines.append(f"{'planner ' + p['label']:<24}{p['throughput']:>10.0f}"
                     f"{r['speedup_over_best_static']:>15.2f}x")
    return "\n".join(lines)


def report(config: ReproduceConfig, log=print) -> list[dict]:
    """Every scenario at `config`'s request count: the table logged, the rows written as
    `config` asks."""
    rows = run(config.requests(NUM_REQUESTS))
    log(format_table(rows))
    write_results(config, rows, log)
    return rows
