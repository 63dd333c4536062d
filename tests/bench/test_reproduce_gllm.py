"""The gLLM reproduction's table: the paper's scenarios, and vLLM's host time on the vLLM row
only (a small run; the host model itself is tested in tests/planner)."""

from __future__ import annotations

from jaxpipe_bench import reproduce_gllm


def test_the_same_policy_on_vllms_runtime_is_slower_than_on_gllms():
    rows = reproduce_gllm.compare(num_requests=12)
    assert [r["scenario"] for r in rows] == [s for s, _, _ in reproduce_gllm.SCENARIOS]
    for r in rows:
        assert r["throughput"]["gLLM w/ CK"] > r["throughput"]["vLLM (PP, Sarathi)"]
        assert r["gain"]["vLLM (PP, Sarathi)"] > r["gain"]["gLLM w/ CK"]
    assert "gLLM w/ CK" in reproduce_gllm.format_compare(rows)


def test_only_the_vllm_row_runs_on_virtual_engines():
    ve = {m for m, (_, _, opts) in reproduce_gllm.METHODS.items()
          if opts.get("virtual_engines")}
    assert ve == {"vLLM (PP, Sarathi)"}
