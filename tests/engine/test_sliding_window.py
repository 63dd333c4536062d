"""Blocks behind a sliding window given back, through the engine: a tiny Mistral (every layer
windowed, 20 tokens; `hf_families`) in a device pool of 10 blocks that cannot hold its
requests without giving them back gives HF's f32 greedy tokens, on the C++ kernel and XLA's
attention (their contract: a table entry out of range before a query's window is never
read), and through the host tier (seesaw: a sequence swapped out with its first blocks
given back, and in again into blocks past its window only). A model with a global layer
(Gemma 2) keeps every block. The ledger's side: tests/scheduler/test_window.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
from hf_families import NEW_TOKENS, PROMPTS, WINDOW, hf_greedy, write  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.config.model import ModelConfig  # noqa: E402
from jaxpipe.engine.executor import every_layer_window  # noqa: E402

POOL = 160  # tokens: 10 blocks, one max_model_len sequence; PROMPTS + 24 tokens need 18
checkpoints = hf_families.checkpoint_fixture(write)


@pytest.fixture(scope="module")
def mistral(checkpoints):
    """(checkpoint directory, HF's greedy tokens of every prompt)."""
    _, model, path = checkpoints("mistral")
    return path, [hf_greedy(model, ids) for ids in PROMPTS]


def generate(engine: Engine) -> tuple[list[list[int]], int]:
    """Every prompt's greedy tokens, stepped by hand; and the most context tokens the device
    sequences had at once (more than the pool: they gave blocks back)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in PROMPTS]
    state, most = engine.executor.state, 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, sum(s.computed for s in state.device.values()))
    return [list(engine.pop_output(i).outputs[0].token_ids) for i in ids], most


@pytest.mark.parametrize("attention, scheduler", [("auto", "prefill_first"),
                                                  ("xla", "prefill_first"),
                                                  ("auto", "seesaw")])
def test_a_windowed_model_gives_back_blocks_and_hf_tokens(mistral, attention, scheduler):
    path, want = mistral
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=POOL,
                                 max_num_seqs=4, max_num_batched_tokens=32,
                                 kv_cache_tokens=POOL, attention=attention, scheduler=scheduler,
                                 host_kv_tokens=512 if scheduler == "seesaw" else 0,
                                 warmup=False, show_progress=False))
    try:
        state = engine.executor.state
        assert state.device_kv.blocks.window == WINDOW and state.device_kv.num_blocks == POOL // 16
        got, most = generate(engine)
        stats = engine.stats()
    finally:
        engine.close()
    assert got == want
    assert most > POOL  # the live contexts outgrew the pool: blocks behind were given back
    assert stats["device_kv_peak"] <= POOL
    if scheduler == "seesaw":
        assert stats["swap_in_bytes"] > 0


def test_only_a_model_windowed_in_every_layer_gives_blocks_back():
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=3,
                num_heads=2, num_kv_heads=1, head_dim=8)
    assert every_layer_window(ModelConfig(**base, sliding_window=WINDOW,
                                          sliding_layers=(0, 1, 2))) == WINDOW
    assert every_layer_window(ModelConfig(**base, sliding_window=WINDOW,
                                          sliding_layers=(0, 2))) == 0  # Gemma 2: a global one
    assert every_layer_window(ModelConfig(**base)) == 0
