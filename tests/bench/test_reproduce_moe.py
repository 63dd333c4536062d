"""The MoE reproduction's table: every feasible (pp, tp, ep) layout simulated, the planner's
pair beside them (a small run; the numbers themselves are the simulator's, tested there)."""

from __future__ import annotations

import pytest

from jaxpipe_bench import reproduce_moe


def test_scenario_simulates_every_feasible_layout_and_the_planners_pair():
    row = reproduce_moe.scenario("mixtral-8x7b", "a800x4-net", "sharegpt", num_requests=24)
    assert set(row["static_throughput"]) == {"pp4", "tp2pp2", "tp4", "ep2pp2", "tp2ep2", "ep4"}
    best = max(row["static_throughput"].values())
    assert row["static_throughput"][row["best_static"]] == best
    assert row["speedup_over_best_static"] == pytest.approx(row["planner"]["throughput"] / best)
    assert row["planner_stats"]["finished"] == 24
    table = reproduce_moe.format_table([row])
    assert "static ep4" in table and f"planner {row['planner']['label']}" in table
