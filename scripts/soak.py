#!/usr/bin/env python
"""Soak a jaxpipe server: many concurrent clients over gRPC (streamed, batch, cancelled and
malformed requests) or the OpenAI-compatible HTTP API (streamed, plain, cancelled and malformed)
for as long as asked and at most --max-requests calls, with the engine process killed part-way
through; prints the counts and every breach of "each accepted request ends with exactly one
result or one error", then the RSS series.

  python scripts/soak.py --minutes 30                  # starts its own server (default model)
  python scripts/soak.py --minutes 3 --clients 64 --kill-at 0.3 --json out/soak.json
  python scripts/soak.py --transport http --minutes 3 --clients 32 --json out/http_soak.json
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

from jaxpipe_bench.soak import Soak, SoakConfig  # noqa: E402

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--restart-backoff", "1",
               "--log-level", "WARNING"]


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--transport", choices=["grpc", "http"], default=d.transport,
                   help="what the clients speak (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=d.seconds / 60)
    p.add_argument("--max-requests", type=int, default=100_000,
                   help="calls issued at most, over all clients (default: %(default)s)")
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--kill-at", type=float, default=d.kill_at,
                   help="fraction of the run at which the engine process is killed (-1: never)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log", default="out/soak_server.log")
    p.add_argument("--json", help="write the counts here")
    p.add_argument("server_args", nargs="*", help="more flags for python -m jaxpipe.serve "
                                                  "(after --)")
    args = p.parse_args()
    config = SoakConfig(transport=args.transport, clients=args.clients,
                        seconds=args.minutes * 60, seed=args.seed,
                        kill_at=None if args.kill_at < 0 else args.kill_at,
                        max_requests=args.max_requests)
    log_path = Path(args.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, address, target = start_server(args.transport, args.server_args, log_path)
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
            "transport": args.transport,
            "calls": {f"{k}/{o}": n for (k, o), n in result.calls.items()},
            "items": dict(result.items), "violations": result.violations,
            "killed_at": result.killed_at, "restart_seconds": result.restart_seconds,
            "rss_before": result.rss_before, "rss_after": result.rss_after,
            "front_end_rss": list(result.front_end_rss),
            "seconds": result.seconds,
            "rss_samples": [list(s) for s in result.rss_samples]}, indent=1))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
