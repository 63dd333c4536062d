"""Reproduce the Seesaw paper's Fig. 13 and Fig. 10 in simulation (scripts/reproduce_seesaw.py).

Static layouts run `prefill_first` with chunked prefill (the paper's vLLM baseline); seesaw runs
the `seesaw` policy on the pair `choose_layouts` picks for the workload. Constants are the mesh
presets' and the planner's, identical for every scenario: nothing is tuned per point.

Stand-ins, stated where they are used: the paper's 15B model is replaced by the `llama2-13b`
preset (the closest Llama-family preset), and its 4-GPU runs use the first 4 devices of the
8-GPU presets.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxpipe.config.checks import check_counts
from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import MeshPreset, load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.planner import candidate_layouts, choose_layouts, layout_name, paper_label
from jaxpipe.planner.simulate import simulate
from jaxpipe.planner.workloads import constant, synthetic

QUICK = 4  # --quick simulates 1/QUICK of the requests
TOLERANCE = 0.15  # within 15% of a paper's headline counts as reproduced (issue 48)


def against_paper(simulated: float, paper: float) -> str:
    """'within 15%' of the paper's figure, or how far from it ('-55%')."""
    off = simulated / paper - 1
    return f"within {TOLERANCE:.0%}" if abs(off) <= TOLERANCE else f"{off:+.0%}"


@dataclass(frozen=True)
class ReproduceConfig:
    """One paper reproduction's run (the flags of scripts/reproduce_*.py, jaxpipe.config.flags).

    json_path: write the results as JSON here (none: only the tables)
    quick: a quarter of the requests (a smoke run)
    num_requests: requests of each simulated scenario (none: the reproduction's own)
    """

    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})
    quick: bool = False
    num_requests: int | None = None

    def __post_init__(self):
        check_counts(self, "num_requests")

    def requests(self, default: int) -> int:
        """`num_requests` (else `default`), 1/QUICK of it under `quick`."""
        n = self.num_requests or default
        return n // QUICK if self.quick else n


def write_results(config: ReproduceConfig, results, log: Callable[[str], None]) -> None:
    """`results` as JSON at `config.json_path` (nothing when it is None)."""
    from jaxpipe_bench.report import write_json

    if config.json_path:
        log(f"wrote {write_json(results, config.json_path)}")


Table = tuple[Callable[[int], list], Callable[[list], str]]  # (rows at n requests, their table)


def report_tables(config: ReproduceConfig, num_requests: int, tables: dict[str, Table],
                  log: Callable[[str], None] = print) -> dict:
    """Each of `tables` at `config`'s request count (`num_requests` its default): the tables
    logged in order, a blank line between; the results (`num_requests` and each table's rows
    under its key) written as `config` asks."""
    n = config.requests(num_requests)
    results = {"num_requests": n}
    for i, (key, (rows_at, format_rows)) in enumerate(tables.items()):
        results[key] = rows_at(n)
        if i:
            log("")
        log(format_rows(results[key]))
    write_results(config, results, log)
    return results


FIG13_OUTPUTS = (1, 16, 64, 128, 256, 512, 1024)
FIG13_LAYOUTS = (Layout(pp=8), Layout(pp=4, tp=2), Layout(pp=2, tp=4), Layout(tp=8))
FIG13_REQUESTS = 256
FIG10_REQUESTS = 1000
# (paper's model, preset standing in for it, devices)
FIG10_MODELS = (("15B", "llama2-13b", 4), ("34B", "codellama-34b", 8), ("70B", "llama2-70b", 8))
FIG10_GPUS = (("A10", "a10x8-pcie"), ("L4", "l4x8-pcie"))
FIG10_DATASETS = ("sharegpt", "arxiv")
PAPER_FIG10 = {"min": 1.06, "max": 1.78, "mean": 1.36}  # seesaw over vLLM, all scenarios
PAPER_FIG13 = ("pp8 best at output length 1; tp2pp4 best in a middle range; tp4pp2 best for "
               "long outputs; seesaw >= every static layout at every point")


def submesh(mesh: MeshPreset, num_devices: int) -> MeshPreset:
    """The same hardware with fewer devices (the paper's 4-GPU runs on 8-GPU nodes)."""
    if num_devices == mesh.num_devices:
        return mesh
    name = mesh.name.replace(f"x{mesh.num_devices}", f"x{num_devices}")
    return dataclasses.replace(mesh, name=name, num_devices=num_devices,
                               prefill=Layout(pp=num_devices), decode=Layout(tp=num_devices))


def fig13(num_requests: int = FIG13_REQUESTS, outputs: tuple[int, ...] = FIG13_OUTPUTS) -> list:
    """70B on 8xA10, input 3000: tokens/s of each static layout and of seesaw per output length."""
    model, mesh = resolve_model("llama2-70b").config, load_mesh("a10x8-pcie")
    rows = []
    for out_len in outputs:
        w = constant(num_requests, 3000, out_len)
        tps = {layout_name(x): simulate(model, mesh, w, "prefill_first", x).throughput
               for x in FIG13_LAYOUTS}
        c_p, c_d = choose_layouts(model, mesh, w)
        tps["seesaw"] = simulate(model, mesh, w, "seesaw", c_p, c_d).throughput
        rows.append({"output_len": out_len, "throughput": tps,
                     "seesaw_layouts": f"{paper_label(c_p)} -> {paper_label(c_d)}"})
    return rows


def static_and_planned(model, mesh, w):
    """The Fig. 10 comparison on one workload: every static layout of the mesh that holds the
    weights plus the longest request under `prefill_first` (chunked), by layout name; the
    best of them; the planner's (prefill, decode) pair; and `seesaw` on that pair."""
    static = {}
    for layout in candidate_layouts(mesh.num_devices, model.num_experts):
        try:
            static[layout_name(layout)] = simulate(model, mesh, w, "prefill_first", layout)
        except ValueError:  # the layout cannot hold the weights plus the longest request
            continue
    best = max(static, key=lambda k: static[k].throughput)
    pair = choose_layouts(model, mesh, w)
    return static, best, pair, simulate(model, mesh, w, "seesaw", *pair)


def fig10_scenario(paper_model: str, preset: str, devices: int, gpu: str, mesh_name: str,
                   dataset: str, num_requests: int = FIG10_REQUESTS) -> dict:
    """Seesaw vs the best static layout (prefill_first, chunked) on one scenario."""
    model, mesh = resolve_model(preset).config, submesh(load_mesh(mesh_name), devices)
    w = synthetic(dataset, num_requests, seed=0)
    static, best, (c_p, c_d), seesaw = static_and_planned(model, mesh, w)
    return {"model": paper_model, "preset": preset, "gpu": f"{devices}x{gpu}",
            "dataset": dataset, "seesaw_speedup": seesaw.throughput / static[best].throughput,
            "seesaw_layouts": f"{paper_label(c_p)} -> {paper_label(c_d)}", "best_static": best,
            "seesaw_throughput": seesaw.throughput,
            "static_throughput": {k: r.throughput for k, r in static.items()},
            "seesaw_stats": seesaw.to_dict() | {"host_timeline": None}}


def fig10(num_requests: int = FIG10_REQUESTS) -> list:
    """Every Fig. 10 scenario (3 models x 2 GPUs x 2 datasets)."""
    return [fig10_scenario(pm, preset, n, gpu, mesh, ds, num_requests)
            for pm, preset, n in FIG10_MODELS for gpu, mesh in FIG10_GPUS
            for ds in FIG10_DATASETS]


def format_fig13(rows: list) -> str:
    names = list(rows[0]["throughput"])
    lines = ["Fig. 13 (llama2-70b, 8xA10 PCIe, input 3000): simulated tokens/s",
             f"{'output':>7}" + "".join(f"{n:>9}" for n in names) + f"{'best static':>13}"
             f"{'seesaw layouts':>18}"]
    for r in rows:
        tps = r["throughput"]
        best = max((k for k in tps if k != "seesaw"), key=tps.get)
        lines.append(f"{r['output_len']:>7}" + "".join(f"{tps[n]:>9.0f}" for n in names)
                     + f"{best:>13}{r['seesaw_layouts']:>18}")
    lines.append(f"paper: {PAPER_FIG13}")
    return "\n".join(lines)


def format_fig10(rows: list) -> str:
    lines = ["Fig. 10: seesaw speedup over the best static layout (prefill_first, chunked)",
             f"{'model':<6}{'preset':<15}{'gpu':<7}{'dataset':<10}{'best static':>12}"
             f"{'seesaw layouts':>18}{'speedup':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<6}{r['preset']:<15}{r['gpu']:<7}"
                     f"{r['dataset']:<10}{r['best_static']:>12}{r['seesaw_layouts']:>18}"
                     f"{r['seesaw_speedup']:>8.2f}x")
    sp = [r["seesaw_speedup"] for r in rows]
    lines.append(f"simulated: {min(sp):.2f}-{max(sp):.2f}x, mean {statistics.fmean(sp):.2f}x   "
                 f"paper: {PAPER_FIG10['min']}-{PAPER_FIG10['max']}x, mean "
                 f"{PAPER_FIG10['mean']}x")
    return "\n".join(lines)


def report(config: ReproduceConfig, log: Callable[[str], None] = print) -> dict:
    """Fig. 13 and Fig. 10 at `config`'s request counts: both tables logged, the results
    written as `config` asks."""
    fig13_rows = fig13(config.requests(FIG13_REQUESTS))
    log(format_fig13(fig13_rows))
    fig10_rows = fig10(config.requests(FIG10_REQUESTS))
    log("")
    log(format_fig10(fig10_rows))
    results = {"fig13": fig13_rows, "fig10": fig10_rows}
    write_results(config, results, log)
    return results
