"""Calibration bookkeeping (no timing): the table's arithmetic, the preset writer, and that the
steps timed are the steps the cost model is asked about."""

from __future__ import annotations

import shutil

import pytest

from jaxpipe.config import meshes
from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import Hardware, load_mesh
from jaxpipe.config.model import ModelConfig
from jaxpipe.planner.costmodel import CostModel
from jaxpipe_bench import calibrate
from jaxpipe_bench.calibrate import Shape

TOY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2)
HW = Hardware(memory_bytes=1000, hbm_bandwidth=100, peak_flops=1000, host_link_bandwidth=10,
              p2p_bandwidth=50)
MEASURED = {"hbm_gbps": 12.5, "peak_tflops": 0.5977, "host_link_gbps": 11.0, "p2p_gbps": 11.0,
            "allreduce_gbps": {1: 11.0}}


def test_comparison_rows_and_table():
    shapes = [Shape("prefill", 4, 128), Shape("decode", 16, 256)]
    rows = calibrate.comparison(shapes, [0.2, 0.05], [1.0, 0.1], [1e11, 5e9])
    assert [r["ratio"] for r in rows] == pytest.approx([5.0, 2.0])
    assert rows[0]["predicted_ms"] == pytest.approx(200.0)
    assert rows[1]["measured_ms"] == pytest.approx(100.0)
    assert [r["achieved_gflops"] for r in rows] == pytest.approx([100.0, 50.0])
    table = calibrate.format_table(rows).splitlines()
    assert "measured/predicted" in table[0]
    assert table[1].split() == ["prefill", "4", "128", "200.0", "1000.0", "5.00", "100"]
    assert table[2].split() == ["decode", "16", "256", "50.0", "100.0", "2.00", "50"]


def test_step_flops_by_hand():
    cm = CostModel(TOY, HW, Layout())
    # W = 144 per layer; prefill 2 prompts x 3 tokens: 6 tokens, 2 * 3*4/2 = 12 pairs
    assert calibrate.step_flops(cm, Shape("prefill", 2, 3)) == pytest.approx(
        2 * (2 * 6 * 144 + 4 * 12 * 2 * 2) + 2 * 2 * 10 * 4)
    # decode 2 sequences over 5 positions: 2 tokens, 10 pairs
    assert calibrate.step_flops(cm, Shape("decode", 2, 5)) == pytest.approx(
        2 * (2 * 2 * 144 + 4 * 10 * 2 * 2) + 2 * 2 * 10 * 4)


def test_step_flops_count_experts_in_the_moe_layers_only():
    mixed = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=0, num_layers=3,
                        num_heads=2, num_kv_heads=1, head_dim=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=3, dense_layers=(1,),
                        dense_intermediate_size=5)
    cm = CostModel(mixed, HW, Layout())
    # decode 2 sequences over 5 positions: 2 tokens, 10 pairs. MoE layers: attention 48 +
    # router 16, 2 experts of 3*4*3 = 36 per token; the dense layer: attention 48 + MLP 60
    assert calibrate.step_flops(cm, Shape("decode", 2, 5)) == pytest.approx(
        2 * 2 * (2 * 64 + 108) + 2 * 2 * (2 * 2 * 36) + 3 * 4 * 10 * 2 * 2 + 2 * 2 * 10 * 4)


def test_predict_asks_the_cost_model_for_the_calibrated_shapes():
    cm = CostModel(TOY, HW, Layout())
    assert calibrate.predict(cm, Shape("prefill", 4, 128)) == cm.prefill_time(4, 128)
    assert calibrate.predict(cm, Shape("decode", 16, 256)) == cm.decode_time(16, 256)
    shapes = calibrate.calibration_shapes()
    assert [(s.phase, s.batch) for s in shapes] == (
        [("prefill", b) for b in calibrate.PREFILL_BATCHES]
        + [("decode", b) for b in calibrate.DECODE_BATCHES])



def test_steps_timed_are_the_shapes_predicted():
    """4 prompts of 128 tokens (each row a 128-token span attending over 128 keys); decode:
    16 rows of one token attending over the 256 positions the cost model's decode reads."""
    from types import SimpleNamespace

    from jaxpipe.runtime.buckets import Buckets
    from jaxpipe.runtime.synthetic_step import uniform_inputs

    runner = SimpleNamespace(buckets=Buckets.for_engine(16, 512, 512), num_blocks=256,
                             max_blocks=32)
    prefill = uniform_inputs(runner, *calibrate.step_args(Shape("prefill", 4, 128)))
    assert prefill.q_len[:4].tolist() == [128] * 4 == prefill.kv_len[:4].tolist()
    assert (prefill.rows < 4).sum() == 4 * 128
    decode = uniform_inputs(runner, *calibrate.step_args(Shape("decode", 16, 256)))
    assert decode.q_len[:16].tolist() == [1] * 16
    assert decode.kv_len[:16].tolist() == [256] * 16
    assert decode.positions.reshape(-1)[:16].tolist() == [255] * 16


def test_update_hardware_keeps_comments_and_order():
    text = ("[layouts]\nprefill = \"pp=1\"\n\n[hardware]  # note\nmemory_gb = 20\n"
            "hbm_gbps = 15  # read, GB/s\nallreduce_gbps = { 1 = 15.0 }  # unused\n")
    out = calibrate.update_hardware(text, {"hbm_gbps": 12.5, "allreduce_gbps": {1: 11.0}})
    assert out == ("[layouts]\nprefill = \"pp=1\"\n\n[hardware]  # note\nmemory_gb = 20\n"
                   "hbm_gbps = 12.5  # read, GB/s\nallreduce_gbps = { 1 = 11.0 }  # unused\n")
    with pytest.raises(ValueError, match="peak_tflops"):
        calibrate.update_hardware(text, {"peak_tflops": 1.0})


def test_written_presets_load(tmp_path, monkeypatch):
    for name in ("cpu-1", "cpu-8"):
        shutil.copy(meshes.MESH_DIR / f"{name}.toml", tmp_path)
    before = (meshes.MESH_DIR / "cpu-1.toml").read_text()
    calibrate.write_preset(MEASURED, "cpu-1", tmp_path)
    calibrate.write_preset(calibrate.split(MEASURED, 8), "cpu-8", tmp_path)
    assert (meshes.MESH_DIR / "cpu-1.toml").read_text() == before  # the real file untouched
    monkeypatch.setattr(meshes, "MESH_DIR", tmp_path)
    one, eight = load_mesh("cpu-1").hardware, load_mesh("cpu-8").hardware
    assert one == calibrate.with_constants(one, MEASURED)
    assert one.hbm_bandwidth == pytest.approx(12.5e9)
    assert one.peak_flops == pytest.approx(0.5977e12)
    assert one.allreduce_bandwidth == {1: pytest.approx(11e9)}
    assert eight.hbm_bandwidth == pytest.approx(12.5e9 / 8, rel=1e-3)
    assert eight.peak_flops == pytest.approx(0.5977e12 / 8, rel=1e-3)
    assert eight.allreduce_bandwidth[8] == pytest.approx(1e9)  # not measured, kept
    assert "# bf16 matmul" in (tmp_path / "cpu-1.toml").read_text()


def test_format_hardware_is_preset_toml():
    import tomllib

    table = tomllib.loads(calibrate.format_hardware(MEASURED))["hardware"]
    assert table == {**MEASURED, "allreduce_gbps": {"1": 11.0}}
