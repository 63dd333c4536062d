"""The HTTP Batch API's runner: a batch job's requests run on this server's engine through its
`EngineClient`, beside the live traffic (`ClientRunner`; `jaxpipe.batch.runners` has the
runners of `python -m jaxpipe.batch`, whose contract it follows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from jaxpipe.batch.openai import BatchLine, Failed, Finished
from jaxpipe.batch.runners import Emit, ServerError
from jaxpipe.request.errors import RequestError
from jaxpipe.request.outputs import Completion
from jaxpipe.request.validate import Limits, prepare
from jaxpipe.serve import messages as m
from jaxpipe.serve.engine_calls import ThreadCall
from jaxpipe.serve.engine_client import EngineUnavailable


class ClientRunner:
    """Runs requests on a serving process's engine through its `EngineClient`, beside the live
    traffic: the HTTP Batch API's jobs (`batches.py`), as one `ThreadCall` per
    run. `cancel()` aborts what is in flight and stops taking input."""

    def __init__(self, client, tokenizer, model: str, prefix: str, max_in_flight: int):
        self.client, self.tokenizer, self.model = client, tokenizer, model
        self.prefix, self.max_in_flight = prefix, max_in_flight
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def run(self, items: Iterator[BatchLine], emit: Emit) -> None:
        """Feed `items` to the engine and emit each result as its request finishes; raises
        ServerError if the engine is or goes down (the job resumes later)."""
        call = ThreadCall(self.client, self.prefix)
        # by index in the call: a request's n samples share its list of Completions
        live: dict[int, tuple[BatchLine, list[Completion], int]] = {}
        more = True
        try:
            while (more or live) and not self._cancelled.is_set():
                while more and len(live) < self.max_in_flight:
                    item = next(items, None)
                    more = item is not None
                    if more:
                        self._add(item, call, live, emit)
                if live:
                    self._take(call.next(timeout=0.2), live, emit)  # wakes to notice cancel()
        except EngineUnavailable as e:
            raise ServerError(str(e)) from None
        finally:
            call.abort_unfinished()

    def _add(self, item: BatchLine, call, live: dict, emit: Emit) -> None:
        info = self.client.info
        if info is None:
            raise ServerError(self.client.unavailable_reason())
        try:
            prep = prepare(item.kind, item.prompt, item.sampling, self.tokenizer,
                           Limits(info.max_model_len, info.vocab_size), item.template_vars)
        except RequestError as e:
            emit(item, Failed.from_error(e))
            return
        first, n = call.submit(prep), prep.params.n
        completions = [Completion(prep, self.tokenizer) for _ in range(n)]
        live.update({first + i: (item, completions, first) for i in range(n)})

    @staticmethod
    def _take(taken, live: dict, emit: Emit) -> None:
        if taken is None:
            return
        index, msg = taken
        item, completions, first = live[index]
        if isinstance(msg, m.Rejected):
            for i in range(len(completions)):
                del live[first + i]
            emit(item, Failed("invalid_argument", msg.message, None))
            return
        completions[index - first].add(msg)
        if all(c.finished for c in completions):
            for i in range(len(completions)):
                del live[first + i]
            emit(item, Finished.of(*completions))


