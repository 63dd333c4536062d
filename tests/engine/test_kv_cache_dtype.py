"""`kv_cache_dtype="int8"` through the engine: greedy tokens of the tiny models of every family
(tests/hf_families.py, tests/hf_moe.py) with an int8 KV cache against the same engine's with
its own ("auto") cache (issue 51: equal on at least 90% of 24-token continuations), the same
int8 tokens on every attention path, and prefix-cache hits on int8 blocks.

The engines compute in float32, so that the cache's storage is the only difference: these
random tiny models have near-tied logits, and bf16 compute alone moves their greedy tokens
(measured: a bf16 engine's 24-token continuations equal the f32 engine's on 10 of 16 for
phi3, llama3, qwen3_moe, qwen2_moe_mixed), which would drown what the int8 cache does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
import hf_moe  # noqa: E402
from hf_families import NEW_TOKENS, PROMPTS  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
FAST = dict(dtype="float32", max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32,
            warmup=False, show_progress=False)
MODELS = {**{n: hf_families.write for n in hf_families.FAMILIES},
          **{n: hf_moe.write for n in hf_moe.MODELS}}


def greedy(path, **options) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(path), **{**FAST, **options}))
    try:
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            MODELS[name](name, made[name])
        return made[name]

    return get


def test_int8_kv_greedy_tokens_equal_the_models_dtypes(checkpoint):
    """Every family's and MoE model's 4 prompts: at least 90% of the 24-token continuations
    with int8 KV equal the f32 KV engine's, token for token."""
    same, total, report = 0, 0, []
    for name in MODELS:
        path = checkpoint(name)
        want, got = greedy(path), greedy(path, kv_cache_dtype="int8")
        equal = sum(a == b for a, b in zip(want, got, strict=True))
        same, total = same + equal, total + len(want)
        report.append(f"{name} {equal}/{len(want)}")
    print("; ".join(report))
    assert same >= 0.9 * total, "; ".join(report)


@pytest.mark.parametrize("name", ["gemma2", "phi3"])  # windows, soft-caps, scale; partial RoPE
def test_int8_kv_tokens_alike_on_every_attention_path(checkpoint, name):
    """The C++ kernel (which writes the int8 rows itself), XLA and Pallas (interpreted) read
    and write the same int8 cache: the same greedy tokens."""
    path = checkpoint(name)
    kernel = greedy(path, kv_cache_dtype="int8", attention="kernel")
    assert greedy(path, kv_cache_dtype="int8", attention="xla") == kernel
    assert greedy(path, kv_cache_dtype="int8", attention="pallas-interpret",
                  max_num_seqs=2) == kernel


def test_int8_kv_prefix_cache_hits_give_the_uncached_tokens(checkpoint):
    """A prompt sharing a cached 96-token prefix reads the int8 blocks another request wrote:
    its tokens are those of an engine without the prefix cache."""
    prompt = PROMPTS[3]  # 100 tokens
    second = [prompt[:-1] + [9]]
    engine = Engine(EngineConfig(model=str(checkpoint("qwen3")), kv_cache_dtype="int8",
                                 **FAST))
    try:
        engine.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
        got = engine.generate(prompt_token_ids=second, sampling_params=GREEDY)
        assert engine.stats()["prefix_cache_hit_tokens"] >= 80
    finally:
        engine.close()
    uncached = Engine(EngineConfig(model=str(checkpoint("qwen3")), kv_cache_dtype="int8",
                                   prefix_caching=False, **FAST))
    try:
        want = uncached.generate(prompt_token_ids=second, sampling_params=GREEDY)
    finally:
        uncached.close()
    assert list(got[0].outputs[0].token_ids) == list(want[0].outputs[0].token_ids)
