"""Prompt logprobs on 8 devices equal one device's (f32, 1e-4): a tp layout and pipelined
ones (micro-batches flowing through the stages), prompts prefilled whole and in 7-token
chunks, beside a request that asks for none."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.scheduler import make_policy

FAST = dict(dtype="float32", max_model_len=128, max_num_seqs=4, warmup=False,
            show_progress=False)
RNG = np.random.default_rng(5)
SCORED = [int(t) for t in RNG.integers(0, TINY.vocab_size, 37)]
PLAIN = [int(t) for t in RNG.integers(0, TINY.vocab_size, 23)]
K = 4


def run(engine: Engine, chunk: int | None):
    """(prompt logprobs, ranks) of SCORED, prefilled beside PLAIN (which asks for none)."""
    if chunk is not None:
        engine.executor.policy = make_policy("prefill_first", max_prefill_tokens=chunk)
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    out, other = engine.generate(prompt_token_ids=[SCORED, PLAIN],
                                 sampling_params=[scored, plain])
    assert other.prompt_logprobs is None
    return out.prompt_logprobs, out.prompt_ranks


@pytest.fixture(scope="module")
def reference(tiny_orbax):
    engine = Engine(EngineConfig(model=str(tiny_orbax), **FAST))
    try:
        return run(engine, None)
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["tp=8", "pp=8", "pp=4,tp=2"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_layout_equals_one_device(tiny_orbax, reference, layout, chunk):
    engine = Engine(EngineConfig(model=str(tiny_orbax), mesh="cpu-8", prefill=layout,
                                 decode=layout, **FAST))
    try:
        got, ranks = run(engine, chunk)
    finally:
        engine.close()
    want, want_ranks = reference
    assert got[0] is None and len(got) == len(want) == len(SCORED)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert list(g)[0] == list(w)[0]  # the prompt's token first
        np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4, rtol=0)
    assert ranks == want_ranks
