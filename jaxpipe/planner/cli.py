"""`python -m jaxpipe.planner --model llama2-70b --mesh a10x8-pcie --workload sharegpt`: the
planner's table of predicted throughput per layout and its choice of (c_p, c_d)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from jaxpipe.config.checks import check_counts
from jaxpipe.config.flags import add_flags, config_from_args
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.loading import source_config
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.planner import HOST_KV_GB, format_plan, plan
from jaxpipe.planner.workloads import DEFAULT_NUM_REQUESTS, make_workload


@dataclass(frozen=True)
class PlanConfig:
    """What `python -m jaxpipe.planner` plans for (its flags).

    model: what EngineConfig.model accepts: a preset in models/, a .gguf file, an HF directory
        or an orbax checkpoint (only its metadata is read)
    mesh: a preset in meshes/
    workload: sharegpt, sharegpt-1k or arxiv (seeded length draws), or constant:IN:OUT
    num_requests: requests in the workload
    seed: seeds the workload's draws
    host_kv_gb: the host KV tier, GB of pinned host memory
    """

    model: str = "llama2-70b"
    mesh: str = "a10x8-pcie"
    workload: str = "sharegpt"
    num_requests: int = DEFAULT_NUM_REQUESTS
    seed: int = 0
    host_kv_gb: float = HOST_KV_GB

    def __post_init__(self):
        check_counts(self, "num_requests")
        if isinstance(self.host_kv_gb, bool) or not isinstance(self.host_kv_gb, (int, float)) \
                or self.host_kv_gb < 0:
            raise ValueError(f"PlanConfig.host_kv_gb must be a number >= 0, "
                             f"got {self.host_kv_gb!r}")
        make_workload(self.workload, 1, self.seed)  # refuses an unknown workload


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxpipe.planner", description=__doc__)
    add_flags(ap, PlanConfig, group="plan")
    cfg = config_from_args(PlanConfig, ap.parse_args(argv), ap)
    try:
        config = source_config(resolve_model(cfg.model))
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"python -m jaxpipe.planner: {err}") from None
    mesh = load_mesh(cfg.mesh)
    w = make_workload(cfg.workload, cfg.num_requests, cfg.seed)
    print(format_plan(plan(config, mesh, w, cfg.host_kv_gb), cfg.model, cfg.mesh))

