"""`jaxpipe_bench.profile` (scripts/profile_step.py) reads the step's own compiled program: its
module name is one the profiler classifies op by op, and its kernel calls land in the
matmul and attention families (a renamed step program was once counted whole as "swaps")."""

from __future__ import annotations

import re

import pytest

from jaxpipe.kernels import ragged_attention
from jaxpipe_bench import profile


def test_the_step_program_is_classified_by_instruction(tiny_smollm2):
    if not ragged_attention.available():
        pytest.skip("the C++ attention kernel cannot be built here")
    from jaxpipe import Engine, EngineConfig
    from jaxpipe.runtime.synthetic_step import padding_inputs

    with Engine(EngineConfig(model=tiny_smollm2, max_model_len=64, max_num_seqs=2,
                             warmup=False, show_progress=False, kv_cache_tokens=256,
                             attention="kernel")) as engine:
        runner = engine.runner
        hlo = runner.lowered(padding_inputs(runner, 8)).compile().as_text()
    name = re.search(r"^HloModule (\S+?)[,\s]", hlo, re.M).group(1)
    assert name in profile.PROGRAMS and profile.PROGRAMS[name] is None, name
    families = set(profile.instruction_families(hlo).values())
    assert {"matmuls", "attention", "other"} <= families, families
