"""`quantization="gguf"` through the engine, on the default model (SmolLM2-135M, the shipped
Q4_1 GGUF; its embedding, the tied head, is Q8_0): the file's blocks stay on the device and
the engine scores text as the same file dequantized to f32 does, up to the activations' q8
quantization.

The tolerance: both engines multiply by the same weights (the f32 engine by the blocks'
exact values), so the gguf engine (bf16 norms) differs mainly in rounding its activations,
per block of 32, to steps of amax / 127 (q8_0 / q8_1; about 2^-6 of a typical value of a
block whose max is 3-4 of them), where the bf16 engine rounds both weights and activations
to 2^-9 of themselves. So the median |logprob| change of the scored token from the f32
engine must stay within 8x the bf16 engine's change (measured: 3.7x, 0.0213 against
0.0057), and at least 90% of top-1 tokens agree (the issue's bar for greedy tokens;
measured 95%, bf16 98%). The budget counts the file's block bytes; the blocks are never
dequantized at load; a non-GGUF model is refused by name (a tp layout:
tests/multidevice/test_gguf_layouts.py)."""

from __future__ import annotations

import pytest
from quant_agreement import agreement, scores

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.engine import builder
from jaxpipe.model import gguf_file
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.presets import resolve_model

FAST = dict(max_model_len=160, max_num_seqs=4, warmup=False, show_progress=False)
PROMPTS = ["The history of the printing press begins", "def fibonacci(n):",
           "Water boils at a temperature of", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def f32_reference():
    """The f32 engine's greedy continuations of the prompts, and its scores of them."""
    e = Engine(EngineConfig(dtype="float32", **FAST))
    try:
        outs = e.generate(PROMPTS, GREEDY)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        return seqs, scores(e, seqs)
    finally:
        e.close()


@pytest.fixture(scope="module")
def gguf_engine():
    e = Engine(EngineConfig(quantization="gguf", **FAST))
    yield e
    e.close()


def test_the_gguf_engine_scores_text_as_the_f32_engine(f32_reference, gguf_engine):
    seqs, want = f32_reference
    bf16 = Engine(EngineConfig(**FAST))
    try:
        bf16_top1, bf16_rounding = agreement(want, scores(bf16, seqs), seqs)
    finally:
        bf16.close()
    top1, change = agreement(want, scores(gguf_engine, seqs), seqs)
    got = dict(gguf_top1=top1, gguf_change=change, bf16_top1=bf16_top1,
               bf16_change=bf16_rounding)
    assert top1 >= 0.9 and change <= 8 * bf16_rounding, got


def test_the_blocks_stay_on_the_device(gguf_engine):
    params = gguf_engine.runner.params
    cfg = gguf_engine.runner.config
    assert "lm_head" not in params  # tied: the head is the embedding's blocks
    for name in ("embed", "wq", "wkv", "wo", "w_gate_up", "w_down"):
        assert isinstance(params[name], GgufWeight) and params[name].data.dtype == "uint8"
    assert params["embed"].shape == (cfg.hidden_size, cfg.vocab_size)


def test_the_budget_counts_the_files_blocks(gguf_engine):
    from gguf import GGUFReader  # the file's own tensor sizes: the independent count

    reader = GGUFReader(str(resolve_model("smollm2-135m").path))
    blocks = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name != "F32")
    norms = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type.name == "F32")
    assert gguf_engine.budget.weight_bytes == blocks + 2 * norms  # norms in bf16


def test_quantization_gguf_needs_a_gguf_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # an HF directory: refused before it is read
    with pytest.raises(ValueError, match=r"quantization='gguf' keeps a GGUF file's blocks: it "
                                         r"needs a GGUF model .*; model '.*' is hf"):
        Engine(EngineConfig(model=str(tmp_path), quantization="gguf", **FAST))
    with pytest.raises(ValueError, match="is gguf with random_weights"):
        Engine(EngineConfig(quantization="gguf", random_weights=True, **FAST))


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_the_load_dequantizes_each_tensor_once_and_never_the_kept_blocks(monkeypatch,
                                                                          quantization):
    """A load reads a tensor when the decoder's parameters ask for it: "none" dequantizes every
    tensor of the file once, "gguf" only those not kept in their blocks (the F32 norms)."""
    from gguf import GGUFReader  # the file's own tensor list: the independent count

    reader = GGUFReader(str(resolve_model("smollm2-135m").path))
    sizes = {t.tensor_type.name: 0 for t in reader.tensors}
    for t in reader.tensors:
        sizes[t.tensor_type.name] += int(t.n_elements)
    read = {name: 0 for name in sizes}
    dequantize = gguf_file.quants.dequantize

    def counted(data, kind):
        out = dequantize(data, kind)
        read[kind.name] += out.size
        return out

    monkeypatch.setattr(gguf_file.quants, "dequantize", counted)
    prep = builder.prepare(EngineConfig(quantization=quantization, **FAST), 1)
    want = sizes if quantization == "none" else {k: v * (k == "F32") for k, v in sizes.items()}
    assert read == want
    assert all(isinstance(prep.weights[n], GgufWeight) == (quantization == "gguf")
               for n in ("wq", "wkv", "wo", "w_gate_up", "w_down", "embed"))
