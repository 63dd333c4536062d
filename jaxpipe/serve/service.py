"""The gRPC service `jaxpipe.v1.Generation`: parse and validate, tokenize, hand requests to the
engine process, detokenize and stream results back. No engine logic lives here.

Every accepted request ends with exactly one final message: a result, an INVALID_ARGUMENT
naming the field, or UNAVAILABLE if the engine process died. A client that cancels or
disconnects has its request aborted in the engine, which frees the sequence's slot.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe.request.errors import RequestError
from jaxpipe.request.outputs import Completion
from jaxpipe.request.validate import Limits, Prepared, prepare
from jaxpipe.serve import messages as m
from jaxpipe.serve import protos
from jaxpipe.serve.engine_calls import ThreadCall
from jaxpipe.serve.engine_client import EngineClient, EngineUnavailable
from jaxpipe.serve.metrics import ServerMetrics

log = logging.getLogger("jaxpipe.serve")


@dataclass
class _Pending:
    """One accepted request of a GenerateBatch call, while it runs."""

    custom_id: str
    start: float
    completion: Completion
    index: int = 0  # which of the item's n samples


class GenerationService(pb_grpc.GenerationServicer):
    """Implements Generate, GenerateBatch and GetServerInfo over an `EngineClient`."""

    def __init__(self, client: EngineClient, tokenizer, max_request_bytes: int,
                 metrics: ServerMetrics):
        self.client = client
        self.tokenizer = tokenizer
        self.max_request_bytes = max_request_bytes
        self._ids = itertools.count()
        self.outcomes = metrics.outcomes  # refusals only the front ends see (metrics.py)
        self.latency = metrics.latency

    # ---- Generate -----------------------------------------------------------------------------

    def Generate(self, request, context):
        """Stream one request's tokens and text; the last message carries usage."""
        call, start = self._call("g", context), time.perf_counter()
        timer = self.latency.timer("grpc")
        self._check_engine(context)
        try:
            prep = self._prepare(request, "request")
        except RequestError as e:
            log.info("Generate %s rejected: %s", call.prefix, e)
            self.outcomes.add("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        first = self._submit(call, prep, context)
        # one Completion per sample (n > 1: each message's `index` says whose it is)
        samples = [Completion(prep, self.tokenizer, stream=True, timer=timer if i == 0 else None)
                   for i in range(prep.params.n)]
        while (taken := self._next(call, context)) is not None:
            index, item = taken[0] - first, taken[1]
            c = samples[index]
            text = c.add(item)
            yield self._response(request, item, text, c, index)
            if all(s.finished for s in samples):
                self._log_done("Generate", call.prefix, samples[0], start)
                return

    @staticmethod
    def _response(request, item: m.TokenDelta, text: str, c: Completion,
                  index: int = 0) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=request.request_id, token_ids=item.token_ids,
                                   logprobs=protos.logprobs_proto(item.logprobs or []),
                                   text=text, prompt_logprobs=protos.prompt_logprobs_proto(
                                       item.prompt_logprobs), index=index)
        if item.finish_reason is None:
            return resp
        resp.finish_reason = item.finish_reason
        protos.set_stop_reason(resp, item.stop_reason)
        resp.usage.CopyFrom(protos.usage_proto(len(c.prep.prompt_token_ids), len(c.token_ids)))
        return resp

    def _next(self, call: ThreadCall, context):
        """The next (index, delta) of a call, None once it has none unfinished (cancelled);
        aborts a Generate call on rejection or engine loss."""
        try:
            taken = call.next()
        except EngineUnavailable as e:
            self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if taken is not None and isinstance(taken[1], m.Rejected):
            self.outcomes.add("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {taken[1].message}")
        return taken

    # ---- GenerateBatch ------------------------------------------------------------------------

    def GenerateBatch(self, request, context):
        """One result per item, streamed as each finishes; bad items get error results."""
        self._check_engine(context)
        call = self._call("b", context)
        pending: dict[int, _Pending] = {}  # by index in the call
        seen: dict[str, int] = {}
        for i, item in enumerate(request.items):
            error = self._admit(i, item, seen, call, pending, context)
            if error is not None:
                yield error
        log.info("GenerateBatch: %d items, %d accepted", len(request.items), len(pending))
        while pending:
            result = self._batch_step(call, pending, context)
            if result is not None:
                yield result

    def _admit(self, i: int, item, seen: dict, call: ThreadCall, pending: dict,
               context) -> pb.BatchResult | None:
        """Validate and submit item i; return its error result if it is refused."""
        cid = item.custom_id
        try:
            if not cid:
                raise RequestError(f"items[{i}].custom_id", "every item needs a custom_id")
            if cid in seen:
                raise RequestError("custom_id", f"duplicate custom_id {cid!r} (first used by "
                                   f"items[{seen[cid]}]); custom_ids must be unique in a batch")
            seen[cid] = i
            prep = self._prepare(item, f"items[{i}]")
        except RequestError as e:
            log.info("GenerateBatch item %r rejected: %s", cid, e)
            self.outcomes.add("invalid")
            return protos.error_result(cid, "INVALID_ARGUMENT", e.field, e.message)
        start, timer = time.perf_counter(), self.latency.timer("grpc")
        first = self._submit(call, prep, context)
        for i in range(prep.params.n):  # one result per sample, `completion.index` i
            pending[first + i] = _Pending(cid, start, Completion(
                prep, self.tokenizer, timer=timer if i == 0 else None), i)
        return None

    def _batch_step(self, call: ThreadCall, pending: dict, context) -> pb.BatchResult | None:
        """Fold the call's next engine message into its request; return a result when it
        finishes."""
        try:
            taken = call.next()
        except EngineUnavailable as e:
            for _ in pending:
                self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{e}; {len(pending)} items of this batch did not finish")
        if taken is None:  # cancelled: what was unfinished has been aborted
            pending.clear()
            return None
        index, item = taken
        p = pending[index]
        if isinstance(item, m.Rejected):  # its other samples never start: one error for all
            for key in [k for k, q in pending.items() if q.custom_id == p.custom_id]:
                del pending[key]
            self.outcomes.add("invalid")
            return protos.error_result(p.custom_id, "INVALID_ARGUMENT", "request", item.message)
        p.completion.add(item)
        if not p.completion.finished:
            return None
        del pending[index]
        self._log_done("GenerateBatch", f"{item.request_id} ({p.custom_id})", p.completion,
                       p.start)
        return pb.BatchResult(custom_id=p.custom_id,
                              completion=self._completion(p.completion, p.index))

    @staticmethod
    def _completion(c: Completion, index: int = 0) -> pb.Completion:
        prompt_ids = c.prep.prompt_token_ids
        out = pb.Completion(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
                            logprobs=protos.logprobs_proto(c.logprobs),
                            prompt_token_ids=prompt_ids,
                            prompt_logprobs=protos.prompt_logprobs_proto(c.prompt_logprobs),
                            usage=protos.usage_proto(len(prompt_ids), len(c.token_ids)),
                            index=index)
        protos.set_stop_reason(out, c.stop_reason)
        return out

    # ---- shared -------------------------------------------------------------------------------

    def _check_engine(self, context) -> None:
        """UNAVAILABLE unless the engine process is loaded and alive."""
        if not self.client.serving:
            self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, self.client.unavailable_reason())

    def _prepare(self, msg, path: str) -> Prepared:
        size = msg.ByteSize()
        if size > self.max_request_bytes:
            raise RequestError(path, f"{size} bytes exceeds the server's max_request_bytes="
                               f"{self.max_request_bytes}")
        protos.check_known_fields(msg)
        info = self.client.info
        kind, value = protos.prompt_of(msg)
        prep = prepare(kind, value, protos.sampling_of(msg), self.tokenizer,
                       Limits(info.max_model_len, info.vocab_size))
        return prep

    def _call(self, prefix: str, context) -> ThreadCall:
        """The engine requests of this RPC, aborted however the RPC ends (client gone)."""
        call = ThreadCall(self.client, f"{prefix}{next(self._ids)}")
        context.add_callback(call.abort_unfinished)
        return call

    def _submit(self, call: ThreadCall, prep: Prepared, context) -> int:
        try:
            index = call.submit(prep)
        except EngineUnavailable as e:
            self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not context.is_active():
            call.abort_unfinished()  # the call had already ended (client gone)
        return index

    @staticmethod
    def _log_done(method: str, rid: str, c: Completion, start: float) -> None:
        log.info("%s %s: %d prompt + %d completion tokens, finish_reason=%s, %.2f s", method,
                 rid, len(c.prep.prompt_token_ids), len(c.token_ids), c.finish_reason,
                 time.perf_counter() - start)

    # ---- GetServerInfo ------------------------------------------------------------------------

    def GetServerInfo(self, request, context):
        """The model, limits and load of the engine behind this server."""
        info, alive = self.client.info, not self.client.dead.is_set()
        reply = pb.ServerInfo(engine_alive=alive and info is not None,
                              engine_pid=self.client.proc.pid,
                              protocol_version=str(m.PROTOCOL_VERSION))
        if info is not None:
            reply.model, reply.max_model_len = info.model, info.max_model_len
            reply.vocab_size, reply.max_num_seqs = info.vocab_size, info.max_num_seqs
        stats = self.client.stats()
        if stats is not None:
            reply.unfinished_requests = stats.unfinished_requests
            reply.engine_has_unfinished = stats.engine_has_unfinished
            reply.finished_requests = stats.finished_requests
            reply.aborted_requests = stats.aborted_requests
            reply.generated_tokens = stats.generated_tokens
        return reply
