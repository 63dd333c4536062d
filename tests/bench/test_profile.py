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


HLO = """HloModule jit_tick, entry_computation_layout={()->f32[4]{0}}

%fused_dot (x: f32[4,4], y: f32[4]) -> f32[4] {
  %x = f32[4,4] parameter(0)
  %y = f32[4] parameter(1)
  ROOT %d.1 = f32[4] dot(f32[4,4] %x, f32[4] %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (a: f32[4,4], b: f32[4]) -> f32[4] {
  %a = f32[4,4] parameter(0)
  %b = f32[4] parameter(1)
  %fusion.2 = f32[4] fusion(f32[4,4] %a, f32[4] %b), kind=kOutput, calls=%fused_dot
  %ar.3 = f32[4] all-reduce(f32[4] %fusion.2), replica_groups={{0,1}}, to_apply=%add
  %cp-start.4 = (f32[4], f32[4]) collective-permute-start(f32[4] %ar.3), source_target_pairs={{0,1}}
  %cp-done.5 = f32[4] collective-permute-done((f32[4], f32[4]) %cp-start.4)
  ROOT %add.6 = f32[4] add(f32[4] %cp-done.5, f32[4] %b)
}
"""


def test_cross_device_ops_are_their_own_family():
    """The stage hand-over and tp's psums are counted apart from the step's other ops, so a
    pipelined layout's profile shows what its collectives cost (issue 48's "where the time
    goes"); the dot fusion stays a matmul, the add "other"."""
    families = profile.instruction_families(HLO)
    assert families["ar.3"] == "collectives"
    assert families["cp-start.4"] == "collectives"
    assert families["cp-done.5"] == "collectives"
    assert families["fusion.2"] == "matmuls"
    assert families["add.6"] == "other"
