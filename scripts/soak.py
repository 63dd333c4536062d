#!/usr/bin/env python
"""Soak a jaxpipe server: many concurrent clients over gRPC (streamed, batch, cancelled and
malformed requests) or the OpenAI-compatible HTTP API (streamed, plain, cancelled and malformed)
for as long as asked and at most --max-requests calls, with the engine process killed part-way
through; prints the counts and every breach of "each accepted request ends with exactly one
result or one error", then the RSS series.

  python scripts/soak.py --minutes 30                  # starts its own server (default model)
  python scripts/soak.py --minutes 3 --clients 64 --kill-at 0.3 --json out/soak.json
  python scripts/soak.py --transport http --minutes 3 --clients 32 --json out/http_soak.json
  python scripts/soak.py --minutes 10 --no-kill       # a leak within one engine
Exit code 1 when anything was breached. The logic lives in `jaxpipe_bench.soak`.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench.soak import Soak, SoakConfig  # noqa: E402

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--restart-backoff", "1",
               "--log-level", "WARNING"]
MAX_REQUESTS = 100_000  # this script's cap on calls (--max-requests); SoakConfig's is none


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(transport: str, extra: list[str],
                 log_path: Path) -> tuple[subprocess.Popen, str, str]:
    """The server on free loopback ports: (process, gRPC address, soak target). A gRPC soak
    still gets an HTTP port (0: a free one, never the default 8000)."""
    port, http_port = free_port(), (free_port() if transport == "http" else 0)
    log = open(log_path, "wb")  # noqa: SIM115 (the server's lifetime)
    proc = subprocess.Popen([sys.executable, "-m", "jaxpipe.serve", "--port", str(port),
                             "--http-port", str(http_port), *SERVER_ARGS, *extra], stdout=log,
                            stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    return proc, address, (f"http://127.0.0.1:{http_port}" if transport == "http" else address)


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end and proc.poll() is None:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"the server at {address} did not become SERVING")


def parse(argv=None) -> tuple[SoakConfig, argparse.Namespace]:
    """The soak's config and the script's own flags (--minutes, --log, --json, server_args)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=SoakConfig.seconds / 60,
                   help="how long the clients issue calls (default: %(default)g)")
    p.add_argument("--log", default="out/soak_server.log", help="the server's output")
    p.add_argument("--json", help="write the counts here")
    p.add_argument("server_args", nargs="*", help="more flags for python -m jaxpipe.serve "
                                                  "(after --)")
    add_flags(p, SoakConfig, group="soak", skip=("seconds",))
    p.set_defaults(max_requests=MAX_REQUESTS)
    args = p.parse_args(argv)
    if getattr(args, "kill_at", None) is not None and args.kill_at < 0:
        args.kill_at = None  # --kill-at -1: the older spelling of --no-kill
    return config_from_args(SoakConfig, args, p, seconds=args.minutes * 60), args


def main() -> int:
    config, args = parse()
    log_path = Path(args.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, address, target = start_server(config.transport, args.server_args, log_path)
    try:
        wait_serving(address, proc)
        print(f"soaking {target} with {config.clients} clients for {args.minutes:g} min "
              f"(at most {config.max_requests} calls)", flush=True)
        result = Soak(target, proc.pid, config).run()
    finally:
        proc.terminate()
        proc.wait(120)
    print(result.table())
    print(result.rss_series())
    if args.json:
        Path(args.json).write_text(json.dumps({
            "transport": config.transport,
            "calls": {f"{k}/{o}": n for (k, o), n in result.calls.items()},
            "items": dict(result.items), "violations": result.violations,
            "killed_at": result.killed_at, "restart_seconds": result.restart_seconds,
            "rss_before": result.rss_before, "rss_after": result.rss_after,
            "front_end_rss": list(result.front_end_rss),
            "seconds": result.seconds, "prefix_cache": result.prefix_cache,
            "rss_samples": [list(s) for s in result.rss_samples]}, indent=1))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
