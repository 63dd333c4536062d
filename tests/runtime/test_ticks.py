"""The runner's ticks (`runtime/ticks.py`) with a fake tick program on one device: a tick
stacks the micro-batches in flight padded to the largest, the activations carried to the next
tick are padded to its tokens (what the stages wrote kept), the leaving micro-batch's results
come from the runner's `results`, and only one phase's pipeline holds micro-batches."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.runtime import step_inputs
from jaxpipe.runtime.flow import MicroBatch, Pending
from jaxpipe.runtime.step_inputs import Piece
from jaxpipe.runtime.ticks import Ticks

HIDDEN = 3


class FakeRunner:
    """`run` adds 1 to the carried activations and returns each slot's token count as its
    hidden; `results` names the leaving micro-batch and that hidden."""

    def __init__(self):
        self.seen = []  # per tick: (tokens of the stack, the carried activations it got)

    def run(self, inputs, act):
        self.seen.append((inputs.num_tokens, np.asarray(act)))
        return jnp.asarray(inputs.q_len.sum(axis=1)), act + 1

    def results(self, hidden, mb):
        return mb.id, np.asarray(hidden).tolist()


def make_ticks(pp: int = 2) -> tuple[Ticks, FakeRunner]:
    mesh = Mesh(np.array(jax.devices()[:1]), ("pp",))
    place = SimpleNamespace(layout=Layout(pp=pp), act_sharding=NamedSharding(mesh, P("pp")))
    runner = FakeRunner()
    return Ticks({"prefill": place, "decode": place}, HIDDEN, runner.run, runner.results), runner


def micro(ticks: Ticks, tokens: int) -> MicroBatch:
    inputs = step_inputs.build([Piece(list(range(tokens)), 0, [0])], tokens, 1, 1)
    return MicroBatch(inputs, np.zeros(1, np.int32), None, Pending(ticks.drain))


def test_a_tick_stacks_the_micro_batches_in_flight_and_carries_their_activations():
    ticks, runner = make_ticks()
    first, second = micro(ticks, 2), micro(ticks, 5)
    ticks.enter("prefill", first)
    ticks.enter("prefill", second)
    assert first.pending.done == (0, [5, 2])  # left in the second tick, stacked with the 5
    assert ticks.in_flight() == 1 and second.pending.done is None
    assert second.pending.result() == (1, [0, 5])  # an idle tick brought it out
    assert [(t, a.shape) for t, a in runner.seen] == [(2, (2, 2, HIDDEN)), (5, (2, 5, HIDDEN)),
                                                      (5, (2, 5, HIDDEN))]
    assert not runner.seen[0][1].any()  # an empty pipeline carries zeros
    carried = runner.seen[1][1]  # the first tick's output, padded from 2 tokens to 5
    assert (carried[:, :2] == 1).all() and not carried[:, 2:].any()
    assert ticks.counts() == {"ticks": 3, "busy_slots": 4, "idle_slots": 2}
    assert list(ticks.records()) == ["prefill"] and len(ticks.records()["prefill"]) == 3
    assert ticks.stage_times()["prefill"]["stages"] == 2


def test_only_one_phase_holds_micro_batches_and_an_empty_pipeline_does_not_drain():
    ticks, _ = make_ticks()
    with pytest.raises(RuntimeError, match="no micro-batch is in the pipeline"):
        ticks.drain()
    ticks.enter("prefill", micro(ticks, 2))
    with pytest.raises(RuntimeError, match="enters the decode pipeline while the prefill"):
        ticks.enter("decode", micro(ticks, 2))
    ticks.drain()
    ticks.enter("decode", micro(ticks, 2))
    assert ticks.in_flight() == 1
    ticks.close()
