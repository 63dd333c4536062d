"""The LM head program against a float64 NumPy reference on SmolLM2's weights, for one
sampled row (run on two: `HEAD_MIN_ROWS`) and more, with fewer hidden rows than that."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.runtime import pipeline


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


def kernel_paths() -> list[str]:
    from jaxpipe.kernels import matmul

    return list(matmul.PATHS)


@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_lm_head_gives_the_reference_logits(gguf_weights, rows, path):
    """The bf16 kernel's head: `pack_program` adds the tied head's transpose in panel order,
    `logits_program(packed=...)` multiplies by it on each kernel path; bf16 weights against
    float64 NumPy on the same bf16 values; `unpack_program` gives back the natural tree."""
    import jax

    from jaxpipe.config.layout import Layout
    from jaxpipe.kernels import matmul
    from jaxpipe.runtime.sharding import make_mesh

    if path not in matmul.paths():
        pytest.skip(f"this machine's kernel build has no {path} path (it has "
                    f"{', '.join(matmul.paths()) or 'none'})")
    cfg, values = gguf_weights
    bf16 = {k: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for k, v in values.items()}
    layout = Layout.parse("pp=1,tp=1")
    mesh = make_mesh(layout, jax.devices()[:1])
    params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in values.items()}
    packed = pipeline.pack_program(cfg, layout, mesh, frozenset(), True)(dict(params))
    assert packed["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    hidden = np.random.default_rng(rows).standard_normal((rows + 2, cfg.hidden_size))
    fn = pipeline.logits_program(cfg, cfg.vocab_size, layout, mesh, packed=lambda rows: path)
    got = np.asarray(fn(packed, jnp.asarray(hidden, jnp.float32), rows=rows))
    want = reference_logits(cfg, bf16, hidden[:rows])
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    natural = pipeline.unpack_program(cfg, layout, mesh, frozenset(), True)(packed)
    assert set(natural) == set(values)
