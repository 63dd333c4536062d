"""Who runs a batch job's requests: an `Engine` in this process (`LocalRunner`) or a running
`python -m jaxpipe.serve` (`RemoteRunner`, over GenerateBatch); inside that server, the HTTP
Batch API's `serve.batch_runner.ClientRunner` keeps the same contract. All take a stream of
`BatchLine`s and call `emit(line, Finished | Failed)` once per line, from the calling thread,
keeping at most `max_in_flight` requests outstanding so the input is never loaded whole."""

from __future__ import annotations

import itertools
import json
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from jaxpipe.batch.lookahead import DEFAULT_LOOKAHEAD, in_windows
from jaxpipe.batch.openai import BatchLine, Failed, Finished, body_field
from jaxpipe.request.errors import RequestError
from jaxpipe.request.outputs import Completion, token_delta
from jaxpipe.request.validate import Limits, prepare, sampling_params

Emit = Callable[[BatchLine, Finished | Failed], None]


class LocalRunner:
    """Runs requests on an in-process Engine through add_request / step."""

    def __init__(self, engine, max_in_flight: int,
                 prefix_lookahead: int = DEFAULT_LOOKAHEAD):
        """Use `engine` (an Engine nobody else is stepping) with at most `max_in_flight`
        requests queued in it; with its prefix cache on, queue them `prefix_lookahead` at a
        time in the cache's order (jaxpipe.batch.lookahead; 1: the input order)."""
        self.engine = engine
        self.limits = Limits(self.engine.max_model_len, self.engine.model_config.vocab_size)
        self.max_in_flight = max_in_flight
        self.lookahead = prefix_lookahead if engine.config.prefix_caching else 1
        self.model = self.engine.config.model
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, engine_kwargs: dict, max_in_flight: int,
                    prefix_lookahead: int = DEFAULT_LOOKAHEAD) -> LocalRunner:
        """Build the Engine from EngineConfig fields."""
        # lazy: a job sent to a server never loads jax: only this runner builds an Engine
        from jaxpipe import Engine, EngineConfig

        return cls(Engine(EngineConfig(**{"show_progress": False, **engine_kwargs})),
                   max_in_flight, prefix_lookahead)

    def run(self, items: Iterator[BatchLine], emit: Emit) -> None:
        """Feed `items` to the engine (in the prefix cache's order within each lookahead
        window) and emit each result as its request finishes."""
        # lazy: a job sent to a server never loads jax
        from jaxpipe.kv.device_cache import BLOCK

        ready = in_windows(self._prepared(items, emit), lambda x: x[1].prompt_token_ids,
                           self.lookahead, BLOCK)
        live: dict[str, tuple[BatchLine, list[Completion]]] = {}  # one Completion a sample
        more = True
        while more or live:
            while more and len(live) < self.max_in_flight:
                taken = next(ready, None)
                more = taken is not None
                if more:
                    self._add(*taken, live, emit)
            for seq in self.engine.step():
                if seq.is_finished and seq.group_id in live:
                    self._finished(seq, live, emit)

    def _finished(self, seq, live: dict, emit: Emit) -> None:
        """Sample `seq` finished: fold it in; emit its request once all n have."""
        item, completions = live[seq.group_id]
        completions[seq.index].add(token_delta(seq))
        if all(c.finished for c in completions):
            del live[seq.group_id]
            emit(item, Finished.of(*completions))
            self.engine.forget(seq.group_id)

    def _prepared(self, items: Iterator[BatchLine], emit: Emit) -> Iterator[tuple]:
        """(line, its `Prepared` request) for each of `items` that validates; the others
        are emitted as failures as they are read."""
        for item in items:
            try:
                yield item, prepare(item.kind, item.prompt, item.sampling,
                                    self.engine.tokenizer, self.limits, item.template_vars)
            except RequestError as e:
                emit(item, Failed.from_error(e))
            except (ValueError, TypeError) as e:
                emit(item, Failed("invalid_argument", str(e), None))

    def _add(self, item: BatchLine, prep, live: dict, emit: Emit) -> None:
        rid = str(next(self._ids))
        try:
            self.engine.add_request(None, prep.params, prompt_token_ids=prep.prompt_token_ids,
                                    request_id=rid)
        except RequestError as e:
            emit(item, Failed.from_error(e))
            return
        except (ValueError, TypeError) as e:
            emit(item, Failed("invalid_argument", str(e), None))
            return
        live[rid] = (item, [Completion(prep, self.engine.tokenizer)
                            for _ in range(prep.params.n)])


class ServerError(RuntimeError):
    """The server failed a whole call (e.g. UNAVAILABLE); the job stops and can be resumed."""


class RemoteRunner:
    """Sends requests to a jaxpipe server in GenerateBatch calls of `chunk` items, with up to
    `calls` calls in flight."""

    def __init__(self, address: str, max_in_flight: int, chunk: int = 32, timeout: float = 30):
        # lazy: only a job sent to a server speaks gRPC
        import grpc

        from jaxpipe.protocol import jaxpipe_pb2 as pb
        from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

        self.pb, self.grpc = pb, grpc
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.chunk = max(1, min(chunk, max_in_flight))
        self.calls = max(1, max_in_flight // self.chunk)
        try:
            info = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=timeout,
                                           wait_for_ready=True)
        except grpc.RpcError as e:
            raise ServerError(f"cannot reach a jaxpipe server at {address}: {e.code().name} "
                              f"{e.details()}") from None
        self.model = info.model

    def run(self, items: Iterator[BatchLine], emit: Emit) -> None:
        """Send `items` in chunks; emit results as they stream back."""
        results: queue.Queue = queue.Queue()
        active = 0
        more = True
        while more or active:
            while more and active < self.calls:
                chunk, more = self._next_chunk(items, emit)
                if chunk:
                    threading.Thread(target=self._call, args=(chunk, results),
                                     daemon=True).start()
                    active += 1
            if not active:
                continue
            kind, payload = results.get()
            if kind == "done":
                active -= 1
            elif kind == "failed":
                raise ServerError(payload)
            elif kind == "result":
                emit(*payload)

    def _next_chunk(self, items: Iterator[BatchLine], emit: Emit) -> tuple[dict, bool]:
        """(up to `chunk` valid items by custom_id, whether more input may follow)."""
        chunk: dict[str, tuple[BatchLine, object]] = {}
        taken = 0
        for item in itertools.islice(items, self.chunk):
            taken += 1
            try:
                chunk[item.custom_id] = (item, self._to_proto(item))
            except RequestError as e:
                emit(item, Failed.from_error(e))
        return chunk, taken == self.chunk

    def _to_proto(self, item: BatchLine):
        if item.tools is not None:
            raise RequestError("body.tools", "tool calls are not sent over gRPC; run the job "
                               "in this process (no --server) or through the HTTP Batch API")
        params = sampling_params(item.sampling)  # type and range errors, before the proto
        sp = self.pb.SamplingParams(**{k: v for k, v in item.sampling.items()
                                       if not (k == "stop" and isinstance(v, str))
                                       and k != "structured_outputs"})
        if isinstance(item.sampling.get("stop"), str):
            sp.stop.append(item.sampling["stop"])
        if params.structured_outputs is not None:
            sp.structured_outputs.CopyFrom(_structured_proto(self.pb, params.structured_outputs))
        msg = self.pb.BatchItem(custom_id=item.custom_id, sampling=sp)
        if item.kind == "text":
            msg.text = item.prompt
        elif item.kind == "chat":
            self._set_chat(msg, item.prompt)
        else:
            _set_token_ids(msg, item.prompt)
        return msg

    def _set_chat(self, msg, messages) -> None:
        if not isinstance(messages, list):
            raise RequestError("body.messages", "must be a list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise RequestError(f"body.messages[{i}]", "needs a string role and content")
            msg.chat.messages.add(role=str(m.get("role")), content=m["content"])
        if not messages:
            msg.chat.SetInParent()

    def _call(self, chunk: dict, results: queue.Queue) -> None:
        request = self.pb.BatchRequest(items=[proto for _, proto in chunk.values()])
        samples: dict[str, dict[int, Finished]] = {}  # an item of n samples: n results
        try:
            for r in self.stub.GenerateBatch(request):
                item, proto = chunk[r.custom_id]
                outcome = self._outcome(r)
                if isinstance(outcome, Failed):
                    results.put(("result", (item, outcome)))
                    continue
                got = samples.setdefault(r.custom_id, {})
                got[r.completion.index] = outcome
                if len(got) == (proto.sampling.n or 1):
                    first, *others = (got[i] for i in sorted(got))
                    results.put(("result", (item, replace(first, others=tuple(others)))))
            results.put(("done", None))
        except self.grpc.RpcError as e:
            results.put(("failed", f"GenerateBatch failed: {e.code().name}: {e.details()}"))

    @staticmethod
    def _outcome(r) -> Finished | Failed:

        if r.WhichOneof("result") == "error":
            return Failed(r.error.code.lower(), r.error.message, body_field(r.error.field))
        c = r.completion
        stop = c.stop_string if c.WhichOneof("stop_reason") == "stop_string" else (
            c.stop_token_id if c.WhichOneof("stop_reason") == "stop_token_id" else None)
        logprobs = [[[e.token_id, e.logprob] for e in t.entries] for t in c.logprobs] or None
        return Finished(list(c.prompt_token_ids), list(c.token_ids), c.text, c.finish_reason,
                        stop, logprobs)


def _structured_proto(pb, so):
    """A StructuredOutputsParams -> the proto's StructuredOutputs (a schema as JSON text)."""
    if so.kind == "json":
        return pb.StructuredOutputs(json=json.dumps(so.json))
    if so.kind == "choice":
        return pb.StructuredOutputs(choice=pb.StructuredOutputs.Choice(options=so.choice))
    return pb.StructuredOutputs(**{so.kind: getattr(so, so.kind)})


def _set_token_ids(msg, ids) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        bad = next(i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool))
        raise RequestError(f"body.prompt[{bad}]", f"token id {ids[bad]!r} is not an integer")
    if any(not -(2**63) <= t < 2**63 for t in ids):
        raise RequestError("body.prompt", "token ids must fit in 64 bits")
    msg.token_ids.ids.extend(ids)
    if not ids:
        msg.token_ids.SetInParent()
