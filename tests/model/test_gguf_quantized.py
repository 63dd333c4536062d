"""Weights kept in a GGUF file's blocks (jaxpipe/model/gguf_quantized.py), on the shipped
SmolLM2 Q4_1 file: each `GgufWeight` is, as an array, the decoder's weight (its shape, a
layer, [K, N]) and multiplies as the dequantizing loader's float weight does, up to the
activations' q8 quantization; the tied head is the embedding's own blocks, whose lookup is
the dequantized embedding exactly; padded rows are zero blocks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.model import gguf_quantized, gguf_weights
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.gguf_file import load_gguf
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.presets import resolve_model
from jaxpipe.runtime import sharding

CONTRACTED = {"wq": 1, "wkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model("smollm2-135m").path
    cfg, params = load_gguf(path)
    return cfg, params, gguf_weights.kept_weights(path, cfg)


def test_every_linear_and_the_tied_head_stay_in_blocks(smollm2):
    cfg, _, kept = smollm2
    decls = param_decls(cfg)
    assert sorted(kept) == sorted([*CONTRACTED, "embed"])  # tied: no "lm_head" of its own
    for name, w in kept.items():
        assert isinstance(w, GgufWeight) and w.data.dtype == np.uint8
        want = decls[name].shape[::-1] if name == "embed" else decls[name].shape
        assert w.shape == want, name
    assert kept["embed"].kind == "q8_0" and kept["wq"].kind == "q4_1"


def test_lookup_is_the_dequantized_embedding_exactly(smollm2):
    cfg, params, kept = smollm2
    tokens = np.array([[0, 1, cfg.vocab_size - 1], [17, 17, 4093]])
    got = kept["embed"].lookup(jnp.asarray(tokens))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(got), params["embed"][tokens])


def _q8_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A bound on |x @ w - the q8 product| [M, N] (x [M, K], w [K, N] f64): each activation
    is off by at most half its block's step amax / 127, plus the f16 rounding of the step
    (2^-11 relative, taken as 2^-10 of |x|)."""
    blocks = np.abs(x).reshape(x.shape[0], -1, 32)
    half_step = np.repeat(blocks.max(-1) / 127 / 2, 32, axis=-1)  # [M, K]
    return (half_step + np.abs(x) * 2.0**-10) @ np.abs(w)


@pytest.mark.parametrize("name", sorted(CONTRACTED))
def test_a_layer_multiplies_as_the_dequantized_weight(smollm2, name):
    cfg, params, kept = smollm2
    layer = cfg.num_layers - 2
    float_w = params[name][layer].astype(np.float64)
    k = int(np.prod(float_w.shape[:CONTRACTED[name]]))
    x = np.random.default_rng(3).normal(size=(5, k)).astype(np.float32)
    got = np.asarray(kept[name][layer].reshape(k, -1).dot(jnp.asarray(x)))
    want = x.astype(np.float64) @ float_w.reshape(k, -1)
    assert got.shape == want.shape
    np.testing.assert_array_less(np.abs(got - want), _q8_error_bound(x, float_w.reshape(k, -1))
                                 + 1e-5)


def test_the_tied_head_multiplies_as_the_embedding(smollm2):
    cfg, params, kept = smollm2
    x = np.random.default_rng(4).normal(size=(3, cfg.hidden_size)).astype(np.float32)
    got = np.asarray(kept["embed"].dot(jnp.asarray(x)))  # [3, V]
    w = params["embed"].T.astype(np.float64)
    np.testing.assert_array_less(np.abs(got - x @ w), _q8_error_bound(x, w) + 1e-5)


def test_padded_layers_and_vocab_are_zero_blocks(smollm2):
    cfg, params, kept = smollm2
    decls = param_decls(cfg)
    padding = sharding.padding_for(cfg, [Layout(pp=4)])  # 30 layers -> 32: 2 identity ones
    wq = sharding.pad_blocks("wq", decls["wq"], kept["wq"], padding)
    src = np.array(padding.index["layers"])
    assert wq.shape[0] == 32 and (src < 0).sum() == 2
    np.testing.assert_array_equal(wq.data[src < 0], 0)
    np.testing.assert_array_equal(wq.data[src >= 0], kept["wq"].data)
    vocab = sharding.Padding({"vocab": (*range(cfg.vocab_size), -1, -1)})
    embed = sharding.pad_blocks("embed", decls["embed"], kept["embed"], vocab)
    rows = np.asarray(embed.lookup(jnp.asarray([cfg.vocab_size, 5])))
    np.testing.assert_array_equal(rows[0], 0)  # a zero block is zero weights
    np.testing.assert_array_equal(rows[1], params["embed"][5])


def test_row_split_weights_keep_each_row_in_groups_of_whole_blocks(smollm2):
    """wo's rows as heads (a head's 64 weights: two q4_1 blocks), w_down's as blocks; either
    way `rows()` is the file's rows, byte for byte."""
    cfg, _, kept = smollm2
    path = resolve_model("smollm2-135m").path
    file_rows = gguf_weights.read_block_rows(path)
    wo, w_down = kept["wo"], kept["w_down"]
    assert wo.grouped and wo.data.shape == (30, 576, 9, 40) and wo.shape == (30, 9, 64, 576)
    assert w_down.grouped and w_down.data.shape == (30, 576, 48, 20)
    assert w_down.shape == (30, 1536, 576) and not kept["wq"].grouped
    for name in ("wo", "w_down"):
        np.testing.assert_array_equal(np.asarray(kept[name].rows()), file_rows[name].data)


@pytest.mark.parametrize("name, tp", [("wo", 4), ("w_down", 4), ("w_down", 8)])
def test_a_tp_shard_of_a_row_split_weight_multiplies_its_slice_of_k(smollm2, name, tp):
    """Padded for tp (wo: 9 heads -> 12, zero groups) and cut into tp shards along its
    groups, each shard is the weight of its slice of K: the shards' products summed are the
    whole weight's product (the same blocks, one f32 sum split in tp)."""
    cfg, _, kept = smollm2
    decls = param_decls(cfg)
    padding = sharding.padding_for(cfg, [Layout(tp=tp)])
    w = sharding.pad_blocks(name, decls[name], kept[name], padding)[cfg.num_layers - 1]
    k = int(np.prod(w.shape[:CONTRACTED[name]]))
    x = np.random.default_rng(5).normal(size=(6, k)).astype(np.float32)
    whole = np.asarray(w.reshape(k, -1).dot(jnp.asarray(x)))
    groups = w.data.shape[-2]
    assert groups % tp == 0 and k == (12 * 64 if name == "wo" else 1536)
    parts = []
    for s in range(tp):
        cut = slice(s * groups // tp, (s + 1) * groups // tp)
        shard = GgufWeight(w.data[:, cut], w.kind, w.k_shape, w.n_ndim, w.grouped)
        assert shard.shape[:CONTRACTED[name]][0] * tp == w.shape[0]
        parts.append(np.asarray(shard.reshape(k // tp, -1).dot(
            jnp.asarray(x[:, s * k // tp:(s + 1) * k // tp]))))
    np.testing.assert_allclose(np.sum(parts, axis=0), whole, rtol=1e-5,
                               atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("name, shape, kind, tp, error", [
    ("wo", (30, 9, 64, 576), "q4_k", 2, r"wo is q4_k \(blocks of 256 weights\) and its heads "
                                        r"are 64 wide, so tp=2 cannot split"),
    ("w_down", (30, 1536, 576), "q4_k", 4, r"w_down is q4_k .* 6 groups of 256, which tp=4 "
                                           r"does not split; use a tp dividing 6"),
    ("w_down", (30, 1536, 576), "q4_k", 2, None),
    ("wo", (30, 9, 64, 576), "q4_1", 8, None),  # heads are padded to 16
    ("wq", (30, 576, 9, 64), "q4_k", 8, None),  # column-split: N only
])
def test_a_split_tp_cannot_make_is_refused_by_name(smollm2, name, shape, kind, tp, error):
    axes = param_decls(smollm2[0])[name].axes
    if error is None:
        gguf_quantized.check_splits(name, shape, axes, kind, tp)
    else:
        with pytest.raises(ValueError, match=error):
            gguf_quantized.check_splits(name, shape, axes, kind, tp)
