"""Every implementation the machine runs gives the same greedy tokens, forced in turn
(`EngineConfig.attention`, `EngineConfig.matmul`): f32 SmolLM2-135M against HF transformers
with each attention, and bf16 on each matmul path against bf16 on XLA's dot everywhere on the
two-layer SmolLM2 of tests/conftest.py (the kernel's numerics on SmolLM2-135M's own shapes
are checked against float64 in tests/kernel_tests/test_matmul.py; here, that the step runs it on
every matmul: full panels and narrow tails, the fused gate, the LM head)."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KWARGS

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.kernels import matmul

torch = pytest.importorskip("torch")

PROMPTS = ["The capital of France is", "def fib(n):\n", "1, 2, 3,",
           "Once upon a time, in a small village at the edge of a great forest,"]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def greedy(**kwargs) -> list[list[int]]:
    with Engine(EngineConfig(**{**ENGINE_KWARGS, **kwargs})) as engine:
        return tokens(engine)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, hf_tokenizer) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
        with torch.no_grad():
            seq = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    pad_token_id=2)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("attention", ["kernel", "xla"])
def test_f32_greedy_matches_hf_with_each_attention(attention, hf_greedy, engine):
    from jaxpipe.kernels import ragged_attention

    if attention == "kernel" and not ragged_attention.available():
        pytest.skip("the C++ attention kernel does not build here")
    # The shared engine is ENGINE_KWARGS on the attention this machine measured fastest: the
    # kernel's run where that is the kernel, a second engine's otherwise.
    runs_it = engine.runner.attention == {"kernel": "cpu"}.get(attention, attention)
    assert (tokens(engine) if runs_it else greedy(attention=attention)) == hf_greedy


# The fused gate takes whole panel pairs: an MLP width of 2 panels (the default's 67 is none).
BF16 = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, warmup=False,
            show_progress=False)


@pytest.fixture(scope="module")
def tiny_gated(tiny_smollm2_with) -> str:
    return tiny_smollm2_with(intermediate_size=2 * matmul.PANEL)


@pytest.fixture(scope="module")
def bf16_on_xla(tiny_gated) -> list[list[int]]:
    with Engine(EngineConfig(model=tiny_gated, matmul="xla", attention="xla", **BF16)) as engine:
        assert {c for m in engine.runner.kernel_choices()["matmul"].values()
                for c in m.values()} == {"xla"}
        return tokens(engine)


@pytest.mark.parametrize("path", matmul.PATHS)
def test_bf16_tokens_are_the_same_on_each_kernel_path(path, tiny_gated, bf16_on_xla):
    if path not in matmul.paths():
        pytest.skip(f"no {path} path here: this CPU's build has {', '.join(matmul.paths())}")
    with Engine(EngineConfig(model=tiny_gated, matmul=path, **BF16)) as engine:
        choices = engine.runner.kernel_choices()["matmul"]
        assert {c for m in choices.values() for c in m.values()} == {path}, choices
        gate_up = engine.runner.placements["prefill"].packed["w_gate_up"].args[0]  # a Matmul
        assert gate_up.gated, gate_up
        assert tokens(engine) == bf16_on_xla
