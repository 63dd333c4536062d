"""Padding plans (pure bookkeeping, one device): uneven layer and head splits are padded so that
every layout divides them, and the padded model computes exactly what the unpadded one does.
Placement on 8 devices is tested in tests/multidevice/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpipe import Engine, EngineConfig
from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.model import decoder
from jaxpipe.runtime import sharding

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True)
TINY = ModelConfig(vocab_size=251, hidden_size=37, intermediate_size=53, num_layers=5,
                   num_heads=14, num_kv_heads=7, head_dim=6)


def check_heads(padding: sharding.Padding, cfg: ModelConfig, tp: int) -> None:
    """Every query head appears once; each padded query head uses (through its padded KV head)
    the KV head it used before; each TP shard holds whole groups."""
    q, kv = padding.index["heads"], padding.index["kv_heads"]
    assert sorted(h for h in q if h >= 0) == list(range(cfg.num_heads))
    assert len(q) % tp == 0 and len(kv) % tp == 0 and len(q) % len(kv) == 0
    g_pad = len(q) // len(kv)
    for i, src in enumerate(q):
        if src >= 0:
            assert kv[i // g_pad] == src // cfg.group_size


@pytest.mark.parametrize("tp, heads, kv_heads", [(1, 9, 3), (2, 12, 4), (4, 12, 4),
                                                 (8, 16, 8)])
def test_smollm2_head_padding(tp, heads, kv_heads):
    padding = sharding.padding_for(SMOLLM2, [Layout(tp=tp)])
    assert (len(padding.index["heads"]), len(padding.index["kv_heads"])) == (heads, kv_heads)
    check_heads(padding, SMOLLM2, tp)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_prime_head_padding(tp):
    check_heads(sharding.padding_for(TINY, [Layout(tp=tp)]), TINY, tp)


def test_uneven_pipeline_stages_are_padded_with_identity_layers():
    padding = sharding.padding_for(SMOLLM2, [Layout(pp=8), Layout(tp=8)])
    layers = padding.index["layers"]
    assert len(layers) == 32
    stages = [layers[i:i + 4] for i in range(0, 32, 4)]
    assert [sum(s >= 0 for s in st) for st in stages] == [4, 4, 4, 4, 4, 4, 3, 3]
    assert [s for s in layers if s >= 0] == list(range(30))
    # One padding serves both layouts of an engine: pp=2 and pp=4 split it evenly too.
    assert len(sharding.padding_for(SMOLLM2, [Layout(pp=2), Layout(pp=4)]).index["layers"]) == 32


def test_divisible_layouts_need_no_padding():
    assert sharding.padding_for(SMOLLM2, [Layout(pp=2), Layout(pp=4)]).is_identity is False
    assert sharding.padding_for(SMOLLM2, [Layout(pp=3), Layout(pp=2, tp=3)]).is_identity
    # the vocabulary pads to every device of a layout (the logits split over them all)
    assert not sharding.padding_for(SMOLLM2, [Layout(pp=5), Layout(pp=2, tp=3)]).is_identity


@pytest.mark.parametrize("layouts", [["pp=8", "tp=8"], ["pp=4,tp=2", "tp=4,pp=2"]])
def test_padded_model_gives_the_unpadded_logits(layouts):
    """Head padding, KV-head replication, identity layers, mlp and vocab padding together:
    the padded model on one device equals the unpadded one (whole-sequence forward)."""
    padding = sharding.padding_for(TINY, [Layout.parse(lo) for lo in layouts])
    values = decoder.numpy_random_values(TINY, seed=5)
    model = decoder.Decoder(TINY, values=values)
    sizes = padding.padded_config(TINY)
    assert sizes["num_layers"] > TINY.num_layers and sizes["num_kv_heads"] > TINY.num_kv_heads
    padded_cfg = ModelConfig(**{**TINY.to_dict(), **sizes})
    padded = decoder.Decoder(padded_cfg, values=sharding.pad_values(TINY, values, padding))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 8)), jnp.int32)
    want, got = np.asarray(model.forward(tokens)), np.asarray(padded.forward(tokens))
    np.testing.assert_allclose(got[..., :TINY.vocab_size], want, atol=1e-5, rtol=0)


def test_engine_asks_for_devices_it_cannot_get_any_more():
    jax.devices()  # the backend is running (with one CPU device in this process)
    if len(jax.devices("cpu")) >= 8:
        pytest.skip("this process already has 8 CPU devices")
    with pytest.raises(RuntimeError, match=r"needs 8 CPU devices.*already started with 1"):
        Engine(EngineConfig(mesh="cpu-8", warmup=False, show_progress=False))


MIXTRAL_TINY = ModelConfig(vocab_size=251, hidden_size=37, intermediate_size=0, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=6, num_experts=5,
                           num_experts_per_tok=2, moe_intermediate_size=29)


@pytest.mark.parametrize("layout, experts", [("ep=4,tp=2", "ep"), ("ep=8", "ep"),
                                             ("tp=8", None), ("pp=2,ep=2,tp=2", "ep")])
def test_experts_split_over_ep_and_the_router_never(layout, experts):
    """Each device holds its share of the stacked experts (and of their columns over tp);
    every device keeps the whole router, which scores all experts for every token."""
    decls = decoder.param_decls(MIXTRAL_TINY)
    lo = Layout.parse(layout)
    tp = "tp" if lo.tp > 1 else None
    pp = "pp" if lo.pp > 1 else None
    assert sharding.spec(decls["w_experts_gate_up"].axes, lo) == P(pp, experts, None, None, tp)
    assert sharding.spec(decls["w_experts_down"].axes, lo) == P(pp, experts, tp, None)
    assert sharding.spec(decls["router"].axes, lo) == P(pp, None, None)
    assert sharding.spec(decls["wq"].axes, lo) == P(pp, None, tp, None)  # replicated over ep


def test_experts_pad_with_zero_experts_for_every_ep_degree():
    """5 experts: padded to 8 for ep=4 and ep=8 (one padding serves both layouts), kept at 5
    without ep; the router is never padded, so a zero expert can never be chosen."""
    padding = sharding.padding_for(MIXTRAL_TINY, [Layout(ep=4, tp=2), Layout(ep=8)])
    assert padding.index["experts"] == (0, 1, 2, 3, 4, -1, -1, -1)
    assert "router" not in padding.index
    shapes = sharding.padded_shapes(MIXTRAL_TINY, padding)
    assert shapes["w_experts_gate_up"] == (2, 8, 37, 2, 30)  # moe_mlp 29 -> 30 for tp=2
    assert shapes["router"] == (2, 37, 5)
    plain = sharding.padding_for(MIXTRAL_TINY, [Layout(tp=2)])
    assert plain.index["experts"] == tuple(range(5))


def test_a_dense_model_refuses_expert_parallelism():
    with pytest.raises(ValueError, match=r"ep=2.*needs a mixture-of-experts model"):
        sharding.padding_for(TINY, [Layout(tp=4), Layout(ep=2, tp=2)])


def test_layer_experts_follow_the_padded_layers():
    """A mixed dense/MoE model's per-layer flag in the padded order of pp=2 stages (3 layers:
    stage 0 holds 0, 1; stage 1 holds 2 and an identity layer, which takes the dense path);
    () for a model whose layers are all MoE, so its step traces no per-layer choice."""
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=0, num_layers=3, num_heads=2,
                num_kv_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8)
    mixed = ModelConfig(**base, dense_layers=(1,), dense_intermediate_size=12)
    padding = sharding.padding_for(mixed, [Layout.parse("pp=2")])
    assert sharding.layer_experts(mixed, padding) == (True, False, True, False)
    assert sharding.layer_experts(ModelConfig(**base), padding) == ()
    assert mixed.mlp_width == 12 and decoder.param_decls(mixed)["w_gate_up"].shape[-1] == 12
