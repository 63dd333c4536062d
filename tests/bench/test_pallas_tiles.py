"""scripts/bench_pallas_tiles.py's logic: the bytes and flops of a shape, the choice of the best
tiles, and a tiny sweep run interpreted on the CPU (every point checked against the XLA path)."""

from __future__ import annotations

import pytest

from jaxpipe_bench import pallas_tiles as pt


def point(kind, rows, ms, tq, **shape):
    return {"kind": kind, "rows": rows, "ms": ms, **shape,
            "tiles": {"tq": tq, "num_warps": None, "num_stages": None}}


def test_best_tiles_minimise_the_geometric_mean_over_shapes_they_all_ran():
    points = [point("decode", 1, 1.0, 4, context=128), point("decode", 1, 2.0, 16, context=128),
              point("decode", 64, 4.0, 4, context=128), point("decode", 64, 1.0, 16, context=128),
              point("decode", 64, 0.5, 32, context=128),  # best there, but ran one shape only
              {**point("decode", 1, 0, 32, context=128), "ms": None}]
    points[-1].pop("ms")
    points[-1]["error"] = "lowering failed"
    best = pt.best_tiles(points, "decode")
    # tq=4: 1/1 and 4/0.5 -> geomean 2.83; tq=16: 2/1 and 1/0.5 -> 2.0
    assert best["tiles"]["tq"] == 16
    assert best["geomean_vs_best"] == pytest.approx(2.0)
    assert pt.best_tiles(points, "prefill") is None


def test_a_shape_reads_each_rows_kv_once_and_attends_causally():
    cfg = pt.SweepConfig(heads=8, kv_heads=2, head_dim=16)
    decode = {"kind": "decode", "rows": 3, "q_len": [1] * 3, "kv_len": [10] * 3}
    assert pt.kv_bytes(cfg, decode) == 30 * 2 * 16 * 2 * 2
    prefill = {"kind": "prefill", "rows": 1, "q_len": [4], "kv_len": [4]}
    assert pt.attention_flops(cfg, prefill) == 4 * 8 * 16 * (1 + 2 + 3 + 4)
    assert pt.attention_flops(cfg, decode) == 4 * 8 * 16 * 30


@pytest.mark.parametrize("bad", [dict(heads=6, kv_heads=4), dict(tq=(0,)), dict(num_warps=()),
                                 dict(num_stages=(-1,))])
def test_the_sweep_refuses_what_it_cannot_run(bad):
    with pytest.raises(ValueError, match="SweepConfig"):
        pt.SweepConfig(**bad)


def test_an_interpreted_sweep_checks_every_point_against_the_xla_path():
    cfg = pt.SweepConfig(heads=6, kv_heads=2, head_dim=16, decode_rows=(3,), contexts=(40,),
                         prefill_chunks=(20,), tq=(2, 8), num_warps=(0,), repeats=1,
                         interpret=True)
    saved = []
    record = pt.sweep(cfg, save=saved.append, log=lambda _: None)
    assert len(record["points"]) == 4 and len(saved) == 4
    assert all(p["max_abs_err"] < 2e-2 for p in record["points"])  # bf16 pool
    assert record["best"]["decode"]["tiles"]["tq"] in (2, 8)
    assert "decode 3x40" in pt.format_table(record)
