"""The LM head program against a float64 NumPy reference on SmolLM2's weights, for one
sampled row (run on two: `HEAD_MIN_ROWS`) and more, with fewer hidden rows than that."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe import pipeline


def reference_logits(cfg, values: dict, hidden: np.ndarray) -> np.ndarray:
    x = hidden.astype(np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    h = h * values["final_norm"].astype(np.float64)
    head = values.get("lm_head")
    return h @ (values["embed"].astype(np.float64).T if head is None else head)


@pytest.mark.parametrize("hidden_rows, rows", [(1, 1), (8, 1), (8, 3)])
def test_lm_head_gives_the_reference_logits_for_any_row_count(gguf_weights, hidden_rows,
                                                              rows):
    cfg, values = gguf_weights
    hidden = np.random.default_rng(rows).standard_normal((hidden_rows, cfg.hidden_size))
    params = {k: jnp.asarray(v) for k, v in values.items()}
    got = np.asarray(pipeline.logits_program(cfg, cfg.vocab_size)(
        params, jnp.asarray(hidden, jnp.float32), rows=rows))
    assert got.shape == (rows, cfg.vocab_size)
    want = reference_logits(cfg, values, hidden[:rows])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
