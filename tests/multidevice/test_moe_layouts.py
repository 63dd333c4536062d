"""Mixtures of experts on cpu-8 layout pairs, re-sharding between prefill and decode: greedy
tokens (f32) equal HF transformers' on the same tiny checkpoint (`hf_moe`). Tensor
parallelism splits each expert's hidden columns (`moe_mlp`, 19 / 29 wide: padded for tp=4
and 8) and the shared expert's; pp > 1 pads the 2 layers with identity layers, whose
all-zero routers tie every expert."""

from __future__ import annotations

import pytest
from hf_families import assert_layout_pair_matches_hf, layout_reference_fixture
from hf_moe import write

NEW_TOKENS = 16
PAIRS = [("pp=2,tp=4", "tp=8"), ("pp=8", "pp=2,tp=4")]

model = layout_reference_fixture(write, ["qwen2_moe", "mixtral"], NEW_TOKENS)


@pytest.mark.parametrize("prefill, decode", PAIRS)
def test_moe_layout_pair_matches_hf(model, prefill, decode):
    assert_layout_pair_matches_hf(model, prefill, decode, NEW_TOKENS)
