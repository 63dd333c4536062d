"""The engine's step timeline: when each step was dispatched, when the device finished it, and
what the host did in between. Cheap enough to leave on (a few perf_counter calls a step).

The device is *busy* from a step's dispatch until the host sees it finished; it is *idle* when
nothing dispatched is unfinished. The host learns that a step finished by waiting for it
(exact: the wait returns when it is done) or by polling `ready()` at its part boundaries; a
poll that finds it finished knows only that it finished after the last poll that did not, so
idle time is counted from there: `device_idle_fraction` is an upper bound, never flattering.

    decode wall time  sum over steps with decode rows of (next dispatch - this dispatch)
    decode idle time  the part of it after the device finished and before the next dispatch
    host parts        schedule (the policy), build (step inputs), sample (sampling inputs, or
                      the host sampler), dispatch (JAX's dispatch of the step's programs),
                      postprocess (tokens appended, logprobs, stop checks)

`chrome_trace()` renders the recorded steps and host parts as Chrome / Perfetto trace events.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

PARTS = ("schedule", "build", "sample", "dispatch", "postprocess")
STEP_KINDS = ("prefill", "decode", "mixed")
# step latency histogram bounds, seconds (Prometheus' default buckets, 2.5 ms .. 10 s)
LATENCY_BOUNDS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_KEEP = 100_000  # records kept for the trace (the totals cover everything)


@dataclass
class StepRecord:
    """One step (or other device work: a re-shard, a swap) on the timeline."""

    name: str  # "step" | "switch" | "swap_in" | "preempt"
    decode: int  # decode rows (0 for prompt-only steps and other work)
    prefill: int  # prompt tokens
    dispatch: float  # perf_counter when its dispatch began
    busy_until: float  # the last time the host saw it unfinished (or its dispatch)
    ready: float | None = None  # the first time the host saw it finished
    fetched: float | None = None  # when its results were on the host
    host: dict = field(default_factory=dict)  # part -> seconds spent on this step


class Timeline:
    """Step records, host parts and the running idle totals of one executor."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.records: deque[StepRecord] = deque(maxlen=_KEEP)
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=_KEEP)  # host parts
        self.host = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self.decode_wall = self.decode_idle = 0.0
        # kind -> counts per LATENCY_BOUNDS bucket (the last: above them all), and the sum
        self.latency = {k: [0] * (len(LATENCY_BOUNDS) + 1) for k in STEP_KINDS}
        self.latency_sum = dict.fromkeys(STEP_KINDS, 0.0)
        self._last: StepRecord | None = None  # the newest device work
        self._last_handle = None  # its `ready()`-able handle, while it may be running

    def part(self, name: str, start: float, record: StepRecord | None = None) -> float:
        """Count host time from `start` to now as part `name` (of `record`'s step); now."""
        end = time.perf_counter()
        self.host[name] += end - start
        self.spans.append((name, start, end))
        if record is not None:
            record.host[name] = record.host.get(name, 0.0) + end - start
        return end

    def poll(self) -> None:
        """Look (without waiting) whether the newest device work has finished."""
        last, handle = self._last, self._last_handle
        if last is None or last.ready is not None:
            return
        now = time.perf_counter()
        if handle is not None and not handle.ready():
            last.busy_until = now
        else:
            last.ready = now

    def dispatch(self, name: str, start: float, decode: int = 0, prefill: int = 0,
                 handle=None) -> StepRecord:
        """Device work whose dispatch began at `start`; `handle.ready()` tells when it has
        finished (None: it ran synchronously, finished when `done` is called)."""
        self.poll()
        last = self._last
        if last is not None:
            if last.ready is not None:  # finished before this dispatch: the device idled
                gap = max(0.0, start - last.busy_until)
            else:
                gap = 0.0
            if last.decode:
                self.decode_wall += start - last.dispatch
                self.decode_idle += gap
        record = StepRecord(name, decode, prefill, start, start)
        self.records.append(record)
        self.steps += name == "step"
        self._last, self._last_handle = record, handle
        return record

    def finished(self, record: StepRecord, start: float) -> float:
        """The host waited from `start` until now for `record` to finish; now."""
        end = time.perf_counter()
        if record.ready is None:
            # A wait that returned at once says only that the step finished after the last
            # look that found it running; one that blocked saw it finish.
            record.ready = end if end - start > 50e-6 else max(record.busy_until, start)
            record.busy_until = record.ready
        return end

    def waited(self, record: StepRecord, start: float) -> None:
        """The host waited from `start` until now for `record` (now on the host)."""
        record.fetched = self.finished(record, start)
        if record.name == "step":
            self._count_latency(record)

    def _count_latency(self, record: StepRecord) -> None:
        kind = ("mixed" if record.decode and record.prefill
                else "decode" if record.decode else "prefill")
        seconds = record.fetched - record.dispatch
        self.latency[kind][bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.latency_sum[kind] += seconds

    def done(self, record: StepRecord) -> None:
        """Synchronous device work (a re-shard, a swap dispatch) has finished."""
        record.ready = record.busy_until = record.fetched = time.perf_counter()

    @property
    def device_idle_fraction(self) -> float:
        return self.decode_idle / self.decode_wall if self.decode_wall else 0.0

    def stats(self) -> dict:
        """The totals for `Executor.stats()`."""
        steps = max(self.steps, 1)
        return {"device_idle_fraction": self.device_idle_fraction,
                "decode_wall_seconds": self.decode_wall,
                "decode_idle_seconds": self.decode_idle,
                "host_seconds": dict(self.host),
                "host_ms_per_step": {k: 1e3 * v / steps for k, v in self.host.items()},
                "step_latency": {k: {"counts": list(self.latency[k]),
                                     "sum": self.latency_sum[k]} for k in STEP_KINDS},
                "step_latency_bounds": list(LATENCY_BOUNDS)}

    def chrome_trace(self, ticks: dict | None = None) -> dict:
        """The kept records as Chrome trace events (open in ui.perfetto.dev or
        chrome://tracing): one track for the device's steps, one for the host's parts, and,
        given the runner's pipeline `ticks` (phase -> `flow.TickRecord`s), one track per
        stage of each layout with its micro-batches as slices; switches and swaps are marked
        across every track."""
        def us(t: float) -> float:
            return round((t - self.t0) * 1e6, 1)

        events = self._device_and_host_events(us)
        for pid, (phase, records) in enumerate(sorted((ticks or {}).items()), start=1):
            events += _stage_events(pid, phase, records, us)
        for r in self.records:
            if r.name != "step":
                events.append({"ph": "i", "s": "g", "pid": 0, "tid": 0, "name": r.name,
                               "ts": us(r.dispatch)})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _device_and_host_events(self, us) -> list[dict]:
        events = [{"ph": "M", "pid": 0, "tid": tid, "name": "thread_name",
                   "args": {"name": name}} for tid, name in ((0, "device"), (1, "host"))]
        for r in self.records:
            end = r.ready if r.ready is not None else r.busy_until
            events.append({"ph": "X", "pid": 0, "tid": 0, "name": _label(r), "ts": us(r.dispatch),
                           "dur": max(us(end) - us(r.dispatch), 0.0),
                           "args": {"decode_rows": r.decode, "prefill_tokens": r.prefill}})
        for name, start, end in self.spans:
            events.append({"ph": "X", "pid": 0, "tid": 1, "name": name, "ts": us(start),
                           "dur": max(us(end) - us(start), 0.0)})
        return events


def _stage_events(pid: int, phase: str, records: list, us) -> list[dict]:
    """Trace events of one layout's pipeline: a process per layout, a thread per stage, a
    slice per micro-batch in each tick that ran one (ticks not yet seen finished: none)."""
    stages = len(records[0].slots) if records else 0
    events = [{"ph": "M", "pid": pid, "name": "process_name",
               "args": {"name": f"pipeline ({phase} layout)"}}]
    events += [{"ph": "M", "pid": pid, "tid": s, "name": "thread_name",
                "args": {"name": f"stage {s}"}} for s in range(stages)]
    for r in records:
        if r.ready is None:
            continue
        for stage, mb in enumerate(r.slots):
            if mb is not None:
                events.append({"ph": "X", "pid": pid, "tid": stage, "name": f"mb {mb}",
                               "ts": us(r.start), "dur": max(us(r.ready) - us(r.start), 0.0),
                               "args": {"micro_batch": mb}})
    return events


def _label(record: StepRecord) -> str:
    if record.name != "step":
        return record.name
    kind = "mixed" if record.decode and record.prefill else "decode" if record.decode else \
        "prefill"
    return f"{kind} step"
