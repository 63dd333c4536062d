"""The one loop over a policy, the scheduler state and an executor: the engine's
(jaxpipe/engine/executor.py), the simulator's (jaxpipe/planner/simulate.py) and the tests' drivers.

```python
state = SchedulerState(device_kv_tokens, max_device_seqs, host_kv_tokens)
state.add(SeqInfo(seq_id, prompt_len, max_output_len))   # for every request
driver = Driver(make_policy("seesaw"), state, executor)  # executor: a StepExecutor
driver.run()                                             # or driver.step(), one at a time
```

One `Driver.step`:

    runs = form()        # the policy's next micro-batch (or up to policy.depth of them, one
                         # step, when the executor merges them), each launched on the state:
                         # it takes the blocks the run writes; its sequences are busy
    launch(runs)         # the executor starts the step; the state records it at once (a
                         # sequence's next token is in flight) and, on one stage, frees each
                         # sequence whose token in flight is certainly its last (its
                         # max_output_len)
    land()               # the steps in flight beyond `executor.in_flight`, oldest first: the
                         # executor says which of their sequences ended; the state finishes
                         # them; the policy hears each run's own (`Policy.landed`)
    execute(action)      # any other action (Switch | SwapIn | Preempt), once every step in
                         # flight landed, less the sequences that ended meanwhile; a swap-in
                         # is recorded before the executor moves the KV, the others after

The rule is one for every executor: a run is applied at launch, its sequences finish at land.
The policy only reads the state and returns actions; `SchedulerState` does the bookkeeping,
so the engine and the simulator cannot disagree about where a sequence is.

How many steps stay in flight is the executor's: on one stage the engine keeps one while it
schedules the next (overlap: the device feeds the tokens in flight to the next step, so their
sequences may join it: `chained`), or none; over pp stages a sequence waits for its micro-batch
to leave the last stage (`chained` False: the pipeline never drains, pp - 1 micro-batches stay
in flight while the next one is formed). Where the executor says when a micro-batch *left*
(`left`: the engine's flowing pipeline), the driver releases it then, before it lands
(SiPipe's token-safe execution): its sequences may join the next micro-batch at once, their
tokens fed on the device from its sampled rows, and the host lands it (waits, samples,
appends, checks stops) while that next one runs. Released too then: the sequences whose token
in it is certainly their last (freed), its completed prefills for the host tier and its
samples' forks (`SchedulerState.returned`); the policy hears `left`. Where steps do not
release early (the simulator's pipeline), a micro-batch's sequences return when it lands.

A sequence that ends while it is already in a later micro-batch in flight (its stop found when
the earlier one landed, a stop string, an abort) keeps its slot and blocks until that one
leaves too (`end`): that micro-batch's later stages still write its KV and its sampler still
updates its slot's penalty state, which a new owner of the slot must not see. Where sequences
chain, one the executor says `waits` (a constrained sequence: its next token's mask needs this
one on the host) stays busy until its step lands and sits the next one out.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Hashable, Iterable

from jaxpipe.scheduler.actions import Action, Kind, Run
from jaxpipe.scheduler.policy import Policy
from jaxpipe.scheduler.state import Location, SchedulerState, SeqInfo


class StepExecutor:
    """What the driver needs of an executor: `launch` / `land` a step, `execute` any other
    action, and a few hooks (no-ops here). The class attributes describe its steps."""

    in_flight = 0  # steps still in flight while the next is scheduled (0: each lands at once)
    chained = True  # a sequence in a step in flight may join the next one (fed on the device)
    merge = False  # one step carries up to policy.depth micro-batches (the engine)
    max_step_tokens: int | None = None  # the token budget of a merged step
    flow_depth = 1  # stages a step flows through: a one-micro-batch policy's run is split

    def waits(self, seq: SeqInfo) -> bool:
        """Whether `seq`, sampled in a step in flight, must sit out the next step even where
        sequences chain (its next step needs this one's token on the host)."""
        return False

    def ready(self, run: Run) -> Run:
        """`run` less what cannot go yet (before the state launches it)."""
        return run

    def scheduled(self, start: float, state: SchedulerState) -> None:
        """The policy was asked from `start` (perf_counter) until now; nothing of its answer
        is done yet."""

    def launch(self, runs: list[Run], state: SchedulerState) -> object:
        """Start one step carrying `runs`, launched on `state` and not yet recorded (each
        sequence's counts are those before the step). Returns a handle for `land`, or None
        if there was nothing to run."""
        raise NotImplementedError

    def free(self, handle: object, seqs: list[SeqInfo]) -> None:
        """`seqs`, of the step `handle`, were freed in the state at launch: their token in
        flight is certainly their last (they finish when it lands)."""

    def left(self, handle: object) -> bool:
        """Whether the step `handle`'s micro-batch has left the last stage (its KV is written
        and its tokens sampled on the device), so that its sequences may join another before
        it lands. False: they return when it lands."""
        return False

    def release(self, handle: object, seqs: list[SeqInfo]) -> None:
        """The step `handle` left and the driver releases it (`left`), before the state
        records it: `seqs`, whose token in it is certainly their last, are freed; its
        sequences may be in the next step, their tokens fed from it."""

    def land(self, handle: object, state: SchedulerState) -> Iterable[Hashable]:
        """Wait for the step `handle`; the ids of its sequences that ended as it landed."""
        raise NotImplementedError

    def execute(self, action: Action, state: SchedulerState) -> None:
        """Do a Switch / SwapIn / Preempt (nothing is in flight)."""
        raise NotImplementedError


@dataclasses.dataclass
class InFlight:
    """A launched step: the runs it carries and the executor's handle."""

    runs: list[Run]
    handle: object
    held: list[Hashable] = dataclasses.field(default_factory=list)  # out until it lands
    sampled: list[SeqInfo] = dataclasses.field(default_factory=list)  # its sampled sequences
    released: bool = False  # its sequences returned when it left, before it landed


class Driver:
    """The loop: `policy` over `state`, carried out by `executor`."""

    def __init__(self, policy: Policy, state: SchedulerState, executor: StepExecutor):
        self.policy, self.state, self.executor = policy, state, executor
        self.in_flight: deque[InFlight] = deque()  # launched, not landed, oldest first
        self._ending: dict[Hashable, bool] = {}  # ended, in a micro-batch in flight: abort?

    def run(self, max_steps: int = 10_000_000) -> int:
        """Step until every sequence finished and every step landed; returns the steps.
        Raises if the policy stalls (no action, nothing in flight)."""
        for count in range(max_steps):
            if not (self.state.has_work() or self.in_flight):
                return count
            if not self.step():
                raise RuntimeError(
                    f"policy {self.policy.name!r} returned no action with "
                    f"{len(self.state.waiting)} waiting, {len(self.state.device)} on device, "
                    f"{len(self.state.host)} in the host tier")
        raise RuntimeError(f"policy {self.policy.name!r} did not finish in {max_steps} steps")

    def step(self) -> bool:
        """One turn of the loop; False if the policy had nothing to do and nothing was in
        flight to wait for."""
        steps, action = self._form()
        if steps:
            for runs in steps:
                self._launch(runs)
                self._release_left()
                while len(self.in_flight) > self.executor.in_flight:
                    self.land()
        elif action is None:
            if not self.in_flight:
                return False
            self.land()  # the policy waits for the oldest step in flight
            self._release_left()  # (others may have left in the idle ticks that brought it)
        else:
            while self.in_flight:
                self.land()
            self._execute(action)
        return True

    def _form(self) -> tuple[list[list[Run]], Action | None]:
        """The next steps' runs, each launched on the state, and the policy's last answer.
        A merged step takes up to policy.depth micro-batches, stopping at an action that is
        not a Run or at one that would take it past `max_step_tokens` (left unlaunched: the
        policy forms it again next step). Over pipeline stages (`executor.flow_depth` > 1) a
        one-micro-batch policy's run is split (`_pieces`), each piece a step of its own."""
        runs: list[Run] = []
        action = None
        per_step = self.policy.depth if self.executor.merge else 1
        budget = self.executor.max_step_tokens
        while len(runs) < per_step:
            start = time.perf_counter()
            action = self.policy.schedule(self.state)
            self.executor.scheduled(start, self.state)
            if not isinstance(action, Run):
                break
            run = self.executor.ready(action)
            if runs and budget is not None and _tokens(runs + [run]) > budget:
                break
            pieces = self._pieces(run)
            for piece in pieces:
                self.state.launch(piece)
            runs.extend(pieces)
        if len(runs) > 1 and not self.executor.merge:
            return [[run] for run in runs], action
        return ([runs] if runs else []), action

    def _pieces(self, run: Run) -> list[Run]:
        """`run` as the micro-batches it flows in: itself, unless the executor pipelines
        (`flow_depth` stages) and the policy forms one micro-batch per step (depth 1). Then
        a run of at least twice a stage's share of the sequences (1 / flow_depth of those on
        the device) is split into pieces of about that share, so that every stage has work.
        A piece returns alone, about one share, and its next run stays whole."""
        depth = self.executor.flow_depth
        if depth <= 1 or self.policy.depth > 1:
            return [run]
        share = math.ceil(max(len(self.state.device), len(run.seqs)) / depth)
        if len(run.seqs) < 2 * share:
            return [run]
        return run.split(min(depth, len(run.seqs) // share))

    def _launch(self, runs: list[Run]) -> None:
        """Start the step and record it in the state at once; free the sequences whose
        token in flight is certainly their last (the next step may take their room)."""
        sampled = [s for run in runs for s in run.sampling()]  # before the counts advance
        handle = self.executor.launch(runs, self.state)
        for run in runs:
            self.state.apply(run, busy=not self.executor.chained)
        # Free each sequence whose token in flight is certainly its last, so the next step
        # may take its room; not while micro-batches flow through stages (`chained` False):
        # its KV is whole only when its micro-batch leaves the last stage, and a block freed
        # earlier could be read out (a prefix-cache spill) before the later stages wrote it.
        last = ([s for s in sampled if s.generated >= s.max_output_len]
                if self.executor.chained else [])
        self.state.finish(s.seq_id for s in last)
        if handle is not None:
            self.executor.free(handle, last)
            held = [s.seq_id for s in sampled if self.executor.chained
                    and s.location is Location.DEVICE and self.executor.waits(s)]
            self.state.busy.update(held)  # they join again when this step lands
            self.in_flight.append(InFlight(runs, handle, held, sampled))

    def _release_left(self) -> None:
        """Release every step in flight whose micro-batch has left the last stage (the
        executor's `left`), oldest first; the ones released before land first, so at most
        one released step waits to land (the next step's tokens are fed from it)."""
        fresh = [s for s in self.in_flight if not s.released and self.executor.left(s.handle)]
        for step in fresh:
            while self.in_flight[0].released:
                self.land()
            self._release(step)

    def _release(self, step: InFlight) -> None:
        """`step` left: its sequences return to the state now (less those the executor says
        `waits`: they stay out until it lands), those whose token in it is certainly their
        last are freed, the ones that ended meanwhile leave; the policy hears `left`."""
        step.released = True
        ending = self._ended_in(step)
        live = [s for s in step.sampled if s.location is Location.DEVICE
                and s.seq_id not in ending]
        last = [s for s in live if s.generated >= s.max_output_len]
        step.held = [s.seq_id for s in live
                     if s.generated < s.max_output_len and self.executor.waits(s)]
        self.executor.release(step.handle, last)  # (its swap-outs read the blocks held now)
        for run in step.runs:
            self.state.returned(run)
        self.state.busy.update(step.held)
        self._leave(ending)
        self.state.finish(s.seq_id for s in last)
        for run in step.runs:
            self._left(run)

    def land(self) -> None:
        """The oldest step in flight lands: the sequences the executor says ended leave the
        state (those freed at launch or aborted meanwhile have left already; one already in a
        later micro-batch in flight when that one leaves, `end`), and the policy hears
        exactly each run's own. Public for a caller that interleaves several drivers over
        one executor (the simulator's vLLM virtual engines, planner/virtual_engines.py)."""
        step = self.in_flight.popleft()
        self.state.busy.difference_update(step.held)
        ending = {} if step.released else self._ended_in(step)
        ended = set(self.executor.land(step.handle, self.state))
        done = [[s for s in run.seqs if s.seq_id in ended] for run in step.runs]
        for seq in (s for seqs in done for s in seqs):
            if seq.location is not Location.FINISHED and seq.seq_id not in ending:
                self.end(seq.seq_id, abort=False)
        self._leave(ending)
        for run, seqs in zip(step.runs, done, strict=True):
            if not step.released:
                if not self.executor.chained:
                    self.state.returned(run)
                self._left(run)
            self.policy.landed(run, seqs, self.state)

    def _left(self, run: Run) -> None:
        """Tell the policy `run` left the last stage (a policy without `left` needs not)."""
        left = getattr(self.policy, "left", None)
        if left is not None:
            left(run, self.state)

    def end(self, seq_id: Hashable, abort: bool = True) -> None:
        """`seq_id` ended (`abort`: cancelled, or cut by a stop string; else by its own
        token): it leaves the state now, or, while it is in a micro-batch in flight that has
        not left the last stage (where sequences do not chain), when that one leaves."""
        if not self.executor.chained and any(
                not step.released and any(s.seq_id == seq_id for r in step.runs for s in r.seqs)
                for step in self.in_flight):
            self._ending[seq_id] = self._ending.get(seq_id, False) or abort
        elif abort:
            self.state.abort(seq_id)
        else:
            self.state.finish([seq_id])

    def _ended_in(self, step: InFlight) -> dict[Hashable, bool]:
        """The sequences of `step` that ended while it was in flight (`end`), taken out."""
        ids = {s.seq_id for run in step.runs for s in run.seqs}
        return {i: self._ending.pop(i) for i in list(self._ending) if i in ids}

    def _leave(self, ending: dict[Hashable, bool]) -> None:
        """The sequences that ended while in a micro-batch that has now left leave the state."""
        for seq_id, abort in ending.items():
            self.end(seq_id, abort)

    def _execute(self, action: Action) -> None:
        """Do a Switch / SwapIn / Preempt decided before the steps in flight landed, less the
        sequences that ended or moved meanwhile (a micro-batch's prefills for the host tier
        go there when it lands). A swap-in is recorded first (the state gives the
        blocks its KV goes into), a switch or preemption after (its KV is read from them)."""
        if action.kind in (Kind.SWAP_IN, Kind.PREEMPT):  # still where the action found them
            where = Location.HOST if action.kind is Kind.SWAP_IN else Location.DEVICE
            action = dataclasses.replace(
                action, seqs=[s for s in action.seqs if s.location is where])
        if action.kind is Kind.SWAP_IN:
            self.state.apply(action)
            self.executor.execute(action, self.state)
        else:
            self.executor.execute(action, self.state)
            self.state.apply(action)


def _tokens(runs: list[Run]) -> int:
    return sum(r.prefill_tokens + len(r.decode) for r in runs)
