"""A GGUF's matrices kept in their blocks (jaxpipe/model/gguf_weights.py): the shipped SmolLM2
file's blocks, decoded by the gguf package, are the dequantizing loader's weights exactly, in
the decoder's column order (llama.cpp's Q/K rows put back); other types stay dequantized."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxpipe.model import gguf_weights
from jaxpipe.model.families.llama import FAMILY as LLAMA
from jaxpipe.model.families.llama import unpermute_qk
from jaxpipe.model.gguf_file import load_gguf
from jaxpipe.model.presets import resolve_model


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model("smollm2-135m").path
    cfg, params = load_gguf(path)
    return path, cfg, params, gguf_weights.read_block_rows(path)


def _columns(w: np.ndarray, contracted: int) -> np.ndarray:
    """A stacked decoder weight [L, K axes..., N axes...] as [L, N, K]."""
    k = int(np.prod(w.shape[1:1 + contracted]))
    return w.reshape(w.shape[0], k, -1).swapaxes(1, 2)


@pytest.mark.parametrize("param,contracted", [("wq", 1), ("wkv", 1), ("wo", 2),
                                              ("w_gate_up", 1), ("w_down", 1)])
def test_blocks_decode_to_the_dequantized_weights(smollm2, param, contracted):
    _, cfg, params, blocks = smollm2
    rows = blocks[param]
    assert rows.kind == "q4_1"  # the shipped file's
    assert rows.data.dtype == np.uint8 and rows.data.shape[0] == cfg.num_layers
    np.testing.assert_array_equal(rows.dequantize(), _columns(params[param], contracted))


def test_the_tied_head_is_the_embeddings_blocks(smollm2):
    _, cfg, params, blocks = smollm2
    head = blocks["lm_head"]
    assert (head.kind, head.n, head.k) == ("q8_0", cfg.vocab_size, cfg.hidden_size)
    np.testing.assert_array_equal(head.dequantize(), params["embed"])


def test_q4_1_blocks_take_five_sixteenths_of_bf16(smollm2):
    _, cfg, _, blocks = smollm2
    for param in gguf_weights.LINEAR:  # 32 weights in 20 bytes (2 f16 scales, 16 of nibbles)
        rows = blocks[param]
        assert rows.nbytes * 64 == rows.data.shape[0] * rows.n * rows.k * 2 * 20
    head = blocks["lm_head"]  # Q8_0: 32 weights in 34 bytes
    assert head.nbytes * 32 == head.n * head.k * 34


def test_other_types_stay_dequantized_and_are_named(smollm2, caplog):
    path = smollm2[0]
    with caplog.at_level(logging.INFO, logger="jaxpipe.model.gguf_weights"):
        kept = gguf_weights.read_block_rows(path, kinds=("q8_0",))
    assert set(kept) == {"lm_head"}
    assert "wq stays dequantized: its GGUF types ['q4_1'] are not one of q8_0" in caplog.text


def test_a_row_reordering_fix_is_applied_to_the_rows_and_another_fix_refused(smollm2):
    cfg = smollm2[1]
    n = cfg.num_heads * cfg.head_dim
    order = gguf_weights._row_order(cfg, LLAMA, "layers.0.q", n)
    rows = np.random.default_rng(0).normal(size=(n, 3))
    np.testing.assert_array_equal(rows[order], unpermute_qk(cfg, "layers.0.q", rows))
    assert (gguf_weights._row_order(cfg, LLAMA, "layers.0.o", n) == np.arange(n)).all()

    class Scaled:
        @staticmethod
        def gguf_value(cfg, name, w):
            return w * 2.0

    assert gguf_weights._row_order(cfg, Scaled, "layers.0.q", n) is None
