"""The simulator's token-safe execution (`PipelinedSimExecutor(token_safe=True)`), the engine's
flowing pipeline: a micro-batch's sequences join the next one once it left the last stage, never
entering stage 0 before their token is there; host preparation is hidden behind the stages
without the extra, smaller micro-batch that pp in flight forms."""

from __future__ import annotations

import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.hostcost import NO_HOST, HostCost
from jaxpipe.planner.simulate import PipelinedSimExecutor, make_states, simulate
from jaxpipe.planner.workloads import constant, synthetic
from jaxpipe.scheduler import Driver, make_policy

PP4 = Layout(pp=4)
CHUNKED = {"chunked": True, "max_prefill_tokens": 2048, "pipelined": True}


@pytest.fixture(scope="module")
def setup():
    return resolve_model("llama2-13b").config, load_mesh("l20x4-pcie")


def _run(setup, w, host, **mode):
    model, mesh = setup
    return simulate(model, mesh, w, "prefill_first", PP4, host_cost=host, **CHUNKED, **mode)


def _tick(setup, rows: int, context: int) -> float:
    model, mesh = setup
    return CostModel(model, mesh.hardware, PP4).stage_time(rows, rows * context,
                                                           rows * context, rows)


class Recording(PipelinedSimExecutor):
    """Records, per micro-batch, when it entered stage 0 and, per decoded sequence, when its
    token of the micro-batch before was ready and whether that one had landed yet."""

    def __init__(self, cost, host, **mode):
        super().__init__(cost, host, **mode)
        self.token_ready: dict = {}  # seq id -> when its last sampled token was ready
        self.entries: list[tuple[float, float]] = []  # (entry, its token's readiness)
        self.unlanded: dict = {}  # seq id -> its micro-batch in flight, not landed
        self.early = 0  # decode rows whose previous micro-batch had not landed

    def launch(self, runs, state):
        (run,) = runs
        handle = super().launch(runs, state)
        entry = self.stages[0] - self._last_dt
        for seq in run.decode:
            self.early += seq.seq_id in self.unlanded
            if seq.seq_id in self.token_ready or seq.seq_id in self.unlanded:
                before = self.unlanded.get(seq.seq_id)
                ready = self.token_ready.get(seq.seq_id) if before is None else before
                self.entries.append((entry, ready))
        for seq in handle.sampling:
            self.unlanded[seq.seq_id] = handle
        return handle

    def _stage_time(self, run, state):
        self._last_dt = super()._stage_time(run, state)
        return self._last_dt

    def land(self, handle, state):
        ended = super().land(handle, state)
        for seq in handle.sampling:
            if self.unlanded.get(seq.seq_id) is handle:
                del self.unlanded[seq.seq_id]
            self.token_ready[seq.seq_id] = handle.ready
        return ended

    def resolve(self):
        """Each recorded wait's readiness: a micro-batch not landed at launch has its
        `ready` by now."""
        return [(entry, r.ready if not isinstance(r, float) else r) for entry, r in self.entries]


def _recorded(setup, w, host, **mode) -> Recording:
    model, mesh = setup
    cost = CostModel(model, mesh.hardware, PP4)
    (state,) = make_states(model, w, cost, cost, 16.0)
    policy = make_policy("prefill_first", chunked=True, max_prefill_tokens=2048,
                         two_layouts=False)
    executor = Recording(cost, host, **mode)
    Driver(policy, state, executor).run()
    assert state.num_finished == len(w.requests)
    return executor


@pytest.mark.parametrize("host", [NO_HOST, HostCost(sample_per_row_s=2e-5, sampler="host")],
                         ids=["device-sampler", "host-sampler"])
def test_a_sequence_joins_the_next_micro_batch_before_landing_but_never_before_its_token(
        setup, host):
    w = synthetic("sharegpt", 60, seed=1)
    safe = _recorded(setup, w, host, token_safe=True)
    assert safe.early > 0  # released when it left, before it landed
    waits = safe.resolve()
    assert waits and all(entry >= ready - 1e-12 for entry, ready in waits)
    assert _recorded(setup, w, host, in_flight=3).early == 0  # waits for the landing


def test_without_host_time_token_safe_runs_as_pp_minus_one(setup):
    """The same dependency rule: with no host work the same micro-batches and about the same
    seconds (a prompt chunk, which waits for no token, may enter before the landing pp - 1
    waits for); pp in flight instead forms smaller ones from the sequences it frees early."""
    w = synthetic("sharegpt", 120, seed=0)
    blocking, safe = _run(setup, w, NO_HOST, in_flight=3), _run(setup, w, NO_HOST, token_safe=True)
    assert safe.stats.mean_decode_batch == blocking.stats.mean_decode_batch
    assert safe.stats.decode_steps == blocking.stats.decode_steps
    assert blocking.seconds * 0.99 <= safe.seconds <= blocking.seconds * (1 + 1e-9)
    wide = _run(setup, w, NO_HOST, in_flight=4)
    assert wide.stats.mean_decode_batch < safe.stats.mean_decode_batch


def test_token_safe_hides_the_preparation_the_blocking_pipeline_waits_for(setup):
    w = constant(64, 32, 96)
    host = HostCost(prepare_s=_tick(setup, 16, 96))  # about one decode tick
    blocking = _run(setup, w, host, in_flight=3)
    safe, free = _run(setup, w, host, token_safe=True), _run(setup, w, NO_HOST, token_safe=True)
    assert safe.finished == 64 and safe.stats.host_seconds == blocking.stats.host_seconds
    assert safe.throughput > 1.3 * blocking.throughput
    assert safe.throughput == pytest.approx(free.throughput, rel=0.05)


def test_the_host_sampler_stays_on_the_path_of_token_safe_execution(setup):
    """Stage 0 needs a sampled token: the host's sampling of each micro-batch delays the one
    that takes its sequences (the engine's host sampler does the same)."""
    w = constant(64, 32, 96)
    row = _tick(setup, 16, 96) / 16
    sampled = _run(setup, w, HostCost(sample_per_row_s=row, sampler="host"), token_safe=True)
    free = _run(setup, w, NO_HOST, token_safe=True)
    assert sampled.stats.host_seconds == pytest.approx(row * 64 * 96, rel=1e-6)
    assert sampled.throughput < 0.9 * free.throughput


@pytest.mark.parametrize("mode,match", [({"token_safe": True, "in_flight": 3}, "in_flight=3"),
                                        ({"token_safe": True, "pipelined": False,
                                          "policy": "prefill_first"}, "token_safe")])
def test_token_safe_outside_the_flowing_pipeline_is_refused(setup, mode, match):
    model, mesh = setup
    options = dict(CHUNKED, **mode)
    policy = options.pop("policy", "prefill_first")
    with pytest.raises(ValueError, match=match):
        simulate(model, mesh, constant(2, 8, 8), policy, PP4, **options)
