"""vLLM V0's pipeline parallelism, for the simulator's vLLM baselines: pp "virtual engines",
each a scheduler of its own over its own share of the KV cache.

What vLLM V0 did (v0.5.1 to v0.8, `[Core] Pipeline Parallel Support`, vllm-project/vllm#4412;
RFC #4461; described again in RFC #11945 as the design V1 replaced):

- `LLMEngine.__init__` builds one `Scheduler` per pipeline stage, each with the same
  `SchedulerConfig` (so each has the full `max_num_seqs` and `max_num_batched_tokens`).
- `Scheduler.__init__` (vLLM's core scheduler module) divides `num_gpu_blocks` and
  `num_cpu_blocks` by `pipeline_parallel_size` for its own block manager: each engine owns
  1/pp of the KV.
- `LLMEngine.add_request` gives a new request to the scheduler with the fewest unfinished
  sequence groups (waiting + running + swapped); it never moves.
- `AsyncLLMEngine.run_engine_loop` keeps one step task per virtual engine and starts that
  engine's next step when its previous one returned: one micro-batch in flight per engine.

So a virtual engine cannot take another's free blocks: one whose requests grew long preempts
(or leaves prompts waiting) while another has room, and its micro-batches stay as large or as
small as its own requests make them. `VirtualEngines` runs pp `Driver`s over one pipelined
executor in that order; the engine's single scheduler (jaxpipe/scheduler) is untouched.
"""

from __future__ import annotations

from collections import deque

from jaxpipe.scheduler import Driver, Policy, SchedulerState, SeqInfo, StepExecutor


def assign(states: list[SchedulerState], seqs: list[SeqInfo]) -> None:
    """Add each request, in order, to the state with the fewest unfinished requests (the
    first such), as `LLMEngine.add_request` picks a virtual engine."""
    for seq in seqs:
        min(states, key=unfinished).add(seq)


def unfinished(state: SchedulerState) -> int:
    """Requests a virtual engine holds: waiting, on the device or in the host tier."""
    return len(state.waiting) + len(state.device) + len(state.host)


class VirtualEngines:
    """pp drivers, each its own policy over its own state, sharing one executor (its stages
    and clock). Each engine keeps at most one micro-batch in flight and forms its next one
    when that one landed; micro-batches leave the last stage in the order they entered, so
    landing the oldest in flight is landing the one that returns first."""

    def __init__(self, policies: list[Policy], states: list[SchedulerState],
                 executor: StepExecutor):
        if len(policies) != len(states) or len(states) < 2:
            raise ValueError(f"virtual engines need one policy per state and at least 2; got "
                             f"{len(policies)} policies, {len(states)} states")
        if executor.in_flight < len(states) - 1:
            raise ValueError(f"the executor keeps {executor.in_flight} in flight; "
                             f"{len(states)} engines need at least {len(states) - 1}")
        executor.flow_depth = 1  # an engine's micro-batch is what its scheduler formed
        self.drivers = [Driver(p, s, executor) for p, s in zip(policies, states, strict=True)]

    def run(self) -> None:
        """Every engine launches its first micro-batch, then the oldest in flight lands and
        its engine forms its next, until none has work. Raises if an engine with work has
        nothing to run and nothing in flight (as `Driver.run` does)."""
        order: deque[Driver] = deque(d for d in self.drivers if self._next(d))
        while order:
            driver = order.popleft()
            driver.land()
            if self._next(driver):
                order.append(driver)

    @staticmethod
    def _next(driver: Driver) -> bool:
        """Step `driver` (nothing of it in flight) until it launched a micro-batch; False if
        its engine has no work left."""
        while driver.state.has_work():
            if not driver.step():
                state = driver.state
                raise RuntimeError(
                    f"virtual engine stalled: policy {driver.policy.name!r} returned no action "
                    f"with {len(state.waiting)} waiting, {len(state.device)} on device")
            if driver.in_flight:
                return True
        return False
