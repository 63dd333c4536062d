"""quantization="gguf" on 8 virtual devices (the default model's Q4_1 file): a pipeline
layout keeps each layer's blocks whole on its stage and runs the single-device arithmetic
exactly (one GGUF kernel path forced in both, so no row count changes the summation order;
30 layers padded to 32, the identity layers' zero blocks adding nothing), so its greedy
tokens equal the single-device gguf engine's; and a runner on pp=2 (XLA's reference of the
formats, no kernel choice) gives the single-device runner's logits. A layout with tp is
refused by name: the blocks are not split over tp."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prefix_workload import tokens

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.config.layout import Layout
from jaxpipe.kernels import gguf_matmul
from jaxpipe.model import gguf_weights
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import Quantization
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.runner import Runner
from jaxpipe.runtime.step_inputs import Piece

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def kernel_path() -> str:
    return gguf_matmul.paths()[-1] if gguf_matmul.paths() else "xla"


def gguf_fields(path: str | None = None) -> dict:
    return dict(model="smollm2-135m", quantization="gguf", matmul=path or kernel_path(),
                max_model_len=96,
                max_num_seqs=4, max_num_batched_tokens=32, prefix_caching=False,
                warmup=False, show_progress=False)


def run(path: str, **fields) -> list[list[int]]:
    engine = Engine(EngineConfig(**gguf_fields(path), **fields))
    try:
        if fields:
            assert isinstance(engine.runner.params["wq"], GgufWeight)
            assert engine.runner.params["wq"].shape[0] == 32  # 30 layers over 8 stages
            hlo = head_hlo(engine.runner)
            if path != "xla":
                assert kernel_columns(hlo) == [49152 // 8]
            assert not re.search(r"\[\d+,49152\]", hlo)  # no device holds every logit
        return tokens(engine.generate(PROMPTS, [GREEDY] * len(PROMPTS)))
    finally:
        engine.close()


def head_hlo(runner: Runner) -> str:
    """The compiled LM head of `runner`'s layout (the GGUF kernel's or XLA's reference's)."""
    place = runner.placements[runner.phase]
    assert place.head_path is not None  # the head in GGUF blocks, not XLA's dot of bf16
    pieces = [Piece([1, 2, 3], 0, [0])]
    size = runner.buckets.tokens(3)
    hidden = runner.hidden(step_inputs.build(pieces, size, runner.buckets.rows(size),
                                             runner.max_blocks))
    return place.logits.lower(runner.params, hidden, rows=1).compile().as_text()


def kernel_columns(hlo: str) -> list[int]:
    """The vocabulary columns each GGUF kernel call in `hlo` computes on one device: the
    whole (tied) head, or each device's own slice of it."""
    return [int(n) for n in re.findall(r"f32\[\d+,(\d+)\]\S* custom-call\(.*"
                                       + gguf_matmul.TARGET, hlo)]


@pytest.mark.parametrize("path", ["kernel", "xla"])
def test_a_pipeline_layout_gives_the_single_device_gguf_tokens(smollm2_source, path):
    """pp=8 gives the single-device greedy tokens, on the GGUF kernel and on XLA's reference
    of the format, and each stage multiplies only its own eighth of the vocabulary in the
    LM head, not the whole head (`pipeline.head_slices`)."""
    path = kernel_path() if path == "kernel" else path
    assert run(path, mesh="cpu-8", prefill="pp=8", decode="pp=8") == run(path)


def test_a_tp_layout_is_refused(smollm2_source):
    with pytest.raises(ValueError, match=r"quantization='gguf' runs layouts with tp=1 .*the "
                                         r"decode layout is tp=8"):
        Engine(EngineConfig(**gguf_fields(), mesh="cpu-8", prefill="pp=8", decode="tp=8"))


def gguf_runner(smollm2, source, layout: str) -> Runner:
    """A runner of SmolLM2's file blocks (bf16 norms) on `layout`, XLA's matmuls."""
    cfg, values = smollm2
    kept = gguf_weights.kept_weights(source.path, cfg)
    quant = Quantization("gguf", True, tuple((n, w.kind) for n, w in kept.items()))
    parsed = Layout.parse(layout)
    return Runner(cfg, {**values, **kept}, Buckets.for_engine(4, 64, 64), 4, 64, jnp.bfloat16,
                  {"prefill": parsed, "decode": parsed}, jax.devices()[:parsed.num_devices],
                  8, attention="xla", quant=quant)


def test_a_pp2_runner_gives_the_single_device_logits(smollm2, smollm2_source):
    rng = np.random.default_rng(2)
    pieces = [Piece(rng.integers(0, 49152, n).tolist(), 0, [2 * i, 2 * i + 1])
              for i, n in enumerate((19, 5, 30))]
    got = []
    for layout in ("pp=1,tp=1", "pp=2"):
        runner = gguf_runner(smollm2, smollm2_source, layout)
        try:
            assert isinstance(runner.params["embed"], GgufWeight)
            size = runner.buckets.tokens(sum(len(p.tokens) for p in pieces))
            step = step_inputs.build(pieces, size, runner.buckets.rows(size), runner.max_blocks)
            got.append(np.asarray(runner.logits(step, len(pieces))))
        finally:
            runner.close()
    assert got[0].shape == (3, 49152)
    np.testing.assert_allclose(got[1], got[0], rtol=0, atol=1e-4 * np.abs(got[0]).max())
