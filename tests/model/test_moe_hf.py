"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against HF
transformers on tiny checkpoints it writes with every parameter drawn (routers included, so
tokens spread over the experts): prompt logits of the cache-free forward and greedy tokens
(f32) through the engine's paged step on one device, dense layers among the MoE ones
included; and the router and experts
(`model/moe.py`, both paths) against a float64 NumPy reference on the edge cases: ties
in the router's probabilities, every token to one expert, an expert no token chooses."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import (  # noqa: E402
    PROMPTS,
    assert_forward_matches_hf,
    checkpoint_fixture,
    draw_every_parameter,
    hf_greedy,
)
from hf_moe import EAGER, MODELS, SMALL, write  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.config.model import ModelConfig  # noqa: E402
from jaxpipe.model import hf_dir, moe  # noqa: E402

LOGITS_ATOL = 1e-4
NEW_TOKENS = 16
FAST = dict(dtype="float32", max_model_len=160, warmup=False, show_progress=False)


checkpoints = checkpoint_fixture(write)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_config_reads_the_experts(checkpoints, name):
    cfg = hf_dir.hf_config(json.loads((checkpoints(name)[2] / "config.json").read_text()))
    want = {"qwen3_moe": (8, 2, 23, True, 0, (), 0), "qwen2_moe": (6, 3, 19, False, 37, (), 0),
            "mixtral": (5, 2, 29, True, 0, (), 0),
            "qwen2_moe_mixed": (6, 3, 19, False, 37, (0, 2), 50),
            "qwen3_moe_mixed": (8, 2, 23, True, 0, (1,), 41)}[name]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.intermediate_size, cfg.dense_layers,
            cfg.dense_intermediate_size) == want
    assert (cfg.qkv_bias, cfg.qk_norm) == (name.startswith("qwen2_moe"),
                                           name.startswith("qwen3_moe"))


def test_mixed_layers_store_zero_experts_and_padded_mlps(checkpoints):
    """A dense layer's experts, router and shared gate are zero; the shared expert (37
    wide) is zero-padded to the dense layers' 50 columns, where the dense layers' own
    MLPs are whole."""
    cfg, values = hf_dir.load_hf_dir(checkpoints("qwen2_moe_mixed")[2])
    assert cfg.mlp_width == 50 and values["w_gate_up"].shape[-1] == 50
    for name in ("router", "w_experts_gate_up", "w_experts_down", "shared_gate"):
        assert not values[name][[0, 2]].any() and values[name][[1, 3]].all(), name
    assert not values["w_gate_up"][[1, 3], ..., 37:].any()
    assert not values["w_down"][[1, 3], 37:].any()
    assert values["w_gate_up"][[0, 2]].all() and values["w_down"][[0, 2]].all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_logits_match_hf(checkpoints, name):
    _, model, path = checkpoints(name)
    assert_forward_matches_hf(model, *hf_dir.load_hf_dir(path), atol=LOGITS_ATOL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_greedy_tokens_match_hf(checkpoints, name):
    """The engine's step (paged KV; a 32-token budget splits the long prompts into chunks)."""
    _, model, path = checkpoints(name)
    engine = Engine(EngineConfig(model=str(path), max_num_seqs=4, max_num_batched_tokens=32,
                                 **FAST))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]


def test_engine_on_the_ragged_dispatch_matches_hf(checkpoints, monkeypatch):
    """The sorted-segment path (`ragged_dot`, what GPU and TPU take) in the engine's step
    on this CPU: HF's greedy tokens."""
    import jax

    monkeypatch.setitem(moe.EXPERTS_PATH, "cpu", "ragged")
    jax.clear_caches()  # no step traced on the dense path by an earlier test is reused
    test_engine_greedy_tokens_match_hf(checkpoints, "qwen2_moe")
    jax.clear_caches()


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_fused_expert_names_load_alike(checkpoints, name, tmp_path):
    """transformers' in-memory names (experts fused: `experts.gate_up_proj` [X, 2F, E],
    `experts.down_proj` [X, E, F]; Mixtral's under `mlp.`) load to the same weights as the
    per-expert names save_pretrained writes."""
    from safetensors.torch import save_file

    _, model, path = checkpoints(name)
    state = model.state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    save_file({n: t.contiguous() for n, t in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused, split = hf_dir.load_hf_dir(tmp_path)[1], hf_dir.load_hf_dir(path)[1]
    assert fused.keys() == split.keys()
    for n in split:
        np.testing.assert_array_equal(fused[n], split[n], err_msg=n)


def test_routing_spreads_over_the_experts(checkpoints):
    """The drawn routers are not trivial: the prompts' tokens reach most experts."""
    _, model, path = checkpoints("qwen3_moe")
    cfg, values = hf_dir.load_hf_dir(path)
    h = np.asarray(model.model.embed_tokens(torch.tensor(PROMPTS[3])).detach())
    _, experts = moe.route(jnp.asarray(h), jnp.asarray(values["router"][0]), 2, True)
    assert len(set(np.asarray(experts).ravel().tolist())) >= cfg.num_experts - 1


# ---- router and experts against float64 NumPy --------------------------------------------------

X, D, F = 6, 10, 7


def reference(h, w_router, w_gate_up, w_down, k, normalize):
    """float64: softmax over the experts, the k largest (ties: lower index first), weights
    optionally renormalised, the k experts' SiLU-gated MLPs summed."""
    h, w_router, w_gate_up, w_down = (np.asarray(a, np.float64)
                                      for a in (h, w_router, w_gate_up, w_down))
    logits = h @ w_router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, experts, -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for w, x in zip(weights[t], experts[t], strict=True):
            g, u = h[t] @ w_gate_up[x, :, 0], h[t] @ w_gate_up[x, :, 1]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ w_down[x])
    return experts, out


def weights(seed: int, router_scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return (router_scale * rng.standard_normal((D, X)),
            rng.standard_normal((X, D, 2, F)) / D ** 0.5, rng.standard_normal((X, F, D)) / F ** 0.5)


def run(h, w_router, w_gate_up, w_down, k, normalize, path):
    gates, experts = moe.route(jnp.asarray(h, jnp.float32), jnp.asarray(w_router, jnp.float32),
                               k, normalize)
    out = moe.experts_mlp(jnp.asarray(h, jnp.float32), gates, experts,
                          jnp.asarray(w_gate_up, jnp.float32), jnp.asarray(w_down, jnp.float32),
                          path)
    return np.asarray(experts), np.asarray(out)


EXPERTS_PATHS = pytest.mark.parametrize("path", ["dense", "ragged"])


def check(h, ws, k, normalize, path):
    want_experts, want = reference(h, *ws, k, normalize)
    got_experts, got = run(h, *ws, k, normalize, path)
    np.testing.assert_array_equal(np.sort(got_experts, -1), np.sort(want_experts, -1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    return got_experts


@EXPERTS_PATHS
@pytest.mark.parametrize("k, normalize", [(1, False), (2, True), (3, False), (6, True)])
def test_experts_match_float64(path, k, normalize):
    h = np.random.default_rng(1).standard_normal((13, D))
    check(h, weights(2), k, normalize, path)


@EXPERTS_PATHS
def test_every_token_to_one_expert(path):
    """Expert 4's router column dominates: all 9 tokens go to it (k=1), one segment of 9."""
    w_router, *rest = weights(3)
    w_router[:, 4] = 0.0
    h = np.random.default_rng(4).standard_normal((9, D))
    h[:, 0] = 1.0
    w_router[0, 4] = 50.0
    experts = check(h, (w_router, *rest), 1, False, path)
    assert (experts == 4).all()


@EXPERTS_PATHS
def test_an_expert_no_token_chooses(path):
    """Experts 0 and 5 are never chosen (empty segments at both ends of the sort)."""
    w_router, *rest = weights(5)
    h = np.random.default_rng(6).standard_normal((11, D))
    h[:, 1] = 1.0
    w_router[1, [0, 5]] = -50.0
    experts = check(h, (w_router, *rest), 2, True, path)
    assert not np.isin(experts, [0, 5]).any() and len(np.unique(experts)) == 4


@EXPERTS_PATHS
def test_ties_go_to_the_lower_expert_index(path):
    """Exactly equal probabilities (equal router columns): the lower expert index wins a
    tie at the k-th place. torch.topk breaks such ties in an order of its own (on CPU,
    libstdc++'s selection order: [0.3] * 6, k=2 gives experts 3 and 5), so HF and jaxpipe
    route a token differently only where two experts' probabilities are exactly equal at
    the k-th place, which drawn weights do not produce (zero-padded layers tie, but their
    experts are zero)."""
    w_router, *rest = weights(7)
    w_router[:, 3] = w_router[:, 1]  # experts 1 and 3 tie, 2 and 5 tie
    w_router[:, 5] = w_router[:, 2]
    h = np.random.default_rng(8).standard_normal((12, D))
    for k in (1, 2, 3):
        experts = check(h, (w_router, *rest), k, True, path)
        assert not ({3, 5} & set(experts[:, :1].ravel().tolist()))  # never first over 1, 2


def test_ties_inside_the_top_k_match_hf():
    """Where tied experts are both chosen, HF's block gives the same output (the tie's
    order inside the top-k does not change the sum)."""
    config = transformers.Qwen3MoeConfig(**{**SMALL, "num_experts": 4, "num_experts_per_tok": 3,
                                            "moe_intermediate_size": 11, "norm_topk_prob": True},
                                           **EAGER)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    draw_every_parameter(block, 9)
    with torch.no_grad():
        block.gate.weight[2] = block.gate.weight[0]  # experts 0 and 2 tie
        block.gate.weight[3] = -1.0  # on positive h: far last, never in the top 3
        h = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0)).abs()
        want = block(h)[0].numpy()
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [X, 2F, D]
    w_gate_up = np.stack([gate_up[:, :11], gate_up[:, 11:]], axis=1).transpose(0, 3, 1, 2)
    w_down = block.experts.down_proj.detach().numpy().transpose(0, 2, 1)  # [X, F, D]
    gates, experts = moe.route(jnp.asarray(h[0].numpy()),
                               jnp.asarray(block.gate.weight.detach().numpy().T), 3, True)
    assert (np.sort(np.asarray(experts), -1) == [0, 1, 2]).all()
    got = moe.experts_mlp(jnp.asarray(h[0].numpy()), gates, experts, jnp.asarray(w_gate_up),
                          jnp.asarray(w_down))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(num_experts=4, num_experts_per_tok=5), r"num_experts_per_tok must be in \[1, "
                                                 r"num_experts=4\], got 5"),
    (dict(num_experts=4, num_experts_per_tok=2), r"moe_intermediate_size must be a positive"),
    (dict(num_experts_per_tok=2), r"need num_experts >= 1"),
    (dict(intermediate_size=0), r"intermediate_size must be a positive integer \(got 0"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          mlp_act="gelu_tanh"), r"mlp_act 'gelu_tanh' is not supported with experts"),
    (dict(dense_layers=(0,), dense_intermediate_size=8), r"dense_layers and "
                                                         r"dense_intermediate_size need "
                                                         r"num_experts >= 1"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          dense_layers=(2,), dense_intermediate_size=8), r"dense_layers \[2\] are not layers "
                                                         r"of 0..1"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          dense_layers=(1,)), r"dense_intermediate_size must be a positive integer with "
                              r"dense_layers \[1\] \(got 0\)"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          dense_intermediate_size=8), r"dense_intermediate_size=8 needs dense_layers"),
])
def test_bad_expert_configs_fail_naming_the_field(change, match):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **change})


@pytest.mark.parametrize("change, match", [
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 must be a positive integer"),
    ({"mlp_only_layers": [0, 1]}, r"decoder_sparse_step=1, mlp_only_layers=\[0, 1\] leave no "
                                  r"MoE layer"),
    ({"use_sliding_window": True}, r"use_sliding_window=true is not supported for qwen3_moe"),
])
def test_unsupported_moe_configs_fail_naming_the_field(checkpoints, change, match):
    config = json.loads((checkpoints("qwen3_moe")[2] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        hf_dir.hf_config({**config, **change})


@EXPERTS_PATHS
def test_bf16_experts_in_a_scan_over_stacked_layers(path):
    """bf16 weights sliced from a stack inside `lax.scan`, as the engine's step runs them
    (XLA's CPU backend once refused a bf16 x bf16 -> f32 batched dot there): within bf16's
    rounding of the float64 reference."""
    import jax

    layers = [weights(10 + i) for i in range(2)]
    stacked = [jnp.asarray(np.stack(ws), jnp.bfloat16) for ws in zip(*layers, strict=True)]
    h = np.random.default_rng(11).standard_normal((9, D))

    def body(x, j):  # a residual stream through two layers
        w_router, w_gate_up, w_down = (w[j] for w in stacked)
        gates, experts = moe.route(x, w_router, 2, True)
        return x + moe.experts_mlp(x, gates, experts, w_gate_up, w_down, path), None

    got = np.asarray(jax.jit(lambda h: jax.lax.scan(body, h, jnp.arange(2))[0])(
        jnp.asarray(h, jnp.float32)))
    want = h
    for j in range(2):
        rounded = [np.asarray(w[j].astype(jnp.float32), np.float64) for w in stacked]
        want = want + reference(want, *rounded, 2, True)[1]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())
