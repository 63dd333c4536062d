"""The families whose layers have parameters or attention Llama's has not (q/k/v biases, q/k
norms, Gemma's four norms, sliding windows, soft-caps, per-layer RoPE, Phi's fused weights
and partial LongRoPE) on cpu-8 layout
pairs, re-sharding between prefill and decode: greedy tokens (f32) equal HF transformers' on
the same tiny checkpoint (`hf_families`). One pair has pp > 1 over 3 layers (padded), both
have a tp degree (4, 8) that divides neither the 6 query heads nor the 2 kv heads."""

from __future__ import annotations

import pytest
from hf_families import assert_layout_pair_matches_hf, layout_reference_fixture, write

FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3_longrope")
PAIRS = [("pp=2,tp=4", "tp=8"), ("pp=8", "pp=2,tp=4")]

family = layout_reference_fixture(write, FAMILIES)


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_family_layout_pair_matches_hf(family, prefill, decode):
    assert_layout_pair_matches_hf(family, prefill, decode)
