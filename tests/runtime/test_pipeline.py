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


def int8_paths() -> list[str]:
    from jaxpipe.kernels import int8_matmul

    return [None, *int8_matmul.PATHS]  # None: XLA's int8 dot on the natural order


@pytest.mark.parametrize("path", int8_paths())
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int8_lm_head_gives_the_w8a8_reference_logits(gguf_weights, rows, path):
    """quantization="int8": SmolLM2's tied head quantized from the bf16 embedding ([E, V],
    a scale per token of the vocabulary), packed in int8 panel order with the layer weights
    by `pack_program` and multiplied by `logits_program` on each int8 kernel path (None:
    XLA's int8 dot, natural order), against float64 NumPy of the same W8A8 arithmetic;
    `unpack_program` gives back every code as it was."""
    import jax
    from np_quant import w8a8

    from jaxpipe.config.layout import Layout
    from jaxpipe.kernels import int8_matmul
    from jaxpipe.model import quantized
    from jaxpipe.model.decoder import param_decls
    from jaxpipe.runtime.sharding import make_mesh

    if path is not None and path not in int8_matmul.paths():
        pytest.skip(f"this machine's int8 kernel build has no {path} path (it has "
                    f"{', '.join(int8_matmul.paths()) or 'none'})")
    cfg, values = gguf_weights
    quant = quantized.Quantization("int8")
    layout = Layout.parse("pp=1,tp=1")
    mesh = make_mesh(layout, jax.devices()[:1])
    decls = param_decls(cfg)
    params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in values.items()}
    names = quant.names(decls)
    for name in names:
        source = params["embed"].T if name == "lm_head" else params[name]
        params[name] = quantized.quantize(source, name, quant.axes(name, decls), "int8")
    natural = jax.tree.map(np.asarray, params)
    layers = names[:-1] if path is not None else ()
    if path is not None:
        params = pipeline.pack_program(cfg, layout, mesh, layers, True, quant)(params)
    hidden = np.random.default_rng(rows).standard_normal((rows + 2, cfg.hidden_size))
    fn = pipeline.logits_program(cfg, cfg.vocab_size, layout, mesh,
                                 path and (lambda rows: path), quant)
    got = np.asarray(fn(params, jnp.asarray(hidden, jnp.float32), rows=rows))
    x = hidden[:rows].astype(np.float32)
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(cfg.rms_norm_eps))
    h = h * values["final_norm"].astype(np.float32)
    embed = np.asarray(jnp.asarray(values["embed"], jnp.bfloat16), np.float32)
    want = w8a8(h, embed.T)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if path is not None:
        back = pipeline.unpack_program(cfg, layout, mesh, layers, True, quant)(params)
        for name in names:
            np.testing.assert_array_equal(np.asarray(back[name].codes), natural[name].codes)


@pytest.mark.parametrize("dtype,matmul", [("float32", "xla"), ("bfloat16", "xla"),
                                          ("bfloat16", "kernel")])
def test_a_step_copies_at_most_one_layers_sliced_f32_weights_at_a_time(dtype, matmul):
    """Where XLA's dot multiplies f32 weights sliced from the stacked layers, the layer loop
    is rolled: a decode step's temporaries (XLA's own `memory_analysis`) hold under two
    layers' matmul weights, where the unrolled loop held every layer's copies at once (425
    MB on f32 SmolLM2, over 30 of its 14 MB layers). Where the kernel reads every weight in
    place (bf16, packed), or XLA's dot would convert bf16 weights, the loop stays unrolled."""
    from jaxpipe.engine.engine import Engine
    from jaxpipe.kernels import matmul as mm
    from jaxpipe.runtime.synthetic_step import padding_inputs

    if matmul == "kernel" and not mm.paths():
        pytest.skip("the bf16 kernel does not build here")
    engine = Engine(random_weights=True, max_model_len=128, max_num_seqs=4, warmup=False,
                    show_progress=False, dtype=dtype,
                    matmul="xla" if matmul == "xla" else mm.paths()[-1])
    runner = engine.runner
    try:
        params = runner.params
        layers = pipeline.LayerParams(*(params.get(n) for n in pipeline.LAYER_PARAMS))
        assert pipeline.unrolled(layers, runner.placements["decode"].packed) == (
            dtype != "float32")
        per_layer = sum(params[n].nbytes for n in pipeline.MATMUL_PARAMS) // len(params["wq"])
        temp = runner.lowered(padding_inputs(runner, 4)).compile(
        ).memory_analysis().temp_size_in_bytes
        if dtype == "float32":
            assert temp < 2 * per_layer, (temp, per_layer)
    finally:
        engine.close()
