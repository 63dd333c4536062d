"""The engine core: one step is schedule -> launch -> land, through the scheduler's one loop.

    driver.step()          # jaxpipe.scheduler.loop.Driver, the simulator's loop too:
      policy.schedule      #   Run | Switch | SwapIn | Preempt (a pipelined policy: pp runs,
                           #   merged into one step)
      launch(runs)         #   step_builder: pieces, step and sampling inputs; dispatched, then
                           #   applied to the state at once by the driver
      land(flight)         #   output_processor: tokens appended, stops checked; the driver
                           #   finishes the sequences that ended and tells the policy (`landed`)
      execute(action)      #   any other action: a re-shard or a KV move

This class is the loop's executor (`StepExecutor`) for the engine. Overlap
(`EngineConfig.overlap`): a Run is applied to the state when its step is dispatched, and the
step before it lands (tokens appended, stop checks) only after that, so the host's work runs
while the device computes; decode tokens not yet on the host are fed from the step in flight
on the device. Any other action waits for the step in flight to land first. Over pp stages
(`flowing`) the same holds for the micro-batch that left the last stage in the tick just
dispatched (SiPipe's token-safe execution): the driver releases it (`left`), its sequences join
the micro-batch entering next with their tokens fed from its sampled rows on the device (with
the host sampler, sampled on the host first: stage 0 needs them), and it lands while that one
runs.

Words kept to one meaning across the package: a step *lands* when its tokens are on the host
(and so do the runs it carried: `Policy.landed`); a sequence is *freed* when its slot and KV
go back to the pool (at dispatch when its token in flight is certainly its last: the driver's
rule, `free` here drops its KV); *dispatch* is a device program started asynchronously (JAX's
word: a step, a copy); *release* gives something back where it came from (a block to the
pool, a host tier's tokens, freed pages to the OS); a finished request's output is
*forgotten* (`Engine.forget`); a *plan* is the planner's (a layout choice), never a step's
(a step has *sampling inputs*) nor a memory budget's.

The policy sees only token counts (`SchedulerState`: its queues and the ledgers of device
blocks and slots, `device_kv`, and host-tier tokens, `host_kv`); `KVManager` (jaxpipe/kv/)
moves the bytes: the host KV tier and the prefetcher. The counters and the step timeline
are `EngineStats`' (stats.py). The engine's builder (builder.py) makes the state, the policy
and the KV manager with `scheduler_state` and `policy_for` below.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import ModelConfig
from jaxpipe.engine.output_processor import OutputProcessor
from jaxpipe.engine.stats import EngineStats
from jaxpipe.engine.step_builder import Step, StepBuilder
from jaxpipe.engine.structured import Constraints
from jaxpipe.engine.timeline import StepRecord, Timeline
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.kv.manager import KVManager
from jaxpipe.request.stopping import DetokWorker
from jaxpipe.runtime import step_timing
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.flow import Pending
from jaxpipe.runtime.runner import Dispatched, HostSampled, Runner, StepOutput
from jaxpipe.scheduler import (
    Action,
    Driver,
    Kind,
    Preempt,
    Run,
    SchedulerState,
    Sequence,
    StepExecutor,
    make_policy,
)
from jaxpipe.scheduler.throttle import ThrottleKnobs

PIPELINED = ("tdpipe", "throttle")  # policies that form one micro-batch per schedule call
MIN_HALF = 8  # constrained decodes that a half must have (below, a run is not halved)


class Executor(StepExecutor):
    """The engine's executor of the scheduler's loop: the scheduler state and its policy, a
    step builder, the runner, an output processor and the engine's stats."""


    def __init__(self, config: EngineConfig, runner: Runner, buckets: Buckets,
                 state: SchedulerState, policy, kv: KVManager, max_model_len: int,
                 constraints: Constraints):
        """Run `policy` over `state` on `runner`, the KV bytes moved by `kv`, the grammars of
        structured outputs by `constraints` (all made by `builder.make_executor`). The
        policy's actions carry the engine's `Sequence` records themselves."""
        self.config, self.runner, self.buckets = config, runner, buckets
        self.state, self.kv = state, kv
        self.driver = Driver(policy, self.state, self)
        self.max_step_tokens = buckets.max_tokens
        self.constraints = constraints
        self.builder = StepBuilder(runner, buckets, self.state, self.kv, constraints)
        self.engine_stats = EngineStats(runner, self.state, self.kv)
        self.detok = DetokWorker()  # used by the requests added while config.detok_worker
        self.output = OutputProcessor(self.state, self.kv, self.detok, self.engine_stats,
                                      max_model_len, end=self.driver.end)
        self._flight: Flight | None = None  # the newest step dispatched and not yet landed
        self._feeder: Flight | None = None  # flowing: the one released, not landed (`release`)
        self._landed: list[Sequence] = []  # sequences that got a token in this step() call
        self._overlap = config.overlap  # set_overlap flips it on an idle engine
        self._history: set[Sequence] = set()  # unfinished requests with multi-token bad words
        self._constrained: set[Sequence] = set()  # unfinished constrained requests

    def step(self) -> list[Sequence]:
        """Run the policy's next action (`Driver.step`: schedule, then `launch` and `land`,
        or `execute`, below); returns the sequences that got a token (with overlap, those of
        the step before the one this call dispatched)."""
        self._landed = []
        self.driver.step()
        self.engine_stats.note_host()
        return self._landed

    # ---- the engine's controls ----------------------------------------------------------------

    @property
    def flowing(self) -> bool:
        """Whether the current layout pipelines: each step is a micro-batch flowing through
        its pp stages (`runtime/flow.py`), up to pp in flight, and a sequence waits for its
        micro-batch to leave the last stage before it joins another."""
        return self.runner.layout.pp > 1

    @property
    def chained(self) -> bool:
        """Whether a sequence in the step in flight may join the next (its token fed on the
        device): on one stage (over pp stages only once its micro-batch left, `left`)."""
        return not self.flowing

    @property
    def merge(self) -> bool:
        """Whether one step carries a pipelined policy's micro-batches: on one stage (over
        pp stages they flow one by one)."""
        return not self.flowing

    @property
    def flow_depth(self) -> int:
        """Stages a step flows through (the driver splits a one-micro-batch policy's run
        over them)."""
        return self.runner.layout.pp

    @property
    def overlap(self) -> bool:
        """Whether a step is dispatched before the previous one's tokens are on the host
        (`EngineConfig.overlap`): on one stage the next step feeds from the one in flight;
        over pp stages the micro-batch entering next feeds from the one that just left the
        last stage (`left`; without overlap its sequences wait for it to land, the host's
        work between the ticks)."""
        return self._overlap

    @property
    def in_flight(self) -> int:
        """Steps left in flight while the next is scheduled (the driver's): over pp stages the
        pp - 1 micro-batches in the pipeline and, with overlap, the one that left in the last
        tick (released, `left`: it lands while the next runs); on one stage one with overlap,
        unless a request's bad word of several tokens needs its newest tokens on the host to
        know its next ban (`needs_history`), or a constrained request runs with
        constrained_steps "land": each step then lands before the next is built."""
        if self.flowing:
            return self.runner.layout.pp - 1 + int(self.overlap)
        return int(self.overlap and not self._needs_history() and not self._lands_first())

    def waits(self, seq: Sequence) -> bool:
        """Whether `seq` sits out the step after its own even where sequences chain: a
        constrained sequence's next mask needs its token in flight on the host (its matcher
        advanced), so it joins the step after that (constrained_steps "skip",
        `engine/structured.py`). Over pp stages a constrained sequence, and one whose bad
        words of several tokens need its newest token on the host, waits for its
        micro-batch to land (no stage waits: others fill the micro-batches meanwhile)."""
        if self.flowing:
            return seq.grammar is not None or seq.stop.needs_history
        return seq.grammar is not None and self.config.constrained_steps == "skip"

    def left(self, flight: Flight) -> bool:
        """Whether `flight`'s micro-batch has left the last stage (over pp stages; on one
        stage a step's sequences chain instead)."""
        return (self.flowing and self.overlap and isinstance(flight.out, Pending)
                and flight.out.done is not None)

    def _lands_first(self) -> bool:
        """constrained_steps "land": while a constrained request runs, no step overlaps."""
        self._constrained = {s for s in self._constrained if not s.is_finished}
        return bool(self._constrained) and self.config.constrained_steps == "land"

    def _needs_history(self) -> bool:
        self._history = {s for s in self._history if not s.is_finished}
        return bool(self._history)

    def set_overlap(self, on: bool) -> None:
        """Overlap steps from now on, or land each before the next (Engine.set_overlap)."""
        self._overlap = bool(on)

    @property
    def policy(self):
        return self.driver.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.driver.policy = policy

    def set_policy(self, config: EngineConfig) -> None:
        """Schedule with `config`'s policy (its scheduler and knobs) from now on."""
        self.policy = policy_for(config.scheduler, config, self.runner, self.buckets,
                                 self.state.host_kv.capacity)

    def has_work(self) -> bool:
        """Whether a request is unfinished: in the scheduler state, or (already freed: its
        last token) in a step in flight."""
        return self.state.has_work() or any(
            not s.is_finished for step in self.driver.in_flight for s in step.handle.freed)

    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence."""
        self.state.add(seq)
        self.engine_stats.added(seq)
        if seq.stop.needs_history:
            self._history.add(seq)
        if seq.grammar is not None:
            self._constrained.update(seq.group)

    def abort(self, seq: Sequence) -> None:
        self.driver.end(seq.request_id)  # (in a micro-batch in flight: when it leaves)
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
        """Counters since the engine started or `reset_stats()` (`jaxpipe.engine.stats`
        says what each one means)."""
        return self.engine_stats.snapshot()

    def reset_stats(self) -> None:
        """Zero every counter of `stats()` (the compile counters are the runner's own)."""
        self.engine_stats.reset()

    @property
    def timeline(self) -> Timeline:
        return self.engine_stats.timeline

    def chrome_trace(self) -> dict:
        """The step timeline and each layout's pipeline stages as one Perfetto trace."""
        self.runner.ticks.stage_times()  # (polls the ticks still running)
        return self.timeline.chrome_trace(self.runner.ticks.records())

    @property
    def generated_tokens(self) -> int:
        return self.engine_stats.counts["generated_tokens"]

    # ---- the loop's callbacks: schedule, launch, land -----------------------------------------

    def scheduled(self, start: float, state: SchedulerState) -> None:
        self.timeline.part("schedule", start)

    def ready(self, run: Run) -> Run:
        """`run` less the decodes whose KV is still being swapped in (none may wait in a
        pipelined policy's micro-batch)."""
        start = time.perf_counter()
        run = self._halved(self.builder.ready(run, launched=self.policy.depth > 1))
        self.timeline.part("build", start)
        return run

    def _halved(self, run: Run) -> Run:
        """`run` with only half of its constrained decodes when nothing is in flight (where
        constrained sequences sit out a step, `waits`): the other half forms the next step
        at once, while this one runs, and the halves alternate from then on, each one's
        tokens landing and its masks filled while the other's step runs. Left whole, a run of
        constrained decodes alone would land every step before the next is built."""
        if self._flight is not None or not self.in_flight:
            return run
        held = [s for s in run.decode if self.waits(s)]
        if len(held) < 2 * MIN_HALF:
            return run
        later = set(held[len(held) // 2:])
        return Run(prefill=run.prefill, decode=[s for s in run.decode if s not in later],
                   prefill_to_host=run.prefill_to_host)

    def launch(self, runs: list[Run], state: SchedulerState) -> Flight | None:
        """Build and dispatch one ragged step: every prompt chunk and decode token of `runs`
        in one batch (`step_builder.py`); the driver then applies it to the state at once
        (a sequence's next token is in flight; its stop is learnt when it lands). With
        `prefill_to_host` each completed prefill's KV then goes to the host tier
        (asynchronously: later steps overlap the copies)."""
        start = time.perf_counter()
        feeder = self._feeder if self.flowing else self._flight
        step = self.builder.build(runs[0] if len(runs) == 1 else _merge(runs), feeder)
        if step is None:
            return None
        start = self.timeline.part("build", start)
        sampling_inputs = self.builder.sampling_inputs(step)
        start = self._ready_to_dispatch(step, feeder, self.timeline.part("sample", start))
        prev = feeder.out if feeder is not None else None
        out = self.runner.dispatch(step.inputs, step.slots, sampling_inputs, prev, step.score)
        record = self.timeline.dispatch("step", start, len(step.run.decode),
                                        step.run.prefill_tokens, out)
        self.timeline.part("dispatch", start, record)
        self._flight = Flight(runs, step.sampled, out, record, scored=step.scored)
        if self.flowing:  # its KV is whole when it leaves the last stage: out then
            self._flight.to_host = step.to_host
        else:
            for seq, tokens in step.to_host:
                self.kv.swap_out(seq, tokens)  # its blocks, before the state records it
        self.engine_stats.dispatched(step)
        return self._flight

    def _ready_to_dispatch(self, step: Step, feeder: Flight | None, start: float) -> float:
        """What must be done before `step` is dispatched: a host-sampled step whose tokens
        `step` feeds (`feeder`) is sampled (the device waits for the host sampler), and queued
        swap-outs are read out of the pool before `step` reuses their blocks, once the step
        in flight (which wrote them) is done: the wait is the device's, timed as the
        timeline's, and swap_seconds only the reads; then the prefix cache's host-tier moves
        (blocks `step` overwrites read out, blocks it reads copied back). Returns now."""
        flight = self._flight
        if step.feeds and feeder.out.tokens is None:  # host-sampled, not sampled yet
            _, start = self._bring(feeder)
        if not self.kv.outgoing:
            self._move_blocks()
            return start
        if flight is not None and flight.out is not None and not self.flowing:
            flight.out.wait()  # (flowing: only micro-batches that left queue swap-outs)
            self.timeline.finished(flight.record, start)
        self.kv.flush()
        self._move_blocks()
        return time.perf_counter()

    def _move_blocks(self) -> None:
        """The prefix cache's host-tier moves, then the copies on write of samples forked
        since the last step (their blocks may have been evicted: read out first)."""
        self.kv.move_blocks(self.state.host_kv.take_moves())
        self.kv.copy_blocks(self.state.device_kv.take_copies())

    def release(self, flight: Flight, seqs: list[Sequence]) -> None:
        """`flight` left the last stage and the driver releases it (before the state records
        it): `seqs` (their token in it is certainly their last) are freed, its completed
        prefills for the host tier are queued for it now (its KV is whole; their blocks are
        still theirs), and the next micro-batch may feed from it."""
        freed = set(seqs)
        for seq, tokens in flight.to_host:
            if seq not in freed:
                self.kv.swap_out(seq, tokens)
        flight.to_host = []
        self.free(flight, seqs)
        self._feeder = flight

    def free(self, flight: Flight, seqs: list[Sequence]) -> None:
        """The driver freed `seqs` at dispatch (their token in `flight` is certainly their
        last): their KV goes now, so the next step may admit others in their place (device
        work runs in dispatch order: the step in flight still reads it). They finish, with
        that token, when it lands."""
        flight.freed = seqs
        for seq in seqs:
            self.kv.drop(seq)

    def land(self, flight: Flight, state: SchedulerState) -> set[str]:
        """Bring `flight`'s tokens to the host and process them (`OutputProcessor`); returns
        the ids of its sequences that ended (by their own token, or a stop string found
        now): the driver finishes them and tells the policy each run's own."""
        if self._flight is flight:
            self._flight = None
        if self._feeder is flight:
            self._feeder = None
        out, start = self._bring(flight)
        self.output.record_prompt(flight.scored, out)
        landed, ended = self.output.process(flight.sampled, out)
        for seq, tokens in flight.to_host:  # (not released: the state moves them now)
            if seq.request_id not in ended:
                self.kv.swap_out(seq, tokens)
        self._landed += landed
        self.engine_stats.landed(flight.runs, flight.record)
        self.timeline.part("postprocess", start, flight.record)
        return ended

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

    def execute(self, action: Action, state: SchedulerState) -> None:
        """Do a Switch / SwapIn / Preempt (the driver records it in the state: a swap-in
        first, so the KV goes into the blocks it gave; the others after)."""
        record = self.timeline.dispatch(action.kind.value, time.perf_counter())
        self.kv.flush()  # a switch moves only held blocks; swaps and preemptions reuse them
        self.kv.move_blocks(self.state.host_kv.take_moves())  # a swap-in's new blocks evicted some
        if action.kind is Kind.SWAP_IN:  # first: samples that forked as it came back copy it
            for seq in action.seqs:
                self.kv.swap_in(seq)
        self.kv.copy_blocks(self.state.device_kv.take_copies())  # before a sample moves
        if action.kind is Kind.SWITCH:
            moved = self.runner.set_phase(action.phase, self.state.device_kv.pool.data_blocks())
            self.engine_stats.switched(action.phase, moved)
        elif action.kind is Kind.PREEMPT:
            self._preempt(action)
        self.timeline.done(record)

    def _preempt(self, action: Preempt) -> None:
        """Evict device sequences: KV to the host tier ("swap", queued from the blocks the
        state still gives them) or dropped ("recompute": the prompt and outputs so far are
        prefilled again later)."""
        for seq in action.seqs:
            if action.mode == "swap":
                self.kv.swap_out(seq, seq.computed)
            else:
                self.kv.drop(seq)
        self.engine_stats.preempted(len(action.seqs))


# ---- how the engine's scheduling is built -----------------------------------------------------


def scheduler_state(config: EngineConfig, runner: Runner, num_slots: int,
                    host_tokens: int) -> SchedulerState:
    """The scheduler's ledgers: the runner's device pool, `num_slots` slots and a host tier
    of `host_tokens` tokens (kept in whole swap chunks, `Runner.kv_chunk`)."""
    return SchedulerState(runner.num_blocks * BLOCK, num_slots, host_tokens,
                          host_unit=runner.kv_chunk, device_unit=BLOCK,
                          prefix_caching=config.prefix_caching, cache_key=cache_key(config),
                          window=every_layer_window(runner.config))


def every_layer_window(cfg: ModelConfig) -> int:
    """The sliding window every layer attends through, so that blocks behind it can be given
    back (Mistral's); 0 when any layer reads the whole context (Gemma's global layers: the
    one block table serves every layer, and they keep every block)."""
    every = set(cfg.sliding_layers) >= set(range(cfg.num_layers))
    return cfg.sliding_window if cfg.sliding_window and every else 0


def cache_key(config: EngineConfig) -> tuple:
    """What besides the tokens makes a prefix cache's KV what it is: the model (its weights:
    random ones by their seed) and the dtype."""
    seed = config.seed if config.random_weights else None
    return (config.model, config.dtype, seed)


def policy_for(name: str, config: EngineConfig, runner: Runner, buckets: Buckets,
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
    """A dispatched step on its way: the runs it carries, its sampled sequences (row order),
    the runner's handle and its timeline record."""

    runs: list[Run]
    sampled: list[Sequence]
    out: Dispatched | HostSampled | Pending  # Pending: a micro-batch over pp stages
    record: StepRecord
    freed: list[Sequence] = field(default_factory=list)  # freed at dispatch: their last token
    to_host: list = field(default_factory=list)  # (seq, tokens): prefills to swap out at land
    scored: list = field(default_factory=list)  # (seq, prompt token index) of its prompt scores

    def __post_init__(self):
        self.rows = {seq: i for i, seq in enumerate(self.sampled)}  # seq -> its sampled row


def _merge(runs: list[Run]) -> Run:
    """One step's worth of micro-batches as one Run."""
    return Run(prefill=[p for r in runs for p in r.prefill],
               decode=[s for r in runs for s in r.decode])
