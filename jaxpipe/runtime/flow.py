"""The micro-batches flowing through a layout's pipeline stages, on the host side.

A micro-batch enters stage 0 when it is dispatched; each pipeline tick (`pipeline.tick_program`)
runs every stage on the micro-batch in front of it and moves every output one stage on, so the
micro-batch dispatched pp - 1 ticks earlier leaves the last stage and its tokens are sampled.
Up to pp micro-batches are in flight and nothing drains between steps: a tick is dispatched
only with a micro-batch entering (`enter`), or, to bring the last ones out when no new one
comes (the work ran out, a layout switch, a swap), with an idle one (`drain`), whose stages
compute on nothing and write nothing. On one stage (pp = 1) a micro-batch leaves in its own
tick: a tick is a step.

`Flow` keeps the micro-batches that ran stages 0 .. pp - 2 in the last tick (`moving`), each
with what its exit needs (its sampled rows' slots and sampling inputs) and the handle the
executor holds (`Pending`), filled when it leaves; it counts ticks and stage slots with and
without a micro-batch, and times the stages (`StageClock`).

How the stages' time is counted: a tick runs on the device from its dispatch or the end of the
tick before, whichever is later, until the host sees it finished (`poll`: its output is
ready; a poll that finds it finished knows only that it finished since the last one that did
not, so busy time is an upper bound). Each stage is busy for the ticks its slot held a
micro-batch; the pipeline's wall time is the ticks' time plus the gaps between them while a
micro-batch was in flight (the host forming the next one: the stages wait). The bubble fraction
is the stages' time without a micro-batch over pp x that wall time: filling, draining and the
host's gaps, not the time the pipeline was empty (nothing to run, or a layout switch).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jaxpipe.runtime.step_inputs import StepInputs


class Pending:
    """A dispatched micro-batch's results, filled when it leaves the last stage (`done`);
    `wait`, `fetch` and `result` first run the idle ticks that bring it out (`drain`: the
    runner's, which a leader's runner sends to its followers too)."""

    def __init__(self, drain):
        self.drain = drain
        self.done = None  # the runner's Dispatched / HostSampled once it left
        self.step_id = None  # the leader's step number (distributed.MirroredRunner)

    @property
    def tokens(self):
        """Its sampled tokens on the device, for the `prev` of a micro-batch that takes its
        sequences' next inputs from them (None while it is in the pipeline, or host-sampled
        and not sampled yet)."""
        return None if self.done is None else self.done.tokens

    def result(self):
        """Its results (a `Dispatched` or `HostSampled`), once it has left."""
        while self.done is None:
            self.drain()
        return self.done

    def ready(self) -> bool:
        return self.done is not None and self.done.ready()

    def wait(self) -> None:
        self.result().wait()

    def fetch(self):
        return self.result().fetch()

    @property
    def sampled(self) -> bool:  # a host-sampled step (`HostSampled`) that was sampled
        return self.done is not None and getattr(self.done, "sampled", True)

    def sample(self):
        return self.result().sample()


@dataclass
class MicroBatch:
    """One micro-batch in flight: its inputs, the slots and sampling inputs of its sampled
    rows, and the executor's handle."""

    inputs: StepInputs
    slots: np.ndarray
    sampling_inputs: object
    pending: Pending
    id: int = -1  # its number in the flow, from 0 (`Flow.enter`)
    score: object = None  # its prompt positions to score (`prompt_scores.PromptScore`)


@dataclass
class TickRecord:
    """One tick: when it was dispatched, an output of it to poll (`is_ready`), the id of each
    stage's micro-batch (None: idle), whether a micro-batch was in flight before it (the gap
    before it is the stages' wait), and when it ran on the device (`start`, `ready`)."""

    dispatch: float
    marker: object
    slots: tuple
    after_busy: bool
    start: float | None = None
    ready: float | None = None


class StageClock:
    """The stages' busy seconds and the pipeline's wall time (module docstring)."""

    def __init__(self, stages: int, keep: int = 100_000):
        self.stages = stages
        self.busy = [0.0] * stages  # per stage: seconds running a micro-batch
        self.wall = 0.0
        self.records: deque[TickRecord] = deque(maxlen=keep)  # for the trace
        self._unfinished: deque[TickRecord] = deque()
        self._last_ready: float | None = None

    def dispatched(self, record: TickRecord) -> None:
        self.records.append(record)
        self._unfinished.append(record)

    def poll(self) -> None:
        """Count every tick, oldest first, whose output the host now sees ready."""
        now = time.perf_counter()
        while self._unfinished and self._unfinished[0].marker.is_ready():
            record = self._unfinished.popleft()
            last = self._last_ready
            record.start = record.dispatch if last is None else max(record.dispatch, last)
            record.ready = now
            gap = record.start - last if record.after_busy and last is not None else 0.0
            self.wall += gap + (now - record.start)
            for s, mb in enumerate(record.slots):
                if mb is not None:
                    self.busy[s] += now - record.start
            self._last_ready = now
            record.marker = None  # no longer needed: let the buffer go

    def totals(self) -> dict:
        return {"stages": self.stages, "busy": list(self.busy), "wall": self.wall}


@dataclass
class Flow:
    """One layout's micro-batches in flight. `tick(slots)` is `ticks.Ticks`'s: it runs one
    pipeline tick with slots[0] (or an idle micro-batch) entering stage 0 and returns the
    results of the micro-batch that left the last stage (None: none did)."""

    stages: int
    tick: object  # (slots) -> (results of slots[-1] or None, an output of the tick to poll)
    moving: list[MicroBatch | None] = field(default_factory=list)
    ticks: int = 0
    busy_slots: int = 0  # stage-ticks that ran a micro-batch
    idle_slots: int = 0  # stage-ticks that ran none (filling and draining)
    entered: int = 0  # micro-batches that entered (their ids)

    def __post_init__(self):
        self.moving = [None] * (self.stages - 1)
        self.clock = StageClock(self.stages)

    @property
    def in_flight(self) -> int:
        return sum(mb is not None for mb in self.moving)

    def enter(self, mb: MicroBatch) -> None:
        """Dispatch the tick that `mb` enters."""
        mb.id = self.entered
        self.entered += 1
        self._run([mb, *self.moving])

    def drain(self) -> None:
        """Dispatch a tick with nothing entering (bringing the front micro-batch one stage
        nearer the exit)."""
        if not self.in_flight:
            raise RuntimeError("no micro-batch is in the pipeline")
        self._run([None, *self.moving])

    def _run(self, slots: list[MicroBatch | None]) -> None:
        self.clock.poll()
        start, after_busy = time.perf_counter(), self.in_flight > 0
        done, marker = self.tick(slots)
        self.clock.dispatched(TickRecord(start, marker, tuple(
            None if mb is None else mb.id for mb in slots), after_busy))
        self.ticks += 1
        busy = sum(mb is not None for mb in slots)
        self.busy_slots += busy
        self.idle_slots += self.stages - busy
        leaving = slots[-1]
        if leaving is not None:
            leaving.pending.done = done
        self.moving = slots[:-1]
