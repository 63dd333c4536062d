"""The runner's flowing pipelines, tick by tick: for each layout phase a `Flow` (the
micro-batches in flight, `flow.py`) and the activations its stages carry from one tick to the
next ([pp, T, E], `pipeline.tick_program`'s `act`).

A tick stacks the micro-batches in front of the stages into one `StepInputs` (each padded to
the largest's buckets, `step_inputs.stack`), runs the runner's tick program on them and the
carried activations (`run`: the runner owns the weights, the KV pool and the programs) and
hands the micro-batch that left the last stage to the runner's sampler (`results`).

At most one phase's pipeline holds micro-batches: a layout switch needs an empty pipeline, and
`enter` refuses a micro-batch while another phase's are in flight. So `in_flight` and `drain`
need no phase: they are the current layout's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.flow import Flow, MicroBatch
from jaxpipe.runtime.step_inputs import StepInputs

# (stacked inputs of the tick, carried activations [pp, T, E], donated) -> (hidden
# [max_rows, E] of the rows leaving the last stage, the activations for the next tick)
Run = Callable[[StepInputs, jax.Array], tuple[jax.Array, jax.Array]]


def _resize_program(act_sharding: NamedSharding):
    """jit(act [pp, T, E], tokens: static) -> [pp, tokens, E]: cut, or padded with zeros."""
    def resize(act, tokens):
        t = act.shape[1]
        return act[:, :tokens] if t >= tokens else jnp.pad(act, ((0, 0), (0, tokens - t),
                                                                  (0, 0)))
    return jax.jit(resize, static_argnames="tokens", out_shardings=act_sharding)


class Ticks:
    """The micro-batches in flight through each phase's stages, and their ticks."""

    def __init__(self, placements: dict, hidden_size: int, run: Run,
                 results: Callable[[jax.Array, MicroBatch], object]):
        """`placements`: phase -> its `runner.Placement` (the layout's pp, the carried
        activations' sharding); `run`: the current phase's tick program on a tick's inputs;
        `results(hidden, mb)`: the results of micro-batch `mb`, which left with `hidden`."""
        self._placements, self._hidden_size = placements, hidden_size
        self._run, self._results = run, results
        self._flows: dict[str, Flow] = {}  # per phase: the micro-batches in its pipeline
        self._act: dict[str, jax.Array] = {}  # per phase: activations carried between stages
        self._resize: dict = {}  # act sharding -> its resize program

    def enter(self, phase: str, mb: MicroBatch) -> None:
        """Dispatch the tick that `mb` enters, in `phase`'s pipeline."""
        busy = [p for p, flow in self._flows.items() if p != phase and flow.in_flight]
        if busy:
            raise RuntimeError(f"a micro-batch enters the {phase} pipeline while the {busy[0]} "
                               "one holds micro-batches (drain it before a layout switch)")
        self._flow(phase).enter(mb)

    def in_flight(self) -> int:
        """Micro-batches dispatched that have not left the last stage."""
        return sum(flow.in_flight for flow in self._flows.values())

    def drain(self) -> None:
        """One idle tick: every micro-batch in flight one stage nearer the exit."""
        flow = next((f for f in self._flows.values() if f.in_flight), None)
        if flow is None:
            raise RuntimeError("no micro-batch is in the pipeline")
        flow.drain()

    def counts(self) -> dict:
        """Ticks run and stage-ticks with and without a micro-batch, over every layout."""
        flows = self._flows.values()
        return {"ticks": sum(f.ticks for f in flows),
                "busy_slots": sum(f.busy_slots for f in flows),
                "idle_slots": sum(f.idle_slots for f in flows)}

    def stage_times(self) -> dict:
        """Per phase: its stages' busy seconds and its pipeline's wall time (`StageClock`),
        counted up to the ticks seen finished now."""
        for flow in self._flows.values():
            flow.clock.poll()
        return {phase: flow.clock.totals() for phase, flow in self._flows.items()}

    def records(self) -> dict:
        """Per phase: the ticks kept for the trace (`flow.TickRecord`)."""
        return {phase: list(flow.clock.records) for phase, flow in self._flows.items()}

    def carried(self, phase: str, tokens: int) -> jax.Array:
        """The activations carried between `phase`'s stages [pp, tokens, E]: padded (or cut)
        to a tick of `tokens` tokens; the micro-batches in flight are no longer than that."""
        act = self._act.get(phase)
        if act is None or act.shape[1] != tokens:
            place = self._placements[phase]
            resize = self._resize.setdefault(place.act_sharding, _resize_program(
                place.act_sharding))
            act = resize(act if act is not None else jnp.zeros(
                (place.layout.pp, 0, self._hidden_size), jnp.float32), tokens)
        return act

    def close(self) -> None:
        """Free the carried activations."""
        for act in self._act.values():
            if not act.is_deleted():
                act.delete()
        self._act = {}

    def _flow(self, phase: str) -> Flow:
        if phase not in self._flows:
            self._flows[phase] = Flow(self._placements[phase].layout.pp,
                                      partial(self._tick, phase))
        return self._flows[phase]

    def _tick(self, phase: str, slots: list[MicroBatch | None]):
        """One tick of `phase`'s pipeline over the micro-batches of `slots` (slot s: stage
        s's; None: an idle one), each padded to the largest's buckets: (the results of the one
        leaving, the last slot's, or None; the tick's output, to poll)."""
        real = [mb.inputs for mb in slots if mb is not None]
        tokens, rows = max(x.num_tokens for x in real), max(x.num_rows for x in real)
        inputs = step_inputs.stack([mb and mb.inputs for mb in slots], tokens, rows)
        hidden, self._act[phase] = self._run(inputs, self.carried(phase, tokens))
        leaving = slots[-1]
        return (None if leaving is None else self._results(hidden, leaving)), hidden
