"""The cost model's mixture-of-experts terms (parameters, experts touched, ep) and the
planner's (pp, tp, ep) choices for MoE models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import Hardware, load_mesh
from jaxpipe.config.model import ModelConfig
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner import cli as plan_cli
from jaxpipe.planner import layout_name, plan
from jaxpipe.planner.costmodel import CostModel, expected_distinct_experts
from jaxpipe.planner.planner import candidate_layouts, pair_throughput, paper_label
from jaxpipe.planner.simulate import simulate
from jaxpipe.planner.workloads import constant, synthetic

# E=4, 2 heads of 2, 1 KV head, 4 experts of width 3, 2 per token, no shared expert
TOY_MOE = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=0, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=3)
HW = Hardware(memory_bytes=1000, hbm_bandwidth=100, peak_flops=1000, host_link_bandwidth=10,
              p2p_bandwidth=50, allreduce_bandwidth={2: 20})


@pytest.fixture(scope="module")
def qwen3_moe():
    return resolve_model("qwen3-30b-a3b").config


def test_qwen3_30b_a3b_parameter_counts(qwen3_moe):
    """~30.5B parameters, ~3.3B active per token (Qwen's '30B-A3B'), by hand from the config."""
    c = qwen3_moe
    e, v, layers = c.hidden_size, c.vocab_size, c.num_layers
    attn = 2 * e * c.num_heads * c.head_dim + 2 * e * c.num_kv_heads * c.head_dim
    norms = 2 * e + 2 * c.head_dim  # input / post-attention norms, q / k norms
    expert = 3 * e * c.moe_intermediate_size
    shared = layers * (attn + norms + e * c.num_experts) + e + 2 * v * e  # + final norm, emb, head
    total = shared + layers * c.num_experts * expert
    active = shared + layers * c.num_experts_per_tok * expert
    cm = CostModel(c, load_mesh("h100x8-nvlink").hardware, Layout(tp=8))
    assert c.num_params() == total and 30.4e9 < total < 30.6e9
    assert cm.active_params == active and 3.2e9 < active < 3.4e9
    assert cm.expert_params == expert and cm.layer_params == attn + e * c.num_experts


@pytest.mark.parametrize("experts, k, tokens", [(128, 8, 1), (128, 8, 7), (128, 8, 40),
                                                (8, 2, 3), (8, 2, 12), (60, 4, 25)])
def test_expected_distinct_experts_against_monte_carlo(experts, k, tokens):
    """Draw each token's k distinct experts uniformly and count the experts touched."""
    rng = np.random.default_rng(experts * 1000 + tokens)
    trials = 4000
    picks = rng.random((trials, tokens, experts)).argsort(-1)[..., :k]  # [N, T, k]
    touched = np.zeros((trials, experts), bool)
    np.put_along_axis(touched, picks.reshape(trials, -1), True, axis=1)
    counts = touched.sum(1)
    sem = counts.std() / np.sqrt(trials)
    got = expected_distinct_experts(tokens, experts, k)
    assert abs(got - counts.mean()) < 4 * sem + 1e-9
    assert expected_distinct_experts(1, experts, k) == pytest.approx(k)


def test_decode_reads_most_experts_at_a_moderate_batch(qwen3_moe):
    cm = CostModel(qwen3_moe, load_mesh("h100x8-nvlink").hardware, Layout(tp=8))
    assert cm.expected_experts(32) > 0.85 * 128  # 32 tokens already touch ~112 of 128
    # so a 32-token decode step reads ~14x the expert weights of a 1-token step (8 experts)
    assert cm.t_dm_experts(32) / cm.t_dm_experts(1) == pytest.approx(
        cm.expected_experts(32) / 8)


def test_moe_terms_by_hand():
    cm = CostModel(TOY_MOE, HW, Layout(ep=2))
    assert cm.layer_params == 2 * 4 * 4 + 2 * 4 * 2 + 4 * 4 == 64  # attention + router
    assert cm.expert_params == 3 * 4 * 3 == 36
    touched = 4 * (1 - 0.5 ** 10)  # X (1 - (1 - k/X)^T)
    assert cm.t_dm_experts(10) == pytest.approx(2 * touched * 36 / (2 * 100))
    assert cm.t_comp_experts(10) == pytest.approx(2 * 10 * 2 * 36 / (2 * 1000))
    # the engine's psum over ep=2 of the experts' [10, E=4] output, 2 bytes a value: a ring
    # of 2 moves 2(2-1)/2 = 1 payload over each link at the bus bandwidth 20
    assert cm.t_ep(10) == pytest.approx(10 * 4 * 2 * 1 / 20)
    assert cm.t_experts(10) == pytest.approx(
        max(cm.t_dm_experts(10), cm.t_comp_experts(10)) + 10 * 4 * 2 / 20)
    assert CostModel(TOY_MOE, HW, Layout(tp=2)).t_ep(10) == 0.0
    # 516 parameters, 228 outside the experts (stored twice under ep=2)
    assert TOY_MOE.num_params() == 516 and cm.non_expert_params == 516 - 2 * 4 * 36
    assert cm.active_params == 228 + 2 * 2 * 36
    assert cm.stored_weight_bytes == 2 * (516 + 228)
    assert cm.weight_bytes_per_device() == 2 * (516 + 228) / 2
    # every ep group stores the KV: (0.9 x 1000 x 2 - 1488) / (16 bytes x 2 copies)
    assert cm.kv_capacity_tokens() == 9
    assert cm.swap_seconds(5) == pytest.approx(5 * 16 * 2 / (2 * 10))


def test_a_mixed_model_runs_experts_only_in_its_moe_layers_by_hand():
    """TOY_MOE with a third layer, layer 1 a dense MLP of width 5. Compute-bound (100 tokens,
    tp = pp = ep = 1, no attention pairs): the stage's time is its FLOPs / F by hand."""
    mixed = dataclasses.replace(TOY_MOE, num_layers=3, dense_layers=(1,),
                                dense_intermediate_size=5)
    cm = CostModel(mixed, HW, Layout())
    attention = 2 * 4 * 4 + 2 * 4 * 2
    assert cm.layer_params == attention + 4 * 4  # + the router, no shared expert
    assert cm.dense_layer_params == attention + 3 * 4 * 5  # its MLP; no router, no experts
    assert cm.moe_layers == 2 and cm.active_params == cm.non_expert_params + 2 * 2 * 36
    t = 100
    linear = 2 * t * (2 * (attention + 16) + (attention + 60))  # 2 MoE layers + 1 dense
    experts = 2 * t * 2 * 36 * 2  # k = 2 experts of 36 parameters, in the 2 MoE layers only
    head = 2 * 10 * 4 / 100  # no rows sampled: the LM head's weight read
    assert cm.stage_time(t, 0, 0, 0) == pytest.approx((linear + experts) / 1000 + head)
    assert cm.layer_time(t, 0, 0, dense=True) == pytest.approx(2 * t * (attention + 60) / 1000)


def test_ep_all_reduce_of_every_moe_layer_by_hand():
    """The mixed toy at ep=2 on a ring of 4 (tp=2 x ep=2; bus bandwidth 20 at 2, 12 at 4):
    the stage pays one all-reduce of the experts' [T, E] output over ep in each of its 2 MoE
    layers, none in the dense one, beside every layer's two tp all-reduces."""
    mixed = dataclasses.replace(TOY_MOE, num_layers=3, dense_layers=(1,),
                                dense_intermediate_size=5)
    hw = dataclasses.replace(HW, allreduce_bandwidth={2: 20, 4: 12})
    t = 100
    base = CostModel(mixed, hw, Layout(tp=2))
    ep2 = CostModel(mixed, hw, Layout(tp=2, ep=2))
    ep4 = CostModel(mixed, hw, Layout(ep=4))
    ring2 = t * 4 * 2 * (2 * (2 - 1) / 2) / 20  # bytes x 2(n-1)/n / busbw
    ring4 = t * 4 * 2 * (2 * (4 - 1) / 4) / 12
    assert ep2.t_ep(t) == pytest.approx(ring2) and ep4.t_ep(t) == pytest.approx(ring4)
    assert base.t_ep(t) == 0.0
    assert ep2.t_nw(t) == pytest.approx(2 * ring2)  # tp's two all-reduces, same helper
    # the expert shares halve under ep=2 (experts split over tp x ep), the rest is the same
    assert ep2.layers_time(t, 0, 0) - base.layers_time(t, 0, 0) == pytest.approx(
        2 * (ring2 + max(ep2.t_dm_experts(t), ep2.t_comp_experts(t))
             - max(base.t_dm_experts(t), base.t_comp_experts(t))))


def test_ep_must_divide_the_experts():
    with pytest.raises(ValueError, match="ep=8 must divide the model's experts \\(4"):
        CostModel(TOY_MOE, HW, Layout(ep=8))
    dense = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="dense model takes ep=1 only"):
        CostModel(dense, HW, Layout(ep=2))
    # 8 devices, 6 experts: ep in {1, 2}; 128 experts: {1, 2, 4, 8}; dense: ep = 1 only
    assert {x.ep for x in candidate_layouts(8, 6)} == {1, 2}
    assert {x.ep for x in candidate_layouts(8, 128)} == {1, 2, 4, 8}
    assert candidate_layouts(8, 0) == candidate_layouts(8)
    assert all(x.num_devices == 8 for x in candidate_layouts(8, 128))
    assert len(candidate_layouts(8, 128)) == 4 + 3 + 2 + 1
    assert layout_name(Layout(tp=2, ep=4)) == "tp2ep4"
    assert paper_label(Layout(pp=2, tp=2, ep=2)) == "T2E2P2"


def test_memory_feasibility_counts_replicated_weights_and_kv(qwen3_moe):
    """Mixtral-sized experts on 4 x 24 GB: ep4 holds 1/4 of the experts but all of the rest."""
    mixtral = resolve_model("mixtral-8x7b").config
    mesh = load_mesh("a10x8-pcie")
    ep8 = CostModel(mixtral, mesh.hardware, Layout(ep=8))
    expert_bytes = 2 * mixtral.num_layers * 8 * ep8.expert_params
    assert ep8.weight_bytes_per_device() == pytest.approx(
        2 * ep8.non_expert_params + expert_bytes / 8)
    assert ep8.fits(1)  # 2.2 GB replicated + 11.3 GB of experts per 24 GB device
    cm = CostModel(qwen3_moe, load_mesh("h100x8-nvlink").hardware, Layout(ep=8))
    tp8 = CostModel(qwen3_moe, load_mesh("h100x8-nvlink").hardware, Layout(tp=8))
    assert cm.kv_capacity_tokens() < tp8.kv_capacity_tokens() / 3  # 8 copies of 4 heads vs 8


def test_qwen3_moe_plan_on_h100_keeps_ep_at_1_and_why(qwen3_moe):
    """Every ep layout is feasible and priced, but tp8 wins decode: with attention and the
    non-expert weights replicated over ep (the engine's sharding), ep8 reads 4 KV heads per
    device (tp8: 1) and the full dense weights, which outweighs the NVLink all-reduce it saves."""
    mesh = load_mesh("h100x8-nvlink")
    p = plan(qwen3_moe, mesh, synthetic("sharegpt", 300))
    assert {e.layout.ep for e in p.estimates} == {1, 2, 4, 8}
    assert p.prefill.layout.ep == 1 and p.decode.layout.ep == 1
    by = {e.name: e for e in p.estimates}
    assert by["tp8"].decode_tps > max(e.decode_tps for e in p.estimates if e.layout.ep > 1)
    tp8, ep8 = by["tp8"].cost, by["ep8"].cost
    t, ctx = 128, 500  # one decode step's layer terms
    assert ep8.t_experts(t) == pytest.approx(tp8.t_experts(t) + ep8.t_ep(t))  # same shares
    assert ep8.t_dm_attn(t * ctx) == 4 * tp8.t_dm_attn(t * ctx)
    assert ep8.t_dm_linear() == 8 * tp8.t_dm_linear()
    assert ep8.t_ep(t) == pytest.approx(tp8.t_nw(t) / 2)  # one all-reduce over 8, not two


def test_moe_plan_picks_ep_where_all_reduce_is_slow():
    """Mixtral (8 experts, 2 per token) on 4 A800s linked by a network: the tp all-reduce of
    every token costs more than dispatching it to its 2 experts: ep4 decodes fastest and is the
    best static layout; prefill goes to pp4 (no collective at all)."""
    mixtral = resolve_model("mixtral-8x7b").config
    p = plan(mixtral, load_mesh("a800x4-net"), synthetic("sharegpt", 300))
    assert p.prefill.layout == Layout(pp=4) and p.decode.layout == Layout(ep=4)
    assert p.decode.decode_tps == max(e.decode_tps for e in p.estimates)
    assert p.best_static.layout == Layout(ep=4)
    assert p.static_throughput > max(pair_throughput(e, e, p.workload)
                                     for e in p.estimates if e.layout.ep == 1)


def test_simulate_an_ep_layout_finishes_every_request():
    mixtral = resolve_model("mixtral-8x7b").config
    mesh, w = load_mesh("a800x4-net"), constant(24, 200, 16)
    r = simulate(mixtral, mesh, w, "seesaw", Layout(ep=4), Layout(tp=2, ep=2))
    assert r.finished == 24 and r.stats.tokens_generated == 24 * 16
    assert r.prefill == "ep4" and r.decode == "tp2ep2"


def test_cli_prints_the_chosen_pp_tp_ep_per_phase(capsys):
    plan_cli.main(["--model", "qwen3-30b-a3b", "--mesh", "h100x8-nvlink",
                   "--num-requests", "100"])
    out = capsys.readouterr().out
    assert "chosen (pp, tp, ep): prefill (" in out
    for name in ("tp8", "ep8", "tp2ep4", "tp4ep2"):
        assert f"\n{name} " in out
