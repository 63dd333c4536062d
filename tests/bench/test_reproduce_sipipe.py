"""The SiPipe reproduction's table: the paper's models and PP configurations, SiPipe's row
beating vLLM's (a small run; the host model itself is tested in tests/planner)."""

from __future__ import annotations

from jaxpipe_bench import reproduce_sipipe


def test_table_has_the_papers_rows_and_sipipe_beats_vllm():
    rows = reproduce_sipipe.compare(num_requests=12)
    assert [(r["model"], r["config"]) for r in rows] == [
        (m, c) for m, _ in reproduce_sipipe.MODELS for c, _ in reproduce_sipipe.LAYOUTS]
    for r in rows:
        assert r["throughput"]["SiPipe"] > r["throughput"]["vLLM (PP)"]
        assert r["throughput"]["token-safe"] > r["throughput"]["vLLM (PP)"]
        assert r["gain"] > 1.0
    table = reproduce_sipipe.format_compare(rows)
    assert "P^4_2" in table and "paper: 1.6-2.1x" in table


def test_only_the_vllm_row_runs_on_virtual_engines_and_one_row_token_safe():
    methods = reproduce_sipipe.METHODS.items()
    assert {m for m, (_, _, ve, _) in methods if ve} == {"vLLM (PP)"}
    assert {m for m, (_, _, _, safe) in methods if safe} == {"token-safe"}
