"""The OpenAI-compatible HTTP front end: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (SSE streaming included), `/health` and `/metrics`, beside the gRPC one
in the same process and over the same `EngineClient`.

Built on FastAPI + uvicorn: the ASGI stack vLLM, SGLang and TGI's router serve this API with,
so its SSE, disconnect and graceful-shutdown behaviour is the one every OpenAI client is tested
against. Bodies are read as plain JSON and checked by the validators gRPC and batch jobs use
(`request.openai.read_body`, then `request.validate.prepare`), not by pydantic models of their
own: one set of rules and messages for every front end.

A chat request with `tools` has its tools rendered by the chat template and its answer read
for calls (`request.tool_calls`: forced calls, or the `--tool-call-parser` for "auto"), whole
or streamed.

Every accepted call ends with one response or one error: 400 naming the body key (`param`),
404 for another model, 413 for an oversized body, 429 with Retry-After past
`max_concurrent_requests` calls in flight, 503 while the engine is down or the server drains.
A call that loses its client, streamed or not, aborts its requests, which frees their KV
blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxpipe.request.errors import RequestError
from jaxpipe.request.openai import CHAT_URL, COMPLETIONS_URL, Body, body_key, read_body
from jaxpipe.request.outputs import Completion
from jaxpipe.request.tool_calls import ToolCallStream, message
from jaxpipe.request.validate import Limits, prepare
from jaxpipe.serve import messages as m
from jaxpipe.serve import openai_responses as r
from jaxpipe.serve.engine_calls import LoopCall
from jaxpipe.serve.engine_client import EngineClient, EngineUnavailable
from jaxpipe.serve.metrics import ServerMetrics

log = logging.getLogger("jaxpipe.serve")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class ApiError(Exception):
    """An error response: status, message and the body key it is about."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers


class Admission:
    """At most `limit` generation calls in flight. Used from the event loop thread only."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, 0

    def enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1


class EngineStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, failed, or cancelled
    because the client went away (Starlette cancels the stream when it hears the disconnect,
    possibly before the stream's first step, so the hook is on the whole response)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _unless_disconnected(request: Request, work):
    """`await work`, unless the client disconnects first: then the work is cancelled and
    ApiError 499 (nginx's "client closed request"; nobody reads it) is raised."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ApiError(499, "the client closed the connection")
    return task.result()


async def _deltas(call: LoopCall):
    """(prompt index, delta) of a call whose prompts stand or fall together: a request the
    engine refused fails the call (RequestError)."""
    async for index, item in call.items():
        if isinstance(item, m.Rejected):
            raise RequestError("request", item.message)
        yield index, item


def _requests(choices: list[Completion]) -> list:
    """The requests behind the choices (a request's n samples are n choices in a row)."""
    preps, i = [], 0
    while i < len(choices):
        preps.append(choices[i].prep)
        i += choices[i].prep.params.n
    return preps


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class HttpFrontEnd:
    """The routes over one EngineClient; `app` is the ASGI application."""

    def __init__(self, client: EngineClient, tokenizer, model: str, max_request_bytes: int,
                 max_concurrent_requests: int, metrics: ServerMetrics,
                 tool_call_parser: str = "hermes"):
        self.client, self.tokenizer, self.model = client, tokenizer, model
        self.tool_call_parser = tool_call_parser
        self.max_request_bytes, self.metrics = max_request_bytes, metrics
        self.outcomes = metrics.outcomes
        self.admission = Admission(max_concurrent_requests)
        self.draining = False
        self.created = int(time.time())
        self._ids = itertools.count()
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxpipe", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, self._error_response)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)

        async def chat(request: Request):
            return await self.generate(CHAT_URL, request)

        async def completions(request: Request):
            return await self.generate(COMPLETIONS_URL, request)

        app.post(CHAT_URL)(chat)
        app.post(COMPLETIONS_URL)(completions)
        return app

    async def _error_response(self, request: Request, e: ApiError) -> JSONResponse:
        outcome = {400: "invalid", 413: "invalid", 429: "rate_limited", 503: "unavailable"}
        if e.status in outcome:
            self.outcomes.add(outcome[e.status])
        return JSONResponse(r.error_body(e.status, e.message, e.param, e.code),
                            status_code=e.status, headers=e.headers)

    # ---- models, health, metrics --------------------------------------------------------------

    async def models(self) -> dict:
        info = self.client.info
        card = {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "jaxpipe"}
        if info is not None:
            card["max_model_len"] = info.max_model_len
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if self.draining:
            return JSONResponse(r.error_body(503, "the server is draining"), status_code=503)
        if not self.client.serving:
            return JSONResponse(r.error_body(503, self.client.unavailable_reason()),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    def prometheus(self) -> Response:
        """Prometheus text (the same registry as --metrics-port); sync: FastAPI runs it in a
        worker thread, since a scrape waits on the engine's stats answer."""

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- completions --------------------------------------------------------------------------

    async def generate(self, url: str, request: Request) -> Response:
        """Validate, admit, submit; answer whole or as an SSE stream."""
        self._check_serving()
        if not self.admission.enter():
            raise ApiError(429, f"more than max_concurrent_requests="
                           f"{self.admission.limit} calls in flight; retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            body, choices = self._read(url, await self._json(request))
            call = LoopCall(self.client, f"h{next(self._ids)}")
            self._submit(call, choices)
        except BaseException:
            self.admission.leave()
            raise
        rid = ("chatcmpl-" if url == CHAT_URL else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            def close():
                call.abort_unfinished()
                self.admission.leave()

            return EngineStream(self._events(url, rid, body, call, choices), close)
        try:
            return JSONResponse(await _unless_disconnected(
                request, self._whole(url, rid, body, call, choices)))
        finally:
            call.abort_unfinished()
            self.admission.leave()

    def _check_serving(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is draining; send new requests elsewhere")
        if not self.client.serving:
            raise ApiError(503, self.client.unavailable_reason())

    async def _json(self, request: Request):
        data = await request.body()
        if len(data) > self.max_request_bytes:
            raise ApiError(413, f"the request body has {len(data)} bytes; this server's "
                           f"max_request_bytes is {self.max_request_bytes}")
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    def _read(self, url: str, raw) -> tuple[Body, list[Completion]]:
        """The body and one streamed Completion per choice (n per prompt, prompt-major), or
        ApiError 400 / 404."""
        try:
            body = read_body(url, raw)
            if body.model is not None and body.model != self.model:
                raise ApiError(404, f"The model `{body.model}` does not exist; this server "
                               f"serves `{self.model}`", "model", "model_not_found")
            if url == CHAT_URL:  # OpenAI's chat default: as many tokens as the context allows
                body.sampling.setdefault("max_tokens", None)
            info = self.client.info
            if info is None:
                raise ApiError(503, self.client.unavailable_reason())
            limits = Limits(info.max_model_len, info.vocab_size)
            preps = [(prepare(body.kind, p, body.sampling, self.tokenizer, limits,
                              body.template_vars), p) for p in body.prompts]
            return body, [Completion(prep, self.tokenizer, stream=True, echo=self._echo(body, p),
                                     timer=self.metrics.latency.timer("http"))
                          for prep, p in preps for _ in range(prep.params.n)]
        except RequestError as e:
            param = body_key(e.field) or e.field
            raise ApiError(400, f"{param}: {e.message}", param) from None

    def _echo(self, body: Body, prompt) -> str:
        if not body.echo:
            return ""
        if body.kind == "text":
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(list(prompt), False)

    def _submit(self, call: LoopCall, choices: list[Completion]) -> None:
        try:
            call.submit_all(_requests(choices))
        except EngineUnavailable as e:
            raise ApiError(503, str(e)) from None

    async def _whole(self, url: str, rid: str, body: Body, call: LoopCall,
                     choices: list[Completion]) -> dict:
        start = time.perf_counter()
        try:
            async for index, delta in _deltas(call):
                choices[index].add(delta)
        except EngineUnavailable as e:
            raise ApiError(503, str(e)) from None
        except RequestError as e:
            raise ApiError(400, f"{e.field}: {e.message}", e.field) from None
        out = r.envelope(url, rid, self.model, int(time.time()), [
            self._choice(url, body, i, c) for i, c in enumerate(choices)])
        out["usage"] = self._usage(choices)
        self._log_done(url, rid, out["usage"], start)
        return out

    def _choice(self, url: str, body: Body, index: int, c: Completion) -> dict:
        """One choice of a whole response; with tools, the calls its output makes."""
        lp = self._logprobs(url, body, c, c)
        if body.tools is None:
            return r.choice(url, index, c.text, c.finish_reason, lp)
        fields, finish = message(c.text, c.finish_reason, body.tools, self.tool_call_parser)
        return r.choice(url, index, c.text, finish, lp, fields=fields)

    async def _events(self, url: str, rid: str, body: Body, call: LoopCall,
                      choices: list[Completion]):
        """The SSE events of a streamed call: chunks, the usage chunk if asked, [DONE]. An
        engine lost mid-stream ends it with an error event (the status line is long gone)."""
        created, start = int(time.time()), time.perf_counter()
        started: set[int] = set()  # choices with a chunk sent (a chat stream's first has the role)
        tools = None if body.tools is None else [
            ToolCallStream(body.tools, self.tool_call_parser) for _ in choices]
        try:
            async for index, delta in _deltas(call):
                c = choices[index]
                text = c.add(delta)
                lp = self._logprobs(url, body, c, delta, len(c.text) - len(text))
                fields, finish = None, delta.finish_reason
                if tools is not None:
                    fields, finish = tools[index].step(text, finish)
                if (fields if tools else text) or lp or finish is not None \
                        or index not in started:
                    yield sse(r.envelope(url, rid, self.model, created, [r.choice(
                        url, index, text, finish, lp, chunk=True, first=index not in started,
                        fields=fields)], chunk=True))
                    started.add(index)
        except (EngineUnavailable, RequestError) as e:
            status = 503 if isinstance(e, EngineUnavailable) else 400
            self.outcomes.add("unavailable" if status == 503 else "invalid")
            yield sse(r.error_body(status, str(e)))
            yield sse("[DONE]")
            return
        usage = self._usage(choices)
        if body.include_usage:
            last = r.envelope(url, rid, self.model, created, [], chunk=True)
            yield sse({**last, "usage": usage})
        yield sse("[DONE]")
        self._log_done(url, rid, usage, start)

    def _logprobs(self, url: str, body: Body, c: Completion, new, offset: int = 0
                  ) -> dict | None:
        """The logprobs object of `new` (a whole `Completion`, or a delta of `c`'s) at text
        offset `offset`: with echo, the prompt's tokens first when `new` carries them."""
        top = body.top_logprobs or 0
        if not (body.echo and body.top_logprobs is not None and new.prompt_logprobs):
            return r.logprobs(url, new.logprobs or [], top, self.tokenizer, offset)
        prompt = r.echo_logprobs(c.prep.prompt_token_ids, new.prompt_logprobs, self.tokenizer,
                                 offset)
        rest = r.logprobs(url, new.logprobs or [], top, self.tokenizer,
                          offset + len(c.echo_text))
        return r.joined(prompt, rest)

    @staticmethod
    def _usage(choices: list[Completion]) -> dict:
        return r.usage(sum(len(prep.prompt_token_ids) for prep in _requests(choices)),
                       sum(len(c.token_ids) for c in choices))

    @staticmethod
    def _log_done(url: str, rid: str, usage: dict, start: float) -> None:
        log.info("POST %s %s: %d prompt + %d completion tokens, %.2f s", url, rid,
                 usage["prompt_tokens"], usage["completion_tokens"], time.perf_counter() - start)


class HttpServer:
    """uvicorn serving `app` on a daemon thread with its own event loop; signals stay with the
    main thread, which stops it (`stop`: finish in-flight calls, up to `drain_timeout` s)."""

    def __init__(self, app, host: str, port: int, drain_timeout: float):
        # lazy: uvicorn loads only when an HTTP port is served
        import uvicorn

        self.where = f"{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=max(1, round(drain_timeout))))
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn's way out when it cannot bind: `start` reports it
            pass

    def start(self, timeout: float = 30.0) -> int:
        """Listen; returns the bound port, or raises OSError if it cannot."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server could not listen on {self.where} (is the port "
                              "taken? --http-port picks another, --no-http turns HTTP off)")
            time.sleep(0.05)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join()
