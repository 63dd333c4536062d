"""One call's requests in the engine, as a front end sees them: submitted together through the
`EngineClient`, their deltas gathered, whatever has not finished aborted when the call ends
early (client gone, engine lost, error, job cancelled), which frees the sequences' KV blocks.

`EngineCall` is that bookkeeping; its two thin adapters differ only in how they wait for the
next item: `ThreadCall` on a job or RPC thread (a plain queue), `LoopCall` on the asyncio loop
(items handed over with `call_soon_threadsafe`). Each request's deltas are folded into its
output by `jaxpipe.request.outputs.Completion`, the same for every front end.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Iterable

from jaxpipe.request.validate import Prepared
from jaxpipe.serve import messages as m
from jaxpipe.serve.engine_client import EngineClient, EngineLost, EngineUnavailable

Item = m.TokenDelta | m.Rejected


class EngineCall:
    """The engine requests of one call, each sample known by its index in the call (the order
    they were submitted; a request of n samples takes n indices in a row, as OpenAI numbers
    the choices of a list of prompts). `EngineClient`'s receiver thread puts their items on
    `out`; the calling thread takes them; `abort_unfinished` may come from any thread."""

    def __init__(self, client: EngineClient, prefix: str, out):
        self.client, self.prefix, self.out = client, prefix, out
        self._count = itertools.count()
        self._lock = threading.Lock()  # guards unfinished
        self.unfinished: dict[str, int] = {}  # sample key (messages.sample_key) -> index

    def submit(self, prep: Prepared) -> int:
        """Queue one request; returns the index of its first sample (the others follow).
        EngineUnavailable if the engine is down."""
        n = prep.params.n
        index = next(self._count)
        for _ in range(n - 1):
            next(self._count)
        rid = f"{self.prefix}-{index}"
        keys = m.sample_keys(rid, n)
        with self._lock:
            self.unfinished.update({key: index + i for i, key in enumerate(keys)})
        try:
            self.client.submit(rid, prep.prompt_token_ids, prep.params_dict, self.out)
        except EngineUnavailable:
            with self._lock:
                for key in keys:
                    del self.unfinished[key]
            raise
        return index

    def submit_all(self, prepared: Iterable[Prepared]) -> None:
        """Queue every request, or none: EngineUnavailable (nothing left queued)."""
        try:
            for prep in prepared:
                self.submit(prep)
        except EngineUnavailable:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> None:
        """Abort every request still running (its KV is freed); idempotent."""
        with self._lock:
            rids, self.unfinished = list(self.unfinished), {}
        for rid in rids:
            self.client.abort(rid)

    def _take(self, item) -> tuple[int, Item] | None:
        """(index, delta or rejection) of an item from the client; None for one of a request
        this call has stopped following (aborted). Raises EngineUnavailable if the engine died."""
        if isinstance(item, EngineLost):
            with self._lock:
                self.unfinished.clear()  # the engine that held them is gone
            raise EngineUnavailable(item.message)
        final = isinstance(item, m.Rejected) or item.finish_reason is not None
        with self._lock:
            index = (self.unfinished.pop if final else self.unfinished.get)(item.request_id,
                                                                           None)
            if isinstance(item, m.Rejected):  # its other samples never start
                for key in [k for k in self.unfinished if k.startswith(f"{item.request_id}/")]:
                    del self.unfinished[key]
        return None if index is None else (index, item)


class ThreadCall(EngineCall):
    """An EngineCall waited on from a thread."""

    def __init__(self, client: EngineClient, prefix: str):
        super().__init__(client, prefix, queue.Queue())

    def next(self, timeout: float | None = None) -> tuple[int, Item] | None:
        """The next (index, item); None once no request is unfinished, or if none came within
        `timeout` s. Raises EngineUnavailable if the engine died."""
        while self.unfinished:
            try:
                taken = self._take(self.out.get(timeout=timeout))
            except queue.Empty:
                return None
            if taken is not None:
                return taken
        return None


class LoopCall(EngineCall):
    """An EngineCall waited on from the asyncio loop it was made on."""

    def __init__(self, client: EngineClient, prefix: str):
        super().__init__(client, prefix, _Sink(asyncio.get_running_loop()))

    async def items(self) -> AsyncIterator[tuple[int, Item]]:
        """(index, item) as they arrive, until every request has finished. Raises
        EngineUnavailable if the engine died."""
        while self.unfinished:
            taken = self._take(await self.out.queue.get())
            if taken is not None:
                yield taken


class _Sink:
    """A queue the engine client's thread puts into and the event loop reads from."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is waiting
            pass
