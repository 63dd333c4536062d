"""The front-end process: a gRPC server (Generation + grpc.health.v1 + reflection) and the
OpenAI-compatible HTTP API (http.py), either of which can be off, in front of an engine process
it starts. Health is NOT_SERVING (HTTP: /health 503) until the engine is loaded, SERVING while
it runs, and NOT_SERVING again if it dies or the server is draining.

SIGTERM / SIGINT: stop accepting calls, let in-flight calls finish (up to drain_timeout), then
shut the engine down and exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxpipe.config.engine import EngineConfig
from jaxpipe.model.loading import load_tokenizer
from jaxpipe.model.presets import resolve_model
from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe.serve.batch_runner import ClientRunner
from jaxpipe.serve.batches import Batches, FileStore
from jaxpipe.serve.config import ServerConfig
from jaxpipe.serve.engine_client import EngineClient, EngineUnavailable
from jaxpipe.serve.http import HttpFrontEnd, HttpServer
from jaxpipe.serve.http_batches import BatchRoutes
from jaxpipe.serve.metrics import SCRAPE_TIMEOUT, ServerMetrics, serve_metrics
from jaxpipe.serve.service import GenerationService

log = logging.getLogger("jaxpipe.serve")

BATCH_IN_FLIGHT = 64  # requests a Batch API job keeps in the engine (beside live traffic)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxpipe.v1.Generation"


def _set_health(servicer: health.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        servicer.set(name, status)


def _grpc_server(config: ServerConfig, service: GenerationService,
                 health_servicer: health.HealthServicer) -> tuple[grpc.Server, int]:
    limit = config.max_message_bytes
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_concurrent_requests + 4),
        maximum_concurrent_rpcs=config.max_concurrent_requests,
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", limit)])
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(config.address)
    if port == 0:
        raise OSError(f"could not listen on {config.address}")
    return server, port


def _load_tokenizer(model: str):

    return load_tokenizer(resolve_model(model))


def _install_signal_handlers(stop: threading.Event) -> None:
    def handler(signum, frame):
        if stop.is_set():
            log.warning("second %s: still draining", signal.Signals(signum).name)
        log.info("%s received: draining in-flight requests", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _wait_for_engine(client: EngineClient, stop: threading.Event) -> bool:
    """True once the engine is ready; False if it died or we were told to stop first."""
    while not stop.is_set():
        try:
            client.wait_ready(timeout=0.5)
            return True
        except EngineUnavailable:
            if client.dead.is_set():
                log.error("the engine process exited with code %s while starting",
                          client.proc.returncode)
                return False
    return False


def _metrics(client: EngineClient) -> ServerMetrics:
    """What /metrics renders (metrics.py), on either endpoint."""

    def engine_stats():
        stats = client.stats(timeout=SCRAPE_TIMEOUT)
        return None if stats is None else stats.engine

    return ServerMetrics(engine_stats)


def _start_metrics(config: ServerConfig, registry) -> object | None:
    """The separate Prometheus endpoint, when asked for; its HTTP server or None."""
    if config.metrics_port is None:
        return None

    http, port = serve_metrics(config.metrics_port, config.metrics_host, registry)
    log.info("metrics on http://%s:%d/metrics", config.metrics_host, port)
    return http


@dataclass
class _FrontEnds:
    """What serves clients: gRPC and / or HTTP (None when turned off), and /metrics."""

    grpc: grpc.Server | None = None
    http_front: HttpFrontEnd | None = None
    http: HttpServer | None = None
    metrics: object = None

    def drain(self, timeout: float) -> None:
        """Refuse new calls and let in-flight ones finish (both front ends at once)."""
        if self.http_front is not None:
            self.http_front.draining = True
        grpc_stopped = None if self.grpc is None else self.grpc.stop(grace=timeout)
        if self.http is not None:
            self.http.stop()
        if grpc_stopped is not None:
            grpc_stopped.wait()
        if self.metrics is not None:
            self.metrics.shutdown()


def _add_batch_api(config: ServerConfig, front: HttpFrontEnd, stop: threading.Event) -> None:
    """The Batch API's routes and jobs (batches.py), resuming the jobs left unfinished."""

    client = front.client

    def runner(prefix: str) -> ClientRunner:
        return ClientRunner(client, front.tokenizer, front.model, prefix, BATCH_IN_FLIGHT)

    def wait_engine() -> bool:
        while not stop.wait(0.5):
            if client.serving:
                return True
            if client.given_up.is_set():
                return False
        return False

    files = FileStore(config.batch_dir)
    batches = Batches(config.batch_dir, files, runner, wait_engine, config.max_request_bytes,
                      config.tool_call_parser)
    BatchRoutes(files, batches, int(config.max_file_mb * 2**20)).add_to(front.app)
    batches.resume()
    log.info("Batch API on (files and jobs in %s)", config.batch_dir)


def _start_front_ends(config: ServerConfig, client: EngineClient,
                      health_servicer: health.HealthServicer,
                      stop: threading.Event) -> _FrontEnds:
    model = config.engine.get("model", EngineConfig.model)
    tokenizer, metrics = _load_tokenizer(model), _metrics(client)
    fronts = _FrontEnds()
    try:
        if config.port is not None:
            service = GenerationService(client, tokenizer, config.max_request_bytes, metrics)
            fronts.grpc, port = _grpc_server(config, service, health_servicer)
            fronts.grpc.start()
            log.info("gRPC on %s:%d (health NOT_SERVING until the engine is loaded)",
                     config.host, port)
        if config.http_port is not None:
            fronts.http_front = HttpFrontEnd(client, tokenizer, model, config.max_request_bytes,
                                             config.max_concurrent_requests, metrics,
                                             config.tool_call_parser)
            if config.batch_dir is not None:
                _add_batch_api(config, fronts.http_front, stop)
            fronts.http = HttpServer(fronts.http_front.app, config.http_host, config.http_port,
                                     config.drain_timeout)
            port = fronts.http.start()
            log.info("HTTP (OpenAI API) on http://%s:%d/v1", config.http_host, port)
        fronts.metrics = _start_metrics(config, metrics.registry)
    except BaseException:
        fronts.drain(timeout=0)
        raise
    return fronts


def serve(config: ServerConfig) -> int:
    """Run the server until SIGTERM / SIGINT; returns the process exit code."""
    stop = threading.Event()
    _install_signal_handlers(stop)
    health_servicer = health.HealthServicer()
    _set_health(health_servicer, False)
    client = EngineClient(config.engine, on_health=lambda ok: _set_health(health_servicer, ok),
                          max_restarts=config.engine_restarts, backoff=config.restart_backoff)
    try:
        fronts = _start_front_ends(config, client, health_servicer, stop)
    except BaseException:
        client.close(timeout=5)
        raise
    ok = _wait_for_engine(client, stop)
    while ok and not stop.wait(0.5):
        if client.given_up.is_set():
            log.error("the engine process is gone for good; the server stops")
            break
    health_servicer.enter_graceful_shutdown()  # NOT_SERVING from now on
    fronts.drain(config.drain_timeout)
    failed = client.given_up.is_set()
    log.info("drained; stopping the engine")
    client.close()
    return 1 if failed else 0
