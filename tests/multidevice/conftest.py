"""Fixtures for tests on 8 virtual CPU devices (this directory runs in its own process; see
tests/test_multidevice.py). Models are saved once as orbax checkpoints, so every engine here
loads fast and exercises restoring straight into a layout's shardings."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend

# The families' layouts are checked against HF transformers: where torch or transformers is
# absent (make test-jax-latest's environment), that file is not collected rather than skipped,
# since tests/test_multidevice.py fails a child run that skipped anything.
collect_ignore = ([] if all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
                  else ["test_families_layouts.py", "test_moe_layouts.py",
                        "test_moe_grouped_layouts.py", "test_moe_ep.py"])

from prefix_workload import tokens  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.config.model import ModelConfig  # noqa: E402
from jaxpipe.model import decoder, loading, orbax_dir  # noqa: E402
from jaxpipe.model.presets import resolve_model  # noqa: E402

# Prime sizes, so a swapped or mis-padded axis fails loudly. 5 layers split unevenly over any
# pp > 1; 7 KV heads (GQA groups of 2) split unevenly over any tp > 1; mlp and vocab too.
TINY = ModelConfig(vocab_size=251, hidden_size=37, intermediate_size=53, num_layers=5,
                   num_heads=14, num_kv_heads=7, head_dim=6, tie_embeddings=False,
                   max_position_embeddings=512, eos_token_ids=(250,))
# The layout pairs (prefill, decode) the issue names.
PAIRS = [("pp=8", "tp=8"), ("pp=4,tp=2", "tp=4,pp=2"), ("pp=2,tp=4", "tp=8"),
         ("pp=8", "pp=2,tp=4")]


Workload = tuple[list[list[int]], list[SamplingParams]]  # prompts, each one's params


def greedy_workload(seed: int, count: int, prompt_tokens: tuple[int, int],
                    new_tokens: tuple[int, int]) -> Workload:
    """`count` greedy requests (ignoring EOS) of TINY's tokens, seeded: prompts of
    `prompt_tokens` (low, high: high excluded) tokens, each generating `new_tokens` (likewise)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY.vocab_size - 1, rng.integers(*prompt_tokens)).tolist()
               for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(*new_tokens, count)]
    return prompts, params


def one_layout_engine(model, layout: str, **fields) -> Engine:
    """An engine of the checkpoint `model` on the 8 devices with prefill and decode both on
    `layout` (the pipeline flowing in every phase); `fields`: the rest of its `EngineConfig`."""
    return Engine(EngineConfig(model=str(model), mesh="cpu-8", prefill=layout, decode=layout,
                               **fields))


def one_device_tokens(model, workload: Workload, **fields) -> list[list[int]]:
    """The reference of the engines on 8 devices: the single-device engine's tokens for
    `workload` (the checkpoint `model`, the prefix cache off, `fields` the rest of its
    `EngineConfig`)."""
    engine = Engine(EngineConfig(model=str(model), prefix_caching=False, **fields))
    try:
        prompts, params = workload
        return tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params))
    finally:
        engine.close()


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: run through tests/test_multidevice.py")


@pytest.fixture(scope="session")
def tiny_values() -> dict[str, np.ndarray]:
    return decoder.numpy_random_values(TINY, seed=3)


@pytest.fixture(scope="session")
def tiny_orbax(tmp_path_factory, tiny_values):
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    orbax_dir.save_orbax(path, TINY, tiny_values, "float32")
    return path


@pytest.fixture(scope="session")
def smollm2_source():
    try:
        return resolve_model("smollm2-135m")
    except (ValueError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 weights unavailable: {err}")


@pytest.fixture(scope="session")
def smollm2(smollm2_source):
    """(ModelConfig, {name: f32 array}) of SmolLM2-135M from its GGUF."""
    return loading.load_weights(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_orbax(tmp_path_factory, smollm2, smollm2_source):
    """SmolLM2 as an orbax checkpoint with its tokenizer (loads in about a second)."""
    cfg, values = smollm2
    path = tmp_path_factory.mktemp("smollm2") / "ckpt"
    orbax_dir.save_orbax(path, cfg, values, "float32")
    loading.load_tokenizer(smollm2_source).save(path)
    return path
