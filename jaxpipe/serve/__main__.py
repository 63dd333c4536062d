"""`python -m jaxpipe.serve`: the gRPC and OpenAI-compatible HTTP server. See `--help` and
README "Serving"."""

from __future__ import annotations

import argparse
import logging
import sys

from jaxpipe.engine_flags import add_engine_args, engine_kwargs
from jaxpipe.serve.config import ServerConfig

EPILOG = """\
The front ends (gRPC and the OpenAI-compatible HTTP API, tokenization, detokenization) run in
this process; the engine runs in a child process it starts, and the two talk over ZeroMQ.
Health (grpc.health.v1, and GET /health on the HTTP port) reports NOT_SERVING / 503 until the
model is loaded. SIGTERM / SIGINT drain in-flight requests, then exit.

example:
  python -m jaxpipe.serve --model smollm2-135m --dtype float32 --port 50051 --http-port 8000
"""


def parse_args(argv=None) -> tuple[ServerConfig, str]:
    """Flags -> (ServerConfig, log level)."""
    p = argparse.ArgumentParser(prog="python -m jaxpipe.serve", epilog=EPILOG,
                                description="jaxpipe server: gRPC (service jaxpipe.v1.Generation: "
                                            "Generate, GenerateBatch, GetServerInfo) and the "
                                            "OpenAI-compatible HTTP API",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ServerConfig()
    net = p.add_argument_group("server")
    net.add_argument("--host", default=d.host,
                     help=f"address gRPC listens on (default: {d.host})")
    net.add_argument("--port", type=int, default=d.port,
                     help=f"port gRPC listens on; 0 picks a free one (default: {d.port})")
    net.add_argument("--no-grpc", action="store_true", help="no gRPC front end")
    net.add_argument("--http-host", default=d.http_host,
                     help=f"address the OpenAI-compatible HTTP API listens on "
                          f"(default: {d.http_host})")
    net.add_argument("--http-port", type=int, default=d.http_port,
                     help=f"port of the HTTP API (/v1/chat/completions, /v1/completions, "
                          f"/v1/models, /health, /metrics); 0 picks a free one "
                          f"(default: {d.http_port})")
    net.add_argument("--no-http", action="store_true", help="no HTTP front end")
    net.add_argument("--batch-dir", default=None,
                     help="serve the OpenAI Batch API (/v1/files, /v1/batches) on the HTTP "
                          "port, keeping files and jobs in this directory; unfinished jobs "
                          "found there resume at start (default: off)")
    net.add_argument("--max-file-mb", type=float, default=d.max_file_mb,
                     help=f"largest Batch API upload (default: {d.max_file_mb:g})")
    net.add_argument("--max-message-mb", type=float, default=d.max_message_mb,
                     help="largest gRPC message, e.g. a whole GenerateBatch call; larger ones get "
                          f"RESOURCE_EXHAUSTED (default: {d.max_message_mb:g})")
    net.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help="largest single request or batch item; larger ones get INVALID_ARGUMENT "
                          f"(default: {d.max_request_bytes})")
    net.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                     help="concurrent calls per front end; more get RESOURCE_EXHAUSTED "
                          "(gRPC) or 429 with Retry-After (HTTP) "
                          f"(default: {d.max_concurrent_requests})")
    net.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                     help="seconds in-flight calls get to finish after SIGTERM / SIGINT "
                          f"(default: {d.drain_timeout:g})")
    net.add_argument("--engine-restarts", type=int, default=d.engine_restarts,
                     help="restarts of an engine process that died while serving, in a row; "
                          f"the server exits when they run out (default: {d.engine_restarts})")
    net.add_argument("--restart-backoff", type=float, default=d.restart_backoff,
                     help="seconds before the first restart, doubled for each one in a row "
                          f"(default: {d.restart_backoff:g})")
    net.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port at /metrics (default: off; "
                          "0 picks a free one)")
    net.add_argument("--metrics-host", default=d.metrics_host,
                     help=f"address the metrics endpoint listens on (default: {d.metrics_host})")
    net.add_argument("--log-level", default="INFO",
                     choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="INFO logs one line per request (default: INFO)")
    add_engine_args(p)
    args = p.parse_args(argv)
    try:
        config = ServerConfig(host=args.host, port=None if args.no_grpc else args.port,
                              http_host=args.http_host,
                              http_port=None if args.no_http else args.http_port,
                              max_message_mb=args.max_message_mb,
                              max_request_bytes=args.max_request_bytes,
                              max_concurrent_requests=args.max_concurrent_requests,
                              drain_timeout=args.drain_timeout, metrics_port=args.metrics_port,
                              engine_restarts=args.engine_restarts,
                              restart_backoff=args.restart_backoff,
                              metrics_host=args.metrics_host, batch_dir=args.batch_dir,
                              max_file_mb=args.max_file_mb, engine=engine_kwargs(args, p))
    except ValueError as e:
        p.error(str(e))
    return config, args.log_level


def main(argv=None) -> int:
    config, level = parse_args(argv)
    logging.basicConfig(level=level, format="%(asctime)s serve %(levelname)s %(message)s")
    from jaxpipe import EngineConfig

    if EngineConfig(**config.engine).process_id:  # a follower: no gRPC, the leader's steps
        from jaxpipe import follower

        return follower.run(config.engine, config.engine_restarts, config.restart_backoff)
    from jaxpipe.serve.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
