"""`python -m jaxpipe.serve`: the gRPC and OpenAI-compatible HTTP server. See `--help` and
README "Serving"."""

from __future__ import annotations

import argparse
import logging
import sys

from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.flags import add_flags, config_from_args, config_kwargs
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
    add_flags(p, ServerConfig, group="server", skip=("engine",))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="INFO logs one line per request (default: INFO)")
    add_flags(p, EngineConfig, group="engine")
    args = p.parse_args(argv)
    config_from_args(EngineConfig, args, p)  # its refusals are usage errors here, not later
    config = config_from_args(ServerConfig, args, p, engine=config_kwargs(EngineConfig, args))
    return config, args.log_level


def main(argv=None) -> int:
    config, level = parse_args(argv)
    logging.basicConfig(level=level, format="%(asctime)s serve %(levelname)s %(message)s")
    if EngineConfig(**config.engine).process_id:  # a follower: no gRPC, the leader's steps
        # lazy: a follower process (--process-id) needs none of the server
        from jaxpipe.process import follower

        return follower.run(config.engine, config.engine_restarts, config.restart_backoff)
    # lazy: --help and bad arguments answer without loading the server
    from jaxpipe.serve.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
