"""Structured outputs on 8 devices: constrained rows of every kind (greedy and seeded) beside
unconstrained ones give the single-device engine's tokens on a flowing pipeline (pp > 1: a
sequence waits for its micro-batch anyway) and under seesaw, whose prefills wait in the host
tier and whose decode runs on another layout."""

from __future__ import annotations

import pytest
from structured_workload import mixed_run

from jaxpipe import Engine, EngineConfig

FAST = dict(dtype="float32", max_model_len=64, warmup=False, show_progress=False,
            max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(tiny_smollm2):
    engine = Engine(EngineConfig(model=tiny_smollm2, **FAST))
    try:
        return mixed_run(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("prefill, decode, policy", [
    ("pp=4,tp=2", "pp=4,tp=2", "throttle"),
    ("pp=2,tp=4", "pp=2,tp=4", "prefill_first"),
    ("pp=8", "tp=8", "seesaw"),
])
def test_layouts_give_the_one_device_tokens(tiny_smollm2, reference, prefill, decode, policy):
    engine = Engine(EngineConfig(model=tiny_smollm2, mesh="cpu-8", prefill=prefill,
                                 decode=decode, scheduler=policy, host_kv_tokens=4096, **FAST))
    try:
        assert mixed_run(engine) == reference
    finally:
        engine.close()
