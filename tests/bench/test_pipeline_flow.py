"""bench_pipeline's pure parts: its flags' checks, the ratios against one device, the table."""

from __future__ import annotations

import pytest

from jaxpipe.runtime.synthetic_step import fits
from jaxpipe_bench.pipeline_flow import FlowBenchConfig, format_ratios, ratios


def _run(layout, scheduler, tok_s, digest="a", step_ms=None):
    return {"layout": layout, "scheduler": scheduler, "output_tok_s": tok_s,
            "pipeline_bubble_fraction": 0.0 if layout == "cpu-1" else 0.04,
            "tokens_sha256": digest, "step_ms": step_ms}


def test_each_pipelined_run_is_compared_with_its_own_policy_on_one_device():
    runs = [_run("cpu-1", "throttle", 400.0), _run("pp=8", "throttle", 240.0),
            _run("cpu-1", "tdpipe", 500.0), _run("pp=8", "tdpipe", 250.0, digest="b")]
    got = {(r["scheduler"], r["layout"]): r for r in ratios(runs)}
    assert set(got) == {("throttle", "pp=8"), ("tdpipe", "pp=8")}
    assert got["throttle", "pp=8"]["vs_one_device"] == pytest.approx(0.6)
    assert got["tdpipe", "pp=8"]["vs_one_device"] == pytest.approx(0.5)
    assert got["throttle", "pp=8"]["same_tokens"] and not got["tdpipe", "pp=8"]["same_tokens"]


def test_the_table_lists_the_ratios_and_each_runs_step_costs():
    runs = [_run("cpu-1", "throttle", 400.0, step_ms={"16": 131.5, "128": 212.5}),
            _run("pp=8", "throttle", 240.0, step_ms={"16": 68.6, "128": 150.0})]
    table = format_ratios({"runs": runs, "ratios": ratios(runs)}).splitlines()
    assert table[1].split() == ["throttle", "pp=8", "0.60x", "0.040", "True"]
    assert table[3].split() == ["throttle", "cpu-1", "16", "rows", "131.5", "128", "rows",
                                "212.5"]
    assert table[4].split()[:5] == ["throttle", "pp=8", "16", "rows", "68.6"]


def test_a_row_count_whose_micro_batches_do_not_fit_the_pool_is_skipped_not_fatal():
    # The engine's pool in the default run held 1,152 blocks of 16 tokens: 128 rows a
    # micro-batch over pp=8 are 1,024 sequences of 80 positions, 5,120 blocks.
    assert not fits(128 * 8, 80, 1152)
    assert fits(16 * 8, 80, 1152) and fits(128, 80, 1152)
    assert fits(230, 80, 1152) and not fits(231, 80, 1152)  # 5 blocks each
    runs = [_run("cpu-1", "throttle", 400.0, step_ms={"16": 131.5, "128": 212.5}),
            _run("pp=8", "throttle", 240.0, step_ms={"16": 68.6, "128": None})]
    table = format_ratios({"runs": runs, "ratios": ratios(runs)}).splitlines()
    assert table[4].split() == ["throttle", "pp=8", "16", "rows", "68.6", "128", "rows", "-"]


@pytest.mark.parametrize("rows", [(0,), (16, 129)])
def test_step_rows_outside_one_to_max_num_seqs_are_refused(rows):
    with pytest.raises(ValueError, match=r"step_rows \[.*\]: each must be in 1..max_num_seqs=128"):
        FlowBenchConfig(step_rows=rows)
