"""The front-end process: a gRPC server (Generation + grpc.health.v1 + reflection) in front of
an engine process it starts. Health is NOT_SERVING until the engine is loaded, SERVING while it
runs, and NOT_SERVING again if it dies or the server is draining.

SIGTERM / SIGINT: stop accepting calls, let in-flight calls finish (up to drain_timeout), then
shut the engine down and exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxpipe.config import EngineConfig
from jaxpipe.serve import jaxpipe_pb2 as pb
from jaxpipe.serve import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe.serve.config import ServerConfig
from jaxpipe.serve.engine_client import EngineClient, EngineUnavailable
from jaxpipe.serve.service import GenerationService

log = logging.getLogger("jaxpipe.serve")

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
    from jaxpipe.model.loading import load_tokenizer
    from jaxpipe.model.presets import resolve_model

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


def _start_metrics(config: ServerConfig, client: EngineClient, service: GenerationService):
    """The Prometheus endpoint (metrics.py), when asked for; its HTTP server or None."""
    if config.metrics_port is None:
        return None
    from jaxpipe.serve.metrics import SCRAPE_TIMEOUT, serve_metrics

    def engine_stats():
        stats = client.stats(timeout=SCRAPE_TIMEOUT)
        return None if stats is None else stats.engine

    http, port = serve_metrics(config.metrics_port, config.metrics_host, engine_stats,
                               service.outcomes)
    log.info("metrics on http://%s:%d/metrics", config.metrics_host, port)
    return http


def serve(config: ServerConfig) -> int:
    """Run the server until SIGTERM / SIGINT; returns the process exit code."""
    stop = threading.Event()
    _install_signal_handlers(stop)
    health_servicer = health.HealthServicer()
    _set_health(health_servicer, False)
    client = EngineClient(config.engine, on_health=lambda ok: _set_health(health_servicer, ok),
                          max_restarts=config.engine_restarts, backoff=config.restart_backoff)
    try:
        model = config.engine.get("model", EngineConfig.model)
        service = GenerationService(client, _load_tokenizer(model), config.max_request_bytes)
        server, port = _grpc_server(config, service, health_servicer)
        metrics = _start_metrics(config, client, service)
    except BaseException:
        client.close(timeout=5)
        raise
    server.start()
    log.info("listening on %s:%d (health NOT_SERVING until the engine is loaded)",
             config.host, port)
    ok = _wait_for_engine(client, stop)
    while ok and not stop.wait(0.5):
        if client.given_up.is_set():
            log.error("the engine process is gone for good; the server stops")
            break
    health_servicer.enter_graceful_shutdown()  # NOT_SERVING from now on
    server.stop(grace=config.drain_timeout).wait()
    if metrics is not None:
        metrics.shutdown()
    failed = client.given_up.is_set()
    log.info("drained; stopping the engine")
    client.close()
    return 1 if failed else 0
