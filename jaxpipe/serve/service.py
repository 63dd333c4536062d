"""The gRPC service `jaxpipe.v1.Generation`: parse and validate, tokenize, hand requests to the
engine process, detokenize and stream results back. No engine logic lives here.

Every accepted request ends with exactly one final message: a result, an INVALID_ARGUMENT
naming the field, or UNAVAILABLE if the engine process died. A client that cancels or
disconnects has its request aborted in the engine, which frees the sequence's slot.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from dataclasses import dataclass, field

import grpc

from jaxpipe.requests import Limits, Prepared, RequestError, prepare
from jaxpipe.serve import jaxpipe_pb2 as pb
from jaxpipe.serve import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe.serve import messages as m
from jaxpipe.serve import protos
from jaxpipe.serve.engine_client import EngineClient, EngineLost, EngineUnavailable
from jaxpipe.serve.metrics import RequestTimer, ServerMetrics
from jaxpipe.stopping import TextStream, final_text

log = logging.getLogger("jaxpipe.serve")


@dataclass
class _Pending:
    """One accepted request of a GenerateBatch call, while it runs."""

    custom_id: str
    prepared: Prepared
    start: float
    timer: RequestTimer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)


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
        rid, start = f"g{next(self._ids)}", time.perf_counter()
        timer = self.latency.timer("grpc")
        self._check_engine(context)
        try:
            prep = self._prepare(request, "request")
        except RequestError as e:
            log.info("Generate %s rejected: %s", rid, e)
            self.outcomes.add("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        out: queue.Queue = queue.Queue()
        self._submit(rid, prep, out, context)
        stream = None if self.tokenizer is None else TextStream(
            self.tokenizer, prep.prompt_token_ids, prep.params.skip_special_tokens,
            prep.params.stop)
        completion = 0
        while True:
            item = self._next(out, context)
            completion += len(item.token_ids)
            timer.tokens(len(item.token_ids))
            yield self._response(request, item, stream, len(prep.prompt_token_ids), completion)
            if item.finish_reason is not None:
                timer.finished()
                self._log_done("Generate", rid, len(prep.prompt_token_ids), completion,
                               item.finish_reason, start)
                return

    @staticmethod
    def _response(request, item: m.TokenDelta, stream: TextStream | None, prompt_tokens: int,
                  completion: int) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=request.request_id, token_ids=item.token_ids,
                                   logprobs=protos.logprobs_proto(item.logprobs or []))
        if item.finish_reason is None:
            resp.text = stream.push(item.token_ids) if stream else ""
            return resp
        resp.text = stream.finish(item.token_ids, item.stop_reason) if stream else ""
        resp.finish_reason = item.finish_reason
        protos.set_stop_reason(resp, item.stop_reason)
        resp.usage.CopyFrom(protos.usage_proto(prompt_tokens, completion))
        return resp

    def _next(self, out: queue.Queue, context) -> m.TokenDelta:
        """The next delta of a Generate call; aborts the call on rejection or engine loss."""
        item = out.get()
        if isinstance(item, EngineLost):
            self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, item.message)
        if isinstance(item, m.Rejected):
            self.outcomes.add("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {item.message}")
        return item

    # ---- GenerateBatch ------------------------------------------------------------------------

    def GenerateBatch(self, request, context):
        """One result per item, streamed as each finishes; bad items get error results."""
        self._check_engine(context)
        out: queue.Queue = queue.Queue()
        pending: dict[str, _Pending] = {}
        seen: dict[str, int] = {}
        for i, item in enumerate(request.items):
            error = self._admit(i, item, seen, out, pending, context)
            if error is not None:
                yield error
        log.info("GenerateBatch: %d items, %d accepted", len(request.items), len(pending))
        while pending:
            result = self._batch_step(out.get(), pending, context)
            if result is not None:
                yield result

    def _admit(self, i: int, item, seen: dict, out: queue.Queue, pending: dict,
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
        rid = f"b{next(self._ids)}"
        pending[rid] = _Pending(cid, prep, time.perf_counter(), self.latency.timer("grpc"))
        self._submit(rid, prep, out, context)
        return None

    def _batch_step(self, item, pending: dict, context) -> pb.BatchResult | None:
        """Fold one engine message into its request; return a result when it finishes."""
        if isinstance(item, EngineLost):
            for _ in pending:
                self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{item.message}; {len(pending)} items of this batch did not finish")
        p = pending[item.request_id]
        if isinstance(item, m.Rejected):
            del pending[item.request_id]
            self.outcomes.add("invalid")
            return protos.error_result(p.custom_id, "INVALID_ARGUMENT", "request", item.message)
        p.token_ids.extend(item.token_ids)
        p.logprobs.extend(item.logprobs or [])
        p.timer.tokens(len(item.token_ids))
        if item.finish_reason is None:
            return None
        p.timer.finished()
        del pending[item.request_id]
        self._log_done("GenerateBatch", f"{item.request_id} ({p.custom_id})",
                       len(p.prepared.prompt_token_ids), len(p.token_ids), item.finish_reason,
                       p.start)
        return pb.BatchResult(custom_id=p.custom_id, completion=self._completion(p, item))

    def _completion(self, p: _Pending, last: m.TokenDelta) -> pb.Completion:
        text = ""
        if self.tokenizer is not None:
            text = final_text(self.tokenizer, p.token_ids, p.prepared.params.skip_special_tokens,
                              last.stop_reason)
        c = pb.Completion(text=text, token_ids=p.token_ids, finish_reason=last.finish_reason,
                          logprobs=protos.logprobs_proto(p.logprobs),
                          prompt_token_ids=p.prepared.prompt_token_ids,
                          usage=protos.usage_proto(len(p.prepared.prompt_token_ids),
                                                   len(p.token_ids)))
        protos.set_stop_reason(c, last.stop_reason)
        return c

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
        return prepare(kind, value, protos.sampling_of(msg), self.tokenizer,
                       Limits(info.max_model_len, info.vocab_size))

    def _submit(self, rid: str, prep: Prepared, out: queue.Queue, context) -> None:
        try:
            self.client.submit(rid, prep.prompt_token_ids, prep.params_dict, out)
        except EngineUnavailable as e:
            self.outcomes.add("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not context.add_callback(lambda: self.client.abort(rid)):
            self.client.abort(rid)  # the call had already ended (client gone)

    @staticmethod
    def _log_done(method: str, rid: str, prompt: int, completion: int, reason: str,
                  start: float) -> None:
        log.info("%s %s: %d prompt + %d completion tokens, finish_reason=%s, %.2f s", method,
                 rid, prompt, completion, reason, time.perf_counter() - start)

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
