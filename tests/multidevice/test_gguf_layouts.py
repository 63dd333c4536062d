"""quantization="gguf" on 8 virtual devices (the default model's Q4_1 file): a pipeline
layout keeps each layer's blocks whole on its stage and runs the single-device arithmetic
exactly (one GGUF kernel path forced in both, so no row count changes the summation order;
30 layers padded to 32, the identity layers' zero blocks adding nothing), so its greedy
tokens equal the single-device gguf engine's; and a runner on pp=2 (XLA's reference of the
formats, no kernel choice) gives the single-device runner's logits. A layout with tp is
split over tp: a row-split weight (wo, w_down) keeps its rows in groups of whole blocks, so
each device multiplies its slice of K and the sums over tp are the whole product; engines on
tp layouts agree with the single-device engine as closely as tp's other summation order
allows."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from prefix_workload import tokens
from quant_agreement import agreement, scores

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.config.layout import Layout
from jaxpipe.kernels import gguf_matmul
from jaxpipe.model import gguf_weights
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.gguf_file import gguf_config, open_gguf
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import Quantization
from jaxpipe.runtime import sharding, step_inputs
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


@pytest.mark.parametrize("name", ["wo", "w_down"])
def test_a_row_split_weight_on_tp4_gives_the_whole_product(smollm2_source, name):
    """A row-split weight placed in a runner's shardings on tp=4 (`sharding.param_shardings`;
    wo's 9 heads padded to 12 with zero groups; its groups split over tp,
    `gguf_quantized.GROUPS`): each device's GGUF kernel product of its slice of K, summed
    over tp, is the whole weight's reference product on one device."""
    cfg = gguf_config(open_gguf(smollm2_source.path))
    kept = gguf_weights.kept_weights(smollm2_source.path, cfg)
    quant = Quantization("gguf", True, tuple((n, w.kind) for n, w in kept.items()))
    layout = Layout(tp=4)
    padding = sharding.padding_for(cfg, [layout])
    padded = sharding.pad_blocks(name, param_decls(cfg)[name], kept[name], padding)
    mesh = sharding.make_mesh(layout, jax.devices()[:4])
    place = sharding.param_shardings(cfg, padding, layout, mesh, quant)[name]
    w = jax.device_put(padded, place)
    spec = jax.tree.map(lambda s: s.spec, place)
    layer = cfg.num_layers - 1
    k = math.prod(padded.shape[1:1 + len(padded.k_shape)])
    x = np.random.default_rng(7).normal(size=(5, k)).astype(np.float32)

    def local(w, x):  # this device's [N, K / 4] rows and x [5, K / 4]
        assert w.rows().shape[-2:] == (cfg.hidden_size, padded.rows().shape[-1] // 4)
        y = gguf_matmul.gguf_matmul(x, w.rows(), w.kind, layer, path=kernel_path()) \
            if gguf_matmul.paths() else w[layer].dot(x)
        return lax.psum(y, "tp")

    got = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(None, "tp")), out_specs=P(),
                        check_vma=False)(w, jnp.asarray(x))
    whole = np.asarray(padded[layer].reshape(k, -1).dot(jnp.asarray(x)))
    np.testing.assert_allclose(np.asarray(got), whole, rtol=1e-5,
                               atol=1e-5 * np.abs(whole).max())


def test_tp_layout_pairs_agree_with_one_device(smollm2_source):
    """pp=4,tp=2 prefill / tp=4,pp=2 decode on the GGUF kernel (a switch each way): the greedy
    run completes, and teacher-forced, >= 95% of top-1 tokens agree with the single-device
    gguf engine, the sequence's own token's logprob within 0.05 (median). Not the same
    tokens: tp's summed partial products (another f32 order) move activations by ~1e-6,
    which flips a few of their q8 codes, each worth amax / 127."""
    engine = Engine(EngineConfig(**gguf_fields()))
    try:
        greedy = tokens(engine.generate(PROMPTS, [GREEDY] * len(PROMPTS)))
        seqs = [engine.tokenizer.encode(p) + t for p, t in zip(PROMPTS, greedy, strict=True)]
        want = scores(engine, seqs)
    finally:
        engine.close()
    engine = Engine(EngineConfig(**gguf_fields(), mesh="cpu-8", prefill="pp=4,tp=2",
                                 decode="tp=4,pp=2"))
    try:
        assert engine.runner.params["wo"].grouped
        got = tokens(engine.generate(PROMPTS, [GREEDY] * len(PROMPTS)))
        same, diff = agreement(want, scores(engine, seqs), seqs)
        assert engine.stats()["reshards"] >= 1
    finally:
        engine.close()
    assert [len(t) for t in got] == [len(t) for t in greedy]
    assert same >= 0.95 and diff < 0.05, (same, diff)


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
