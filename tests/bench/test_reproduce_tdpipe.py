"""The TD-Pipe reproduction's Fig. 11 table: the paper's scenarios and baselines, the vLLM
baselines with vLLM's host time (a small run; the host model itself is tested in
tests/planner)."""

from __future__ import annotations

from jaxpipe.planner.hostcost import NO_HOST, VLLM_PP
from jaxpipe.planner.simulate import simulate
from jaxpipe.planner.workloads import synthetic
from jaxpipe_bench import reproduce_tdpipe


def test_a_baseline_with_vllms_host_time_is_slower_than_without():
    rows = reproduce_tdpipe.overall(num_requests=12)
    assert [r["scenario"] for r in rows] == [s for s, _, _ in reproduce_tdpipe.SCENARIOS]
    assert all(set(r["speedup"]) == set(reproduce_tdpipe.PAPER_BEST) for r in rows)
    model, mesh = reproduce_tdpipe._scenario("A100 + 32B")
    policy, layout, opts = reproduce_tdpipe.METHODS["PP+SB"]
    w = synthetic("sharegpt-1k", 12, seed=0)
    with_host = simulate(model, mesh, w, policy, layout, **opts).throughput
    without = simulate(model, mesh, w, policy, layout, **{**opts, "host_cost": NO_HOST})
    assert opts["host_cost"] is VLLM_PP and with_host < without.throughput
    row = next(r for r in rows if r["scenario"] == "A100 + 32B")
    assert row["throughput"]["PP+SB"] == with_host  # the table ran this very simulation


def test_only_the_vllm_pp_baselines_run_on_virtual_engines():
    ve = {m for m, (_, _, opts) in reproduce_tdpipe.METHODS.items()
          if opts.get("virtual_engines")}
    assert ve == {"PP+SB", "PP+HB"}
