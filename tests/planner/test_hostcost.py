"""Host time in the simulator: on the critical path (pp - 1 in flight, every stage waits) it
costs throughput that pp in flight hides; without host time the two depths run alike."""

from __future__ import annotations

import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.hostcost import NO_HOST, HostCost
from jaxpipe.planner.simulate import simulate
from jaxpipe.planner.workloads import constant

PP4 = Layout(pp=4)
CHUNKED = {"chunked": True, "max_prefill_tokens": 2048, "pipelined": True}


@pytest.fixture(scope="module")
def setup():
    return resolve_model("llama2-13b").config, load_mesh("l20x4-pcie")


def _run(setup, w, host, in_flight):
    model, mesh = setup
    return simulate(model, mesh, w, "prefill_first", PP4, host_cost=host, in_flight=in_flight,
                    **CHUNKED)


def _tick(setup, rows: int, context: int) -> float:
    model, mesh = setup
    return CostModel(model, mesh.hardware, PP4).stage_time(rows, rows * context,
                                                           rows * context, rows)


def test_host_on_the_critical_path_costs_what_pp_in_flight_hides(setup):
    w = constant(64, 32, 96)
    host = HostCost(prepare_s=_tick(setup, 16, 96))  # about one decode tick
    blocking, overlapped = (_run(setup, w, host, n) for n in (3, 4))
    assert blocking.finished == overlapped.finished == 64
    assert overlapped.throughput > 1.3 * blocking.throughput
    assert blocking.stats.host_seconds == pytest.approx(
        host.prepare_s * blocking.stats.decode_steps, rel=0.2)


def test_without_host_time_one_sequence_runs_alike_at_either_depth(setup):
    w = constant(1, 32, 64)  # one sequence: each micro-batch waits for the last either way
    blocking, overlapped = (_run(setup, w, NO_HOST, n) for n in (3, 4))
    assert blocking.seconds == pytest.approx(overlapped.seconds, rel=1e-9)
    slow = _run(setup, w, HostCost(prepare_s=_tick(setup, 1, 64)), 3)
    assert slow.seconds > 1.5 * blocking.seconds


def test_without_host_time_either_depth_serves_a_full_batch_alike(setup):
    """All 64 sequences are in the 4 micro-batches in flight, so pp in flight forms nothing
    early: the same micro-batches, the same seconds."""
    w = constant(64, 32, 96)
    blocking, overlapped = (_run(setup, w, NO_HOST, n) for n in (3, 4))
    assert blocking.stats.mean_decode_batch == overlapped.stats.mean_decode_batch == 16
    assert blocking.throughput == pytest.approx(overlapped.throughput, rel=1e-9)


def test_the_sampler_placement_and_waiting_stages(setup):
    w = constant(64, 32, 96)
    row = _tick(setup, 16, 96) / 16
    device = _run(setup, w, HostCost(sample_per_row_s=row), 3)
    host = _run(setup, w, HostCost(sample_per_row_s=row, sampler="host"), 3)
    free = _run(setup, w, NO_HOST, 3)
    assert free.throughput > host.throughput and free.throughput > device.throughput
    assert host.stats.host_seconds > 0 == device.stats.host_seconds
    waiting = _run(setup, w, HostCost(prepare_s=row * 16), 3)
    ahead = _run(setup, w, HostCost(prepare_s=row * 16, stages_wait=False), 3)
    assert ahead.throughput > 1.2 * waiting.throughput


def test_single_step_executor_waits_for_the_host(setup):
    model, mesh = setup
    w = constant(16, 32, 32)
    free = simulate(model, mesh, w, "prefill_first", Layout(tp=4))
    busy = simulate(model, mesh, w, "prefill_first", Layout(tp=4),
                    host_cost=HostCost(prepare_s=1e-3))
    assert busy.stats.host_seconds > 0
    assert busy.seconds == pytest.approx(free.seconds + busy.stats.host_seconds)


@pytest.mark.parametrize("kwargs,match", [({"sampler": "gpu"}, "sampler"),
                                          ({"prepare_s": -1.0}, "prepare_s")])
def test_bad_host_costs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostCost(**kwargs)


def test_in_flight_outside_pp_minus_one_and_pp_is_refused(setup):
    with pytest.raises(ValueError, match="in_flight=2"):
        _run(setup, constant(2, 8, 8), NO_HOST, 2)
