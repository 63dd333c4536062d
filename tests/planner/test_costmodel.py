"""The cost model's terms on a hand-computed toy case, and the properties the paper relies on."""

from __future__ import annotations

import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import Hardware, load_mesh
from jaxpipe.config.model import ModelConfig
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.costmodel import CostModel

TOY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2)
# round numbers: bytes, bytes/s, FLOP/s
HW = Hardware(memory_bytes=1000, hbm_bandwidth=100, peak_flops=1000, host_link_bandwidth=10,
              p2p_bandwidth=50, allreduce_bandwidth={2: 20})


def toy(pp: int = 1, tp: int = 1) -> CostModel:
    return CostModel(TOY, HW, Layout(pp=pp, tp=tp))


def test_layer_terms_by_hand():
    cm = toy()
    assert cm.layer_params == 2 * 4 * 4 + 2 * 4 * 2 + 3 * 4 * 8 == 144  # W
    assert cm.t_dm_linear() == pytest.approx(2 * 144 / 100)  # 2W / B_hbm
    assert cm.t_comp_linear(10) == pytest.approx(2 * 10 * 144 / 1000)  # 2bsW / F
    assert cm.t_dm_attn(5) == pytest.approx(5 * 2 * 2 * 1 * 2 / 100)  # K,V x 2 B x h_kv x d
    assert cm.t_comp_attn(6) == pytest.approx(4 * 6 * 2 * 2 / 1000)  # 4 x pairs x h x d
    assert cm.t_nw(10) == 0.0  # no TP, no all-reduce
    assert cm.layer_time(10, 6, 5) == pytest.approx(2.88 + 0.4)


def test_tensor_parallel_terms_by_hand():
    cm = toy(tp=2)
    assert cm.t_dm_linear() == pytest.approx(2 * 144 / (2 * 100))
    # bus bandwidth 20 at tp=2 is also the payload bandwidth (2(tp-1)/tp = 1)
    assert cm.t_nw(10) == pytest.approx(4 * 10 * 4 / 20)
    assert cm.kv_heads_stored == 2  # one KV head replicated over two shards


def test_memory_by_hand():
    assert TOY.num_params() == 388
    assert toy().kv_bytes_per_token == 2 * 2 * 2 * 1 * 2 == 16
    assert toy().kv_capacity_tokens() == (900 - 776) // 16  # (u M - 2P) / kv per token
    assert toy(tp=2).kv_capacity_tokens() == (1800 - 776) // 32
    assert toy().b_max(3) == 7 // 3
    assert not toy().fits(8) and toy().fits(7)


def test_transfer_costs_by_hand():
    cm = toy(tp=2)
    assert cm.reshard_seconds(Layout(tp=2)) == 0.0
    assert cm.reshard_seconds(Layout(pp=2)) == pytest.approx(776 / (2 * 10))
    assert cm.swap_seconds(5) == pytest.approx(5 * 32 / (2 * 10))


def test_decode_with_pp_runs_b_over_pp_per_forward_and_pp_forwards_per_step():
    cm = toy(pp=2)
    b, s = 8, 3
    per_forward = cm.stage_time(b / 2, b * s / 2, b * (s + 1) / 2, b / 2)
    assert cm.decode_time(b, s) == pytest.approx(2 * per_forward)
    assert toy(pp=2).t_p2p(4) == pytest.approx(2 * 4 * 4 / 50)


def test_prefill_keeps_the_pipeline_full():
    cm = toy(pp=2)
    one = cm.prefill_time(1, 4)  # one sequence: one micro-batch
    assert one == pytest.approx(cm.stage_time(4, 10, 4, 1))


@pytest.fixture(scope="module")
def llama70b():
    return resolve_model("llama2-70b").config


def test_more_tp_less_weight_time_more_network_time(llama70b):
    hw = load_mesh("a10x8-pcie").hardware
    cms = [CostModel(llama70b, hw, Layout(pp=8 // tp, tp=tp)) for tp in (1, 2, 4, 8)]
    dm = [c.t_dm_linear() for c in cms]
    nw = [c.t_nw(256) for c in cms]
    assert dm == sorted(dm, reverse=True) and len(set(dm)) == 4
    assert nw == sorted(nw) and nw[0] == 0.0 and len(set(nw)) == 4


def test_b_max_grows_with_devices(llama70b):
    hw = load_mesh("a100x8-nvlink").hardware
    caps = [CostModel(llama70b, hw, Layout(tp=n)).b_max(3000) for n in (2, 4, 8)]
    assert caps == sorted(caps) and len(set(caps)) == 3


def test_decode_prefers_tp_and_prefill_prefers_pp_on_pcie(llama70b):
    hw = load_mesh("a10x8-pcie").hardware
    pp8, tp8 = (CostModel(llama70b, hw, x) for x in (Layout(pp=8), Layout(tp=8)))
    assert pp8.prefill_time(16, 1000) < tp8.prefill_time(16, 1000)
    assert tp8.decode_time(64, 1000) < pp8.decode_time(64, 1000)
