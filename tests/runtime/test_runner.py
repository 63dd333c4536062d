"""Which attention the runner's step takes for `EngineConfig.attention` on each backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpipe.kernels import ragged_attention
from jaxpipe.runtime.runner import attention_impl

CPU, GPU = [SimpleNamespace(platform="cpu")], [SimpleNamespace(platform="gpu")]


def test_auto_is_pallas_on_gpu_and_the_cpp_kernels_on_cpu():
    assert attention_impl("auto", GPU) == "pallas"
    assert attention_impl("auto", CPU) == ("cpu" if ragged_attention.available() else "xla")
    assert attention_impl("xla", GPU) == attention_impl("xla", CPU) == "xla"
    assert attention_impl("pallas-interpret", CPU) == "pallas-interpret"


def test_kernels_off_their_backend_are_refused_by_name():
    with pytest.raises(ValueError, match="attention='pallas' needs a GPU.*cpu"):
        attention_impl("pallas", CPU)
    with pytest.raises(ValueError, match="attention='kernel' is the C\\+\\+ CPU kernel.*gpu"):
        attention_impl("kernel", GPU)


@pytest.mark.parametrize("dtype, want", [("float32", "HIGHEST"), ("bfloat16", None)])
def test_f32_steps_ask_for_full_precision_dots(tiny_smollm2, monkeypatch, dtype, want):
    """GPUs multiply f32 in TF32 unless a dot asks for HIGHEST: an f32 runner calls its step
    programs at that precision (on the CPU the dots come out the same either way, so the
    lowered program is what shows it)."""
    import jax

    from jaxpipe import Engine, EngineConfig
    from jaxpipe.runtime.synthetic_step import padding_inputs

    asked = []
    real = jax.default_matmul_precision
    monkeypatch.setattr(jax, "default_matmul_precision", lambda p: asked.append(p) or real(p))
    with Engine(EngineConfig(model=tiny_smollm2, dtype=dtype, max_model_len=64, max_num_seqs=2,
                             warmup=False, show_progress=False, kv_cache_tokens=256)) as engine:
        runner = engine.runner
        inputs = padding_inputs(runner, 8)
        runner.hidden(inputs)
        assert asked and set(asked) == {None if want is None else "highest"}
        text = runner.lowered(inputs).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots
    assert all(("HIGHEST" in line) == (want is not None) for line in dots)
