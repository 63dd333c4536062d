"""vLLM V0's virtual engines in the simulator: each holds 1/pp of the KV and the requests
assigned to it, keeps one micro-batch in flight, and preempts on its own when its requests
outgrow its share, where one shared pool would not."""

from __future__ import annotations

from collections import Counter

import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.planner import MAX_NUM_SEQS
from jaxpipe.planner.simulate import PipelinedSimExecutor, make_states, simulate
from jaxpipe.planner.virtual_engines import VirtualEngines, assign
from jaxpipe.planner.workloads import Workload
from jaxpipe.scheduler import Kind, SchedulerState, SeqInfo, make_policy

PP4 = Layout(pp=4)
CHUNKED = {"chunked": True, "max_prefill_tokens": 2048}


@pytest.fixture(scope="module")
def setup():
    model, mesh = resolve_model("llama2-70b").config, load_mesh("l20x4-pcie")
    return model, mesh, CostModel(model, mesh.hardware, PP4)


def crowded(share: int) -> Workload:
    """16 requests; the four that land on engine 0 (round robin) each grow to a third of its
    share: they fit it as prompts and outgrow it decoding, while a quarter of the four
    engines' pool holds them all."""
    return Workload("crowded", tuple((share // 5, share // 8) if i % 4 == 0 else (64, 32)
                                     for i in range(16)))


class Recording(PipelinedSimExecutor):
    """Records, per engine's state, its micro-batches in flight, its most KV and its
    preemptions."""

    def __init__(self, cost: CostModel):
        super().__init__(cost)
        self.flying, self.most_in_flight = Counter(), Counter()
        self.most_used, self.preempted = Counter(), Counter()

    def launch(self, runs, state):
        self.flying[id(state)] += 1
        self.most_in_flight[id(state)] = max(self.most_in_flight[id(state)],
                                             self.flying[id(state)])
        self.most_used[id(state)] = max(self.most_used[id(state)], state.device_kv.used)
        return super().launch(runs, state)

    def land(self, handle, state):
        self.flying[id(state)] -= 1
        return super().land(handle, state)

    def execute(self, action, state):
        if action.kind is Kind.PREEMPT:
            self.preempted[id(state)] += len(action.seqs)
        super().execute(action, state)


def test_requests_go_to_the_engine_with_the_fewest_unfinished():
    states = [SchedulerState(1000, 8) for _ in range(3)]
    states[0].add(SeqInfo("early", 10, 10))
    assign(states, [SeqInfo(i, 10, 10) for i in range(5)])
    assert [[s.seq_id for s in st.waiting] for st in states] == [
        ["early", 2], [0, 3], [1, 4]]


def test_each_engine_has_a_pp_th_of_the_kv_and_of_the_sequences(setup):
    model, _, cost = setup
    w = crowded(cost.kv_capacity_tokens() // 4)
    (shared,) = make_states(model, w, cost, cost, 8.0)
    engines = make_states(model, w, cost, cost, 8.0, engines=4)
    assert [e.device_kv.capacity for e in engines] == [shared.device_kv.capacity // 4] * 4
    assert shared.device_kv.max_seqs == 4 * MAX_NUM_SEQS
    assert all(e.device_kv.max_seqs == MAX_NUM_SEQS for e in engines)
    assert [len(e.waiting) for e in engines] == [4] * 4


def test_one_engine_preempts_within_its_share_where_a_shared_pool_does_not(setup):
    model, mesh, cost = setup
    share = cost.kv_capacity_tokens() // 4
    w = crowded(share)
    states = make_states(model, w, cost, cost, 8.0, engines=4)
    executor = Recording(cost)
    VirtualEngines([make_policy("prefill_first", **CHUNKED) for _ in states], states,
                   executor).run()
    assert sum(s.num_finished for s in states) == 16
    assert executor.stats.tokens_generated == w.total_output
    assert set(executor.most_in_flight.values()) == {1}  # one micro-batch per engine
    assert all(used <= share for used in executor.most_used.values())
    assert executor.most_used[id(states[0])] > 0.9 * share  # engine 0 filled its share
    assert set(executor.preempted) == {id(states[0])}  # and only it preempted
    shared = simulate(model, mesh, w, "prefill_first", PP4, pipelined=True, **CHUNKED)
    split = simulate(model, mesh, w, "prefill_first", PP4, pipelined=True,
                     virtual_engines=True, **CHUNKED)
    assert shared.stats.preemptions == 0 and shared.finished == 16
    assert split.stats.preemptions == executor.stats.preemptions > 0
    assert split.finished == 16 and split.stats.tokens_generated == w.total_output


def test_virtual_engines_only_for_the_pipelined_baseline(setup):
    model, mesh, _ = setup
    w = Workload("tiny", ((16, 4),) * 4)
    with pytest.raises(ValueError, match="virtual_engines"):
        simulate(model, mesh, w, "prefill_first", PP4, virtual_engines=True)
    with pytest.raises(ValueError, match="virtual_engines"):
        simulate(model, mesh, w, "tdpipe", PP4, virtual_engines=True)
