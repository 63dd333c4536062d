"""`python -m jaxpipe.plan --model llama2-70b --mesh a10x8-pcie --workload sharegpt`: the
planner's table of predicted throughput per layout and its choice of (c_p, c_d)."""

from __future__ import annotations

import argparse

from jaxpipe.meshes import load_mesh
from jaxpipe.model.loading import source_config
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.planner import HOST_KV_GB, format_plan, plan
from jaxpipe.planner.workloads import DEFAULT_NUM_REQUESTS, make_workload


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxpipe.plan", description=__doc__)
    ap.add_argument("--model", default="llama2-70b",
                    help="what EngineConfig.model accepts: a preset in models/, a .gguf file, "
                         "an HF directory or an orbax checkpoint (only its metadata is read)")
    ap.add_argument("--mesh", default="a10x8-pcie", help="a preset in meshes/")
    ap.add_argument("--workload", default="sharegpt",
                    help="sharegpt | arxiv | constant:IN:OUT")
    ap.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-kv-gb", type=float, default=HOST_KV_GB)
    args = ap.parse_args(argv)
    try:
        config = source_config(resolve_model(args.model))
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"python -m jaxpipe.plan: {err}") from None
    mesh = load_mesh(args.mesh)
    w = make_workload(args.workload, args.num_requests, args.seed)
    print(format_plan(plan(config, mesh, w, args.host_kv_gb), args.model, args.mesh))


if __name__ == "__main__":
    main()
