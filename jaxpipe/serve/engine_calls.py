"""One HTTP call's requests in the engine, seen from the front end's event loop.

`EngineClient` delivers each request's items from its receiver thread by calling `out.put(item)`;
`EngineCall` hands them to asyncio (`_Sink`), yields them as (prompt index, delta), and aborts
whatever has not finished when the call ends early (client gone, engine lost, error), which
frees the sequences' KV blocks in the engine. `Choice` turns one prompt's deltas into text with
the same `TextStream` the gRPC front end uses, so streamed and whole responses agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from jaxpipe.requests import Prepared, RequestError
from jaxpipe.serve import messages as m
from jaxpipe.serve.engine_client import EngineClient, EngineLost, EngineUnavailable
from jaxpipe.serve.metrics import RequestTimer
from jaxpipe.stopping import TextStream


class _Sink:
    """A queue the engine client's thread puts into and the event loop reads from."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is waiting
            pass


class EngineCall:
    """The engine requests of one HTTP call (one per prompt), submitted together."""

    def __init__(self, client: EngineClient, prefix: str, prepared: list[Prepared]):
        self.client, self.prepared = client, prepared
        self.ids = [f"{prefix}-{i}" for i in range(len(prepared))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.unfinished: set[str] = set()
        self._sink = _Sink(asyncio.get_running_loop())

    def submit(self) -> None:
        """Queue every request; EngineUnavailable (nothing left queued) if the engine is down."""
        try:
            for rid, prep in zip(self.ids, self.prepared, strict=True):
                self.client.submit(rid, prep.prompt_token_ids, prep.params_dict, self._sink)
                self.unfinished.add(rid)
        except EngineUnavailable:
            self.abort_unfinished()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, m.TokenDelta]]:
        """(prompt index, delta) as they arrive, until every request has finished. Raises
        EngineUnavailable if the engine died, RequestError if it refused a request."""
        while self.unfinished:
            item = await self._sink.queue.get()
            if isinstance(item, EngineLost):
                raise EngineUnavailable(item.message)
            if _final(item):
                self.unfinished.discard(item.request_id)
            if isinstance(item, m.Rejected):
                raise RequestError("request", item.message)
            yield self.index[item.request_id], item

    def abort_unfinished(self) -> None:
        """Abort every request still running (its KV is freed); idempotent."""
        for rid in self.unfinished:
            self.client.abort(rid)
        self.unfinished.clear()


def _final(item) -> bool:
    return isinstance(item, m.Rejected) or item.finish_reason is not None


class Choice:
    """One prompt's completion as it grows: token ids, logprobs, text, finish."""

    def __init__(self, prep: Prepared, tokenizer, echo: str = "",
                 timer: RequestTimer | None = None):
        self.prep, self.echo, self.timer = prep, echo, timer
        self.stream = None if tokenizer is None else TextStream(
            tokenizer, prep.prompt_token_ids, prep.params.skip_special_tokens, prep.params.stop)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.text = ""
        self.finish_reason: str | None = None
        self.started = False  # a chunk of it has been sent (a chat stream's first has the role)

    def add(self, delta: m.TokenDelta) -> str:
        """Fold in one delta; returns the new text safe to send (the echo first)."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if self.stream is None:
            new = ""
        elif delta.finish_reason is None:
            new = self.stream.push(delta.token_ids)
        else:
            new = self.stream.finish(delta.token_ids, delta.stop_reason)
        self.finish_reason = delta.finish_reason
        if self.timer is not None:
            self.timer.tokens(len(delta.token_ids))
            if delta.finish_reason is not None:
                self.timer.finished()
        new, self.echo = self.echo + new, ""
        self.text += new
        return new
