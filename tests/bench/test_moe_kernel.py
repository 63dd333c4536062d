"""scripts/bench_moe_kernel.py's logic: one tiny point times every experts path of
`model/moe.py` by its name (the keyword `experts_mlp` takes), and leaves "ragged" out past its
FLOP budget."""

from __future__ import annotations

import pytest

from jaxpipe.kernels import matmul
from jaxpipe_bench import moe_kernel

pytestmark = pytest.mark.skipif(not matmul.available(),
                                reason="the grouped kernel cannot be built here")


def test_a_point_times_each_experts_path_by_name():
    point = moe_kernel.measure(4, 2, 16, 16, tokens=8, rounds=1, ragged_max_gflop=20.0)
    assert set(point["ms"]) == set(moe_kernel.EXPERTS_PATHS) == {"dense", "ragged", "grouped"}
    assert all(ms > 0 for ms in point["ms"].values())
    assert point["rows_per_expert"] == 8 * 2 / 4
    assert "-" not in moe_kernel.format_table([point]).splitlines()[1]


def test_ragged_is_left_out_past_its_flop_budget():
    point = moe_kernel.measure(4, 2, 16, 16, tokens=8, rounds=1, ragged_max_gflop=0.0)
    assert set(point["ms"]) == {"dense", "grouped"}
