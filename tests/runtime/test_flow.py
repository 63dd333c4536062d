"""The host side of the flowing pipeline (`runtime/flow.py`) with a fake tick: a micro-batch
leaves the last stage pp - 1 ticks after it entered, in order, with its own results; a
result asked for early brings it out with idle ticks; the slot counts and the stage clock
count what ran where (a fake clock and fake markers: no device)."""

from __future__ import annotations

import pytest

from jaxpipe.runtime import flow as flow_mod
from jaxpipe.runtime.flow import Flow, MicroBatch, Pending, StageClock, TickRecord


class Marker:
    def __init__(self, ready=True):
        self.ready = ready

    def is_ready(self):
        return self.ready


class FakeTicks:
    """A tick: records each stage's micro-batch id; the leaving one's result is its id."""

    def __init__(self):
        self.seen = []

    def __call__(self, slots):
        self.seen.append([None if mb is None else mb.id for mb in slots])
        leaving = slots[-1]
        return (None if leaving is None else f"out{leaving.id}"), Marker()


def micro(flow: Flow) -> MicroBatch:
    return MicroBatch(inputs=None, slots=None, sampling_inputs=None,
                      pending=Pending(flow.drain))


def test_each_micro_batch_leaves_pp_minus_one_ticks_after_it_entered():
    ticks = FakeTicks()
    flow = Flow(3, ticks)
    mbs = [micro(flow) for _ in range(5)]
    for mb in mbs:
        flow.enter(mb)
    assert ticks.seen == [[0, None, None], [1, 0, None], [2, 1, 0], [3, 2, 1], [4, 3, 2]]
    assert [mb.pending.done for mb in mbs] == ["out0", "out1", "out2", None, None]
    assert flow.in_flight == 2
    assert mbs[4].pending.result() == "out4"  # two idle ticks bring it out
    assert ticks.seen[5:] == [[None, 4, 3], [None, None, 4]]
    assert mbs[3].pending.done == "out3" and flow.in_flight == 0
    assert (flow.ticks, flow.busy_slots, flow.idle_slots) == (7, 15, 6)
    with pytest.raises(RuntimeError, match="no micro-batch"):
        flow.drain()


def test_on_one_stage_a_tick_is_a_step():
    ticks = FakeTicks()
    flow = Flow(1, ticks)
    mb = micro(flow)
    flow.enter(mb)
    assert ticks.seen == [[0]] and mb.pending.done == "out0" and flow.idle_slots == 0


def test_the_stage_clock_counts_busy_stages_and_the_host_gaps(monkeypatch):
    """Two stages. Tick A (stage 0 busy) dispatched at 0, seen ready at 1; tick B (both
    busy) dispatched at 3 after a host gap of 2, ready at 4; tick C (stage 1 only) dispatched
    at 4.5, ready at 6. Busy: stage 0 = 1 + 1, stage 1 = 1 + 1.5; wall: 1 + (2 + 1) + (0.5 +
    1.5): the gaps count, a micro-batch was in flight while the stages waited."""
    now = [0.0]
    monkeypatch.setattr(flow_mod.time, "perf_counter", lambda: now[0])
    clock = StageClock(2)
    a = TickRecord(0.0, Marker(False), (0, None), after_busy=False)
    clock.dispatched(a)
    now[0] = 1.0
    a.marker.ready = True
    clock.poll()
    b = TickRecord(3.0, Marker(True), (1, 0), after_busy=True)
    c = TickRecord(4.5, Marker(False), (None, 1), after_busy=True)
    clock.dispatched(b)
    clock.dispatched(c)
    now[0] = 4.0
    clock.poll()  # b is ready, c not yet
    now[0] = 6.0
    c.marker.ready = True
    clock.poll()
    assert (a.start, a.ready, b.start, b.ready, c.start, c.ready) == (0, 1, 3, 4, 4.5, 6)
    assert clock.busy == [2.0, 2.5] and clock.wall == pytest.approx(6.0)
    assert clock.totals() == {"stages": 2, "busy": [2.0, 2.5], "wall": 6.0}
