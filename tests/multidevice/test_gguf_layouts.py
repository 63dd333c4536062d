"""quantization="gguf" on 8 virtual devices (the default model's Q4_1 file): a pipeline
layout keeps each layer's blocks whole on its stage and runs the single-device arithmetic
exactly (one GGUF kernel path forced in both, so no row count changes the summation order;
30 layers padded to 32, the identity layers' zero blocks adding nothing), so its greedy
tokens equal the single-device gguf engine's. A layout with tp is refused by name: the
blocks are not split over tp."""

from __future__ import annotations

import pytest
from prefix_workload import tokens

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.kernels import gguf_matmul
from jaxpipe.model.gguf_quantized import GgufWeight

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def gguf_fields() -> dict:
    path = gguf_matmul.paths()[-1] if gguf_matmul.paths() else "xla"
    return dict(model="smollm2-135m", quantization="gguf", matmul=path, max_model_len=96,
                max_num_seqs=4, max_num_batched_tokens=32, prefix_caching=False,
                warmup=False, show_progress=False)


def run(**fields) -> list[list[int]]:
    engine = Engine(EngineConfig(**gguf_fields(), **fields))
    try:
        if fields:
            assert isinstance(engine.runner.params["wq"], GgufWeight)
            assert engine.runner.params["wq"].shape[0] == 32  # 30 layers over 8 stages
        return tokens(engine.generate(PROMPTS, [GREEDY] * len(PROMPTS)))
    finally:
        engine.close()


def test_a_pipeline_layout_gives_the_single_device_gguf_tokens(smollm2_source):
    assert run(mesh="cpu-8", prefill="pp=8", decode="pp=8") == run()


def test_a_tp_layout_is_refused(smollm2_source):
    with pytest.raises(ValueError, match=r"quantization='gguf' runs layouts with tp=1 .*the "
                                         r"decode layout is tp=8"):
        Engine(EngineConfig(**gguf_fields(), mesh="cpu-8", prefill="pp=8", decode="tp=8"))
