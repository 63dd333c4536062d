"""The step timeline's idle accounting on a fake clock: gaps between a step's end and the next
dispatch count as idle only when nothing was in flight, and a step seen finished by a poll
counts as finished from the last poll that saw it running (an upper bound on idle time)."""

from __future__ import annotations

import pytest

from jaxpipe.engine import timeline


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Handle:
    def __init__(self):
        self.done = False

    def ready(self) -> bool:
        return self.done


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(timeline, "time", fake)
    return fake


def test_a_synchronous_loop_idles_between_landing_and_the_next_dispatch(clock):
    tl = timeline.Timeline()
    first = tl.dispatch("step", 0.0, decode=4, handle=Handle())
    clock.now = 0.100
    tl.waited(first, 0.020)  # blocked 80 ms: the step ended at 0.100
    tl.dispatch("step", 0.103, decode=4, handle=Handle())
    assert tl.decode_wall == pytest.approx(0.103)
    assert tl.decode_idle == pytest.approx(0.003)
    assert tl.device_idle_fraction == pytest.approx(0.003 / 0.103)


def test_a_step_dispatched_while_one_runs_adds_no_idle(clock):
    tl = timeline.Timeline()
    tl.dispatch("step", 0.0, decode=4, handle=Handle())
    clock.now = 0.050
    tl.dispatch("step", 0.050, decode=4, handle=Handle())
    assert tl.decode_wall == pytest.approx(0.050) and tl.decode_idle == 0.0


def test_a_poll_bounds_the_end_of_a_step_from_below(clock):
    tl = timeline.Timeline()
    handle = Handle()
    tl.dispatch("step", 0.0, decode=4, handle=handle)
    clock.now = 0.040
    tl.poll()  # still running at 0.040
    handle.done = True
    clock.now = 0.060
    tl.dispatch("step", 0.060, decode=4, handle=Handle())
    assert tl.decode_idle == pytest.approx(0.020)


def test_prompt_only_steps_and_other_work_are_not_decode_time(clock):
    tl = timeline.Timeline()
    first = tl.dispatch("step", 0.0, prefill=64, handle=Handle())
    clock.now = 0.2
    tl.waited(first, 0.0)
    switch = tl.dispatch("switch", 0.3)
    clock.now = 0.5
    tl.done(switch)
    tl.dispatch("step", 0.6, decode=2, handle=Handle())
    assert tl.decode_wall == 0.0 and tl.device_idle_fraction == 0.0
    names = [e["name"] for e in tl.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert names == ["prefill step", "switch", "decode step"]


def test_host_parts_are_summed_per_part_and_per_step(clock):
    tl = timeline.Timeline()
    record = tl.dispatch("step", 0.0, decode=1, handle=Handle())
    clock.now = 0.004
    tl.part("postprocess", 0.001, record)
    tl.part("schedule", 0.003)
    assert tl.host["postprocess"] == pytest.approx(0.003)
    assert tl.host["schedule"] == pytest.approx(0.001)
    assert record.host == {"postprocess": pytest.approx(0.003)}
    assert tl.stats()["host_ms_per_step"]["postprocess"] == pytest.approx(3.0)
