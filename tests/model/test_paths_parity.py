"""Every implementation the machine runs gives the same greedy tokens, forced in turn
(`EngineConfig.attention`, `EngineConfig.matmul`): f32 against HF transformers with each
attention, bf16 on each matmul path against bf16 on XLA's dot everywhere."""

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


def greedy(**kwargs) -> list[list[int]]:
    with Engine(EngineConfig(**{**ENGINE_KWARGS, **kwargs})) as engine:
        return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY,
                                                                 use_tqdm=False)]


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
def test_f32_greedy_matches_hf_with_each_attention(attention, hf_greedy):
    from jaxpipe.kernels import ragged_attention

    if attention == "kernel" and not ragged_attention.available():
        pytest.skip("the C++ attention kernel does not build here")
    assert greedy(attention=attention) == hf_greedy


@pytest.fixture(scope="module")
def bf16_on_xla() -> list[list[int]]:
    return greedy(dtype="bfloat16", matmul="xla", attention="xla")


@pytest.mark.parametrize("path", matmul.PATHS)
def test_bf16_tokens_are_the_same_on_each_kernel_path(path, bf16_on_xla):
    if path not in matmul.paths():
        pytest.skip(f"no {path} path here: this CPU's build has {', '.join(matmul.paths())}")
    assert greedy(dtype="bfloat16", matmul=path) == bf16_on_xla
