"""Mistral: Llama's layer with a sliding window on every layer (HF's default 4096 where
config.json has none); llama.cpp permutes its Q/K rows as Llama's."""

from __future__ import annotations

from jaxpipe.model.families import llama
from jaxpipe.model.family import Family

FAMILY = Family(
    name="mistral", hf_architectures=("MistralForCausalLM",), hf_model_types=("mistral",),
    gguf_architectures=("mistral",), hf_names=llama.HF_NAMES, gguf_names=llama.GGUF_NAMES,
    hf_defaults={"sliding_window": 4096}, gguf_value=llama.unpermute_qk)
