"""One call's requests (jaxpipe/serve/engine_calls.py) over a scripted engine: the thread and
the event-loop adapters gather the same deltas, abort what has not finished, and report a lost
engine. No model runs."""

from __future__ import annotations

import asyncio

import pytest
from scripted_engine import ScriptedEngine

from jaxpipe.request.outputs import Completion
from jaxpipe.request.validate import Limits, prepare
from jaxpipe.serve.engine_calls import LoopCall, ThreadCall
from jaxpipe.serve.engine_client import EngineUnavailable

LIMITS = Limits(64, 1000)


def prep(*ids: int, **sampling):
    return prepare("token_ids", list(ids), {"max_tokens": 2, **sampling}, None, LIMITS)


def gather_on_thread(engine, preps) -> list[Completion]:
    call, done = ThreadCall(engine, "t"), [Completion(p, None) for p in preps]
    call.submit_all(preps)
    while (taken := call.next(timeout=5)) is not None:
        done[taken[0]].add(taken[1])
    return done


def gather_on_loop(engine, preps) -> list[Completion]:
    async def run():
        call, done = LoopCall(engine, "l"), [Completion(p, None) for p in preps]
        call.submit_all(preps)
        async for index, item in call.items():
            done[index].add(item)
        return done

    return asyncio.run(run())


@pytest.mark.parametrize("gather", [gather_on_thread, gather_on_loop])
def test_each_request_gathers_its_own_deltas(gather):
    preps = [prep(3, 5), prep(7, 9, 11, logprobs=0)]
    done = gather(ScriptedEngine(), preps)
    assert [c.token_ids for c in done] == [[3, 5], [7, 11]]
    assert [c.finish_reason for c in done] == ["length", "length"]
    assert done[0].requested_logprobs is None
    assert done[1].requested_logprobs == [[[7, -0.5]], [[11, -0.25]]]


def test_abort_unfinished_aborts_only_what_still_runs():
    engine = ScriptedEngine()
    engine.hold = True
    call = ThreadCall(engine, "t")
    call.submit_all([prep(1), prep(2)])
    call.abort_unfinished()
    call.abort_unfinished()  # idempotent
    assert sorted(engine.aborted) == ["t-0", "t-1"]
    assert call.next(timeout=0.1) is None  # the abort deltas are of requests no longer followed


def test_a_lost_engine_raises_unavailable_and_leaves_nothing_to_abort():
    engine = ScriptedEngine()
    engine.hold = True
    call = ThreadCall(engine, "t")
    call.submit(prep(1))
    engine.lose()
    with pytest.raises(EngineUnavailable, match="code -9"):
        call.next(timeout=5)
    assert not call.unfinished
    with pytest.raises(EngineUnavailable):
        call.submit_all([prep(2)])
    assert not call.unfinished
