"""Quantized weights (`model/quantized.py`) against NumPy's statement of the arithmetic
(tests/np_quant.py): a weight of any family shape quantized per output channel of its
[lead, K, N] form, the container's array behaviour, XLA's dot of each kind through the
model's `xla_dot`, and an MoE layer's quantized experts (`moe.experts_mlp`) against a float64
NumPy reference of the same quantized arithmetic."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_quant import QUANTIZE, w8a8, w8a8_codes

from jaxpipe.model import decoder, moe, quantized
from jaxpipe.model.quantized import Quantization, QuantizedWeight

# name -> (logical axes, shape, contracted positions): prime sizes, so a swapped axis fails.
WEIGHTS = {
    "wq": (("layers", "embed", "heads", "head_dim"), (2, 11, 3, 5), [1]),
    "wo": (("layers", "heads", "head_dim", "embed"), (2, 3, 5, 11), [1, 2]),
    "w_experts_gate_up": (("layers", "experts", "embed", "gate_up", "moe_mlp"),
                          (2, 3, 11, 2, 7), [2]),
    "lm_head": (("embed", "vocab"), (11, 13), [0]),
}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_a_weight_is_quantized_per_output_channel_of_its_matmul(name, kind):
    axes, shape, k_pos = WEIGHTS[name]
    w = np.random.default_rng(len(name)).standard_normal(shape).astype(np.float32)
    q = quantized.quantize(jnp.asarray(w), name, axes, kind)
    lead, n_shape = shape[:k_pos[0]], shape[k_pos[-1] + 1:]
    k = int(np.prod([shape[i] for i in k_pos]))
    codes, scale = QUANTIZE[kind](w.reshape(*lead, k, -1), -2)
    assert q.codes.shape == shape and q.scale.shape == (*lead, *n_shape)
    np.testing.assert_array_equal(np.asarray(q.scale), scale.reshape(*lead, *n_shape))
    np.testing.assert_array_equal(np.asarray(q.codes, np.float32),
                                  codes.astype(np.float32).reshape(shape))
    assert quantized.scale_axes(name, axes) == tuple(a for i, a in enumerate(axes)
                                                     if i not in k_pos)


def test_the_container_slices_and_reshapes_codes_and_scales_together():
    axes, shape, _ = WEIGHTS["wq"]
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = quantized.quantize(jnp.asarray(w), "wq", axes, "int8")
    layer = q[1].reshape(11, -1)  # [E, H * D], the scale [H * D]
    assert layer.shape == (11, 15) and layer.scale.shape == (15,)
    np.testing.assert_array_equal(np.asarray(layer.scale), np.asarray(q.scale[1]).reshape(15))
    stacked = q.reshape(2, 11, 15)
    assert stacked.scale.shape == (2, 15) and q.reshape(shape) is q
    leaves = jax.tree.leaves(q)  # a pytree of codes and scale, the kind static
    assert [a.dtype for a in leaves] == [jnp.int8, jnp.float32]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m, k, n", [(1, 11, 13), (7, 64, 130)])
def test_the_models_dot_of_a_quantized_weight_is_w8a8(kind, m, k, n):
    rng = np.random.default_rng(m + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    q = quantized.quantize(jnp.asarray(w), "lm_head", ("embed", "vocab"), kind)
    got = np.asarray(decoder.xla_dot(jnp.asarray(x), q))
    want = w8a8(x, w, kind)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def np_experts(h, weights, experts, gate_up, down, kind):
    """The quantized dense experts in float64: h per token, each (token, expert) row of
    the gated activations per row, the experts' weights per output channel."""
    t, (x, e, _, f) = h.shape[0], gate_up.shape
    gates = np.zeros((t, x))
    for i in range(t):
        for j, ex in enumerate(experts[i]):
            gates[i, ex] += weights[i, j]
    hq, hs = QUANTIZE[kind](h, -1)
    out = np.zeros((t, e))
    for ex in range(x):
        wq, ws = QUANTIZE[kind](gate_up[ex].reshape(e, 2 * f), -2)
        gu = w8a8_codes(hq, hs, wq, ws)
        act = (gu[:, :f] / (1 + np.exp(-gu[:, :f]))) * gu[:, f:] * gates[:, ex:ex + 1]
        aq, as_ = QUANTIZE[kind](act.astype(np.float32), -1)
        dq, ds = QUANTIZE[kind](down[ex], -2)
        out += w8a8_codes(aq, as_, dq, ds)
    return out


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_experts_run_dense_and_match_numpy(kind):
    rng = np.random.default_rng(3)
    t, x, e, f, k = 5, 4, 16, 7, 2
    h = rng.standard_normal((t, e)).astype(np.float32)
    gate_up = (rng.standard_normal((x, e, 2, f)) / np.sqrt(e)).astype(np.float32)
    down = (rng.standard_normal((x, f, e)) / np.sqrt(f)).astype(np.float32)
    weights, experts = moe.route(jnp.asarray(h), jnp.asarray(rng.standard_normal((e, x)),
                                                              jnp.float32), k, True)
    qg = quantized.quantize(jnp.asarray(gate_up), "w_experts_gate_up",
                            ("experts", "embed", "gate_up", "moe_mlp"), kind)
    qd = quantized.quantize(jnp.asarray(down), "w_experts_down",
                            ("experts", "moe_mlp", "embed"), kind)
    # Any path asked for (here the grouped kernel's) runs the quantized dense path.
    got = np.asarray(moe.experts_mlp(jnp.asarray(h), weights, experts, qg, qd, "grouped"))
    want = np_experts(h, np.asarray(weights, np.float64), np.asarray(experts), gate_up, down,
                      kind)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_embedding_lookup_reads_the_dequantized_heads_rows(kind):
    """A tied model's quantized head [E, V] is its embedding: `decoder.embed` gathers the
    tokens' columns, each times its vocabulary entry's scale, exactly NumPy's dequantized
    head (codes x per-column scale, the exact product rounded once to f32) transposed, at
    the tokens, times the embedding scale in f32."""
    e, v = 11, 13
    table = np.random.default_rng(3).standard_normal((v, e)).astype(np.float32)  # [V, E]
    head = quantized.quantize(jnp.asarray(table.T), "lm_head", ("embed", "vocab"), kind)
    codes, scale = QUANTIZE[kind](table.T, -2)  # [E, V], [V]
    want = (np.asarray(codes, np.float64) * scale).T.astype(np.float32)  # [V, E]
    tokens = np.array([[0, 12, 5], [5, 7, 1]], np.int32)
    got = decoder.embed(decoder.HeadParams(head, jnp.ones(e), head), jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(got), want[tokens])
    scaled = decoder.embed(decoder.HeadParams(head, jnp.ones(e), head), tokens[0], 2.5)
    np.testing.assert_array_equal(np.asarray(scaled), want[tokens[0]] * np.float32(2.5))


def test_a_tied_quantized_head_stands_for_the_embedding():
    decls = decoder.param_decls(_tiny_config())
    assert Quantization("int8").tied(decls) and not Quantization("int8", False).tied(decls)
    untied = decoder.param_decls(dataclasses.replace(_tiny_config(), tie_embeddings=False))
    assert not Quantization("int8").tied(untied)


def test_quantization_lists_its_weights_and_refuses_unknown_kinds():
    decls = decoder.param_decls(_tiny_config())
    assert Quantization("int8").names(decls) == ("wq", "wkv", "wo", "w_gate_up", "w_down",
                                                 "lm_head")
    assert "lm_head" not in Quantization("fp8", lm_head=False).names(decls)
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8, gguf .or 'none'.; "
                                         "got 'int4'"):
        Quantization("int4")
    assert isinstance(Quantization("int8").wrap("wo", decls, lambda axes: axes),
                      QuantizedWeight)


def _tiny_config():
    from jaxpipe.config.model import ModelConfig

    return ModelConfig(vocab_size=13, hidden_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=4, intermediate_size=6, tie_embeddings=True)
