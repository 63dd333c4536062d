"""The engine core: one step is schedule -> launch -> land.

    action = policy.schedule(state)     # Run | Switch | SwapIn | Preempt (jaxpipe.scheduler)
    launch(run)                         # step_builder: pieces, inputs, sampling plan;
                                        # dispatched, then applied to the state at once
    land()                              # output_processor: tokens appended, stops checked,
                                        # sequences finished; the policy told (`landed`)
    execute(action)                     # any other action: a re-shard or a KV move

Overlap (`EngineConfig.overlap`): a Run is applied to the state when its step is dispatched,
and the step before it lands (tokens appended, stop checks) only after that, so the host's
work runs while the device computes; decode tokens not yet on the host are fed from the step
in flight on the device. Any other action waits for the step in flight to land first.

Words kept to one meaning here: a step *lands* when its tokens are on the host (and so do the
runs it carried: `Policy.landed`); a sequence is *freed* when its slot and KV go back to the
pool (at dispatch when its token in flight is certainly its last: `OutputProcessor.free_last`);
a *plan* is a step's `SamplingPlan`; *release* is left to `Engine.release` (a finished request's
output forgotten).

The policy sees only token counts (`SchedulerState`, also the one ledger of device blocks,
slots and host-tier tokens); `KVManager` (jaxpipe/kv/) moves the bytes: the host KV tier and
the prefetcher. The counters and the step
timeline are `EngineStats`' (engine_stats.py). `_scheduling` and `_policy` below build the
state, the policy and the KV manager.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from jaxpipe import sizing, step_timing
from jaxpipe.buckets import Buckets
from jaxpipe.config import EngineConfig
from jaxpipe.distributed import MirroredRunner
from jaxpipe.engine_stats import EngineStats
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.kv.manager import KVManager
from jaxpipe.output_processor import OutputProcessor
from jaxpipe.runner import Dispatched, HostSampled, Runner, StepOutput
from jaxpipe.scheduler import (
    Action,
    Kind,
    Preempt,
    Run,
    SchedulerState,
    Sequence,
    make_policy,
)
from jaxpipe.scheduler.policy import launch_step
from jaxpipe.scheduler.throttle import ThrottleKnobs
from jaxpipe.step_builder import Step, StepBuilder
from jaxpipe.stopping import DetokWorker
from jaxpipe.timeline import StepRecord, Timeline

PIPELINED = ("tdpipe", "throttle")  # policies that form one micro-batch per schedule call


class Executor:
    """The loop over the scheduler state and its policy, a step builder, the runner, an
    output processor and the engine's stats."""

    def __init__(self, config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                 max_model_len: int, host_bytes: float):
        """The policy's actions carry the engine's `Sequence` records themselves.
        host_bytes: the host KV tier's budget (sizing.size; host_kv_tokens wins)."""
        self.config, self.runner, self.buckets = config, runner, buckets
        self.state, self.policy, self.kv = _scheduling(config, runner, buckets, num_slots,
                                                       max_model_len, host_bytes)
        self.builder = StepBuilder(runner, buckets, self.state, self.kv)
        self.kv.on_insert = self.builder.restore_penalties
        self.engine_stats = EngineStats(runner, self.state, self.kv)
        self.detok = DetokWorker()  # used by the requests added while config.detok_worker
        self.output = OutputProcessor(self.state, self.kv, self.detok, self.engine_stats,
                                      max_model_len)
        self._flight: Flight | None = None  # the step dispatched and not yet landed
        self._overlap = config.overlap  # set_overlap flips it on an idle engine

    def step(self) -> list[Sequence]:
        """Run the policy's next action; returns the sequences that got a token (with
        overlap, those of the step before the one this call dispatched)."""
        action, launched = self._schedule()
        if isinstance(action, Run):
            flight = self._launch(action, launched)  # dispatched and applied to the state
            landed = self._land(after=flight)  # the step before it lands (overlap) ...
            self._flight = flight
            if not self.overlap:
                landed += self._land()  # ... or this one, now
        else:
            landed = self._land()  # any other action waits for the step in flight
            self._execute(action)
        self.engine_stats.note_host()
        return landed

    # ---- the engine's controls ----------------------------------------------------------------

    @property
    def overlap(self) -> bool:
        """Whether a step is dispatched before the previous one's tokens are on the host
        (`EngineConfig.overlap`; the pipelined policies already keep pp micro-batches in
        each step and land every step before scheduling the next)."""
        return self._overlap and self.policy.depth == 1

    def set_overlap(self, on: bool) -> None:
        """Overlap steps from now on, or land each before the next (Engine.set_overlap)."""
        self._overlap = bool(on)

    def set_policy(self, config: EngineConfig) -> None:
        """Schedule with `config`'s policy (its scheduler and knobs) from now on."""
        self.policy = _policy(config.scheduler, config, self.runner, self.buckets,
                              self.state.host_kv_tokens)

    def has_work(self) -> bool:
        """Whether a request is unfinished: in the scheduler state, or (already freed: its
        last token) in the step in flight."""
        flight = self._flight
        return self.state.has_work() or (
            flight is not None and any(not s.is_finished for s in flight.freed))

    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence."""
        self.state.add(seq)
        self.engine_stats.added(seq)

    def abort(self, seq: Sequence) -> None:
        self.state.abort(seq.request_id)
        self.output.finish(seq, "abort")
        self.engine_stats.note_host()

    def close(self) -> None:
        """Wait for the step in flight, stop the threads and free the device and host KV."""
        if self._flight is not None:
            self._flight.out.wait()
            self._flight = None
        self.kv.close()
        self.detok.close()
        self.runner.close()

    def stats(self) -> dict:
        """Counters since the engine started or `reset_stats()` (`EngineStats.snapshot`
        says what each one means)."""
        return self.engine_stats.snapshot()

    def reset_stats(self) -> None:
        """Zero every counter of `stats()` (the compile counters are the runner's own)."""
        self.engine_stats.reset()

    @property
    def timeline(self) -> Timeline:
        return self.engine_stats.timeline

    @property
    def generated_tokens(self) -> int:
        return self.engine_stats.counts["generated_tokens"]

    # ---- schedule, launch, land ---------------------------------------------------------------

    def _schedule(self) -> tuple[Action | None, list[Run]]:
        """The policy's next action, and the micro-batches it merges if it is a step of a
        pipelined policy (up to `policy.depth` of them, launched one after another as a
        pipelined executor would, run as one step: see `launch_step`)."""
        if self.policy.depth > 1:
            runs, action = launch_step(self.policy, self.state, self.buckets.max_tokens)
            return (_merge(runs), runs) if runs else (action, [])
        start = time.perf_counter()
        action = self.policy.schedule(self.state)
        self.timeline.part("schedule", start)
        return action, []

    def _launch(self, action: Run, launched: list[Run]) -> Flight | None:
        """Build and dispatch one ragged step: every prompt chunk and decode token of
        `action` in one batch (`step_builder.py`), and apply it to the scheduler state at
        once (a sequence's next token is then in flight; its stop is learnt when it lands).
        With `prefill_to_host` each completed prefill's KV then goes to the host tier
        (asynchronously: later steps overlap the copies). A sequence whose token in this
        step is certainly its last is freed at once. `launched`: the micro-batches `action`
        merges, applied one by one."""
        start = time.perf_counter()
        run = self.builder.ready(action, launched=bool(launched))
        if not launched:
            self.state.launch(run)  # the state gives the blocks the step writes
        step = self.builder.build(run, self._flight)
        if step is None:
            return None
        start = self.timeline.part("build", start)
        plan = self.builder.plan(step)
        start = self._ready_to_dispatch(step, self.timeline.part("sample", start))
        prev = self._flight.out if self._flight is not None else None
        out = self.runner.dispatch(step.inputs, step.slots, plan, prev)
        record = self.timeline.dispatch("step", start, len(step.run.decode),
                                        step.run.prefill_tokens, out)
        self.timeline.part("dispatch", start, record)
        for seq, tokens in step.to_host:
            self.kv.swap_out(seq, tokens)
        for run in launched or [step.run]:
            self.state.apply(run)
        freed = self.output.free_last(step.sampled)  # their token in flight is their last
        self.engine_stats.dispatched(step)
        return Flight(launched or [step.run], step.sampled, out, record, freed)

    def _ready_to_dispatch(self, step: Step, start: float) -> float:
        """What must be done before `step` is dispatched: a host-sampled step in flight whose
        tokens `step` feeds is sampled (the device waits for the host sampler), and queued
        swap-outs are read out of the pool before `step` reuses their blocks, once the step
        in flight (which wrote them) is done: the wait is the device's, timed as the
        timeline's, and swap_seconds only the reads. Returns now."""
        flight = self._flight
        if step.feeds and isinstance(flight.out, HostSampled):
            _, start = self._bring(flight)
        if not self.kv.outgoing:
            return start
        if flight is not None and flight.out is not None:
            flight.out.wait()
            self.timeline.finished(flight.record, start)
        self.kv.flush()
        return time.perf_counter()

    def _land(self, after: Flight | None = None) -> list[Sequence]:
        """Bring the step in flight's tokens to the host and process them (`OutputProcessor`);
        tell the policy which sequences each of its runs ended. `after`: the step just
        dispatched, whose freed sequences the state no longer holds. Returns the sequences
        that got a token."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        out, start = self._bring(flight)
        freed = flight.freed + (after.freed if after is not None else [])
        landed, ended = self.output.process(flight.sampled, out, freed)
        # A run's outcome: its sequences that ended as it landed (by their own token, or a
        # stop string found now); aborts and others' stop strings are no run's.
        for run in flight.runs:
            self.policy.landed(run, [s for s in run.seqs if s.request_id in ended], self.state)
        self.engine_stats.landed(flight.runs, flight.record)
        self.timeline.part("postprocess", start, flight.record)
        return landed

    def _bring(self, flight: Flight) -> tuple[StepOutput, float]:
        """Wait for the step in flight and bring its results to the host (a host-sampled
        step is sampled here, once). Returns (results, now)."""
        start = time.perf_counter()
        flight.out.wait()
        self.timeline.waited(flight.record, start)
        start = time.perf_counter()
        out = flight.out.fetch()
        return out, self.timeline.part("sample", start, flight.record)

    # ---- the other actions: a re-shard or a KV move -------------------------------------------

    def _execute(self, action: Action | None) -> None:
        """Do a Switch / SwapIn / Preempt (less the sequences that ended in the step that
        just landed) and tell the scheduler state it was done."""
        if action is None:
            return
        action = _without_finished(action)
        record = self.timeline.dispatch(action.kind.value, time.perf_counter())
        self.kv.flush()  # a switch moves only held blocks; swaps and preemptions reuse them
        if action.kind is Kind.SWAP_IN:
            self.state.apply(action)  # first: the state gives the blocks the KV goes into
            for seq in action.seqs:
                self.kv.swap_in(seq)
        else:
            if action.kind is Kind.SWITCH:
                moved = self.runner.set_phase(action.phase, self.state.held_blocks())
                self.engine_stats.switched(action.phase, moved)
            else:
                self._preempt(action)
            self.state.apply(action)  # after: a preemption's KV is queued from its blocks
        self.timeline.done(record)

    def _preempt(self, action: Preempt) -> None:
        """Evict device sequences: KV to the host tier ("swap") or dropped ("recompute": the
        prompt and outputs so far are prefilled again later)."""
        for seq in action.seqs:
            if action.mode == "swap":
                self.kv.swap_out(seq, seq.computed)
            else:
                self.kv.drop(seq)
        self.engine_stats.preempted(len(action.seqs))


# ---- how the engine's scheduling is built -----------------------------------------------------


def _scheduling(config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                max_len: int, host_bytes: float) -> tuple[SchedulerState, object, KVManager]:
    """The scheduler state and policy, and the KV manager with its host tier."""
    pool_tokens = runner.num_blocks * BLOCK
    host_tokens = sizing.host_tokens(config, host_bytes, runner.cache, pool_tokens)
    # The host tier keeps each sequence in whole swap chunks (`Runner.kv_chunk`).
    state = SchedulerState(pool_tokens, num_slots, host_tokens, host_unit=runner.kv_chunk,
                           device_unit=BLOCK, prefix_caching=config.prefix_caching,
                           cache_key=cache_key(config))
    policy = _policy(config.scheduler, config, runner, buckets, host_tokens)
    mirror = runner.leader.send if isinstance(runner, MirroredRunner) else None
    return state, policy, KVManager(runner, host_tokens > 0, mirror=mirror)


def cache_key(config: EngineConfig) -> tuple:
    """What besides the tokens makes a prefix cache's KV what it is: the model (its weights:
    random ones by their seed) and the dtype."""
    seed = config.seed if config.random_weights else None
    return (config.model, config.dtype, seed)


def _policy(name: str, config: EngineConfig, runner: Runner, buckets: Buckets,
            host_tokens: int):
    """A policy that switches layouts if the runner's two differ, with the step's token
    budget for prompt chunks. "auto": seesaw over two layouts and a host tier, else
    prefill_first (continuous batching: nothing to gain from phases on one layout).
    tdpipe and throttle form pp micro-batches per step on the prefill layout."""
    layouts = runner.layouts
    two = layouts["prefill"] != layouts["decode"]
    if name == "auto":
        name = "seesaw" if two and host_tokens > 0 else "prefill_first"
    budget = min(config.max_num_batched_tokens, buckets.max_tokens)
    if name not in PIPELINED:
        return make_policy(name, two_layouts=two, max_prefill_tokens=budget)
    depth = layouts["prefill"].pp
    opts = {"pipeline_depth": depth, "max_prefill_tokens": max(1, budget // depth)}
    if name == "throttle":
        opts["knobs"] = ThrottleKnobs(config.throttle_iterations, config.throttle_max_prefill,
                                      config.throttle_min_prefill, config.throttle_kv_thresh)
    else:
        opts["predictor"] = config.tdpipe_predictor
        opts["finish_ratio"] = config.tdpipe_finish_ratio
        if config.tdpipe_finish_ratio is None:
            opts["timing"] = step_timing.load_or_measure(runner, buckets, depth,
                                                         config.model, config.dtype)
    return make_policy(name, **opts)


@dataclass
class Flight:
    """A dispatched step on its way: the runs it applied, its sampled sequences (row order),
    the runner's handle and its timeline record."""

    runs: list[Run]
    sampled: list[Sequence]
    out: Dispatched | HostSampled
    record: StepRecord
    freed: list[Sequence]  # sampled sequences freed at dispatch: this token is their last

    def __post_init__(self):
        self.rows = {seq: i for i, seq in enumerate(self.sampled)}  # seq -> its sampled row


def _without_finished(action: Action) -> Action:
    """`action` decided before the step in flight landed, less the sequences that ended in
    it (a swap-in or preemption of a finished sequence is void)."""
    if action.kind in (Kind.SWAP_IN, Kind.PREEMPT):
        return dataclasses.replace(action, seqs=[s for s in action.seqs if not s.is_finished])
    return action


def _merge(runs: list[Run]) -> Run:
    """One step's worth of micro-batches as one Run."""
    return Run(prefill=[p for r in runs for p in r.prefill],
               decode=[s for r in runs for s in r.decode])
