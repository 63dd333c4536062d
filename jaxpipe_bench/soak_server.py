"""scripts/soak.py's side of a soak: its command line (`SoakCommand` beside `SoakConfig`), the
server it starts on free loopback ports (`python -m jaxpipe.serve`), the wait until that
server is SERVING, and the result's JSON.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jaxpipe.config.flags import add_flags, config_from_args
from jaxpipe_bench.soak import Soak, SoakConfig, SoakResult

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--restart-backoff", "1",
               "--log-level", "WARNING"]
MAX_REQUESTS = 100_000  # scripts/soak.py's cap on calls (--max-requests); SoakConfig's is none


@dataclass(frozen=True)
class SoakCommand:
    """scripts/soak.py's own arguments, beside SoakConfig's flags (jaxpipe.config.flags).

    minutes: how long the clients issue calls (SoakConfig.seconds, in minutes)
    log: the server's output
    json_path: write the counts here (none: only the tables)
    server_args: more flags for python -m jaxpipe.serve (after --)
    """

    minutes: float = SoakConfig.seconds / 60
    log: str = "out/soak_server.log"
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})
    server_args: tuple[str, ...] = field(default=(), metadata={"positional": True})

    def __post_init__(self):
        if not self.minutes > 0:
            raise ValueError(f"SoakCommand.minutes must be > 0, got {self.minutes!r}")


def parse(doc: str, argv: list[str] | None = None) -> tuple[SoakConfig, SoakCommand]:
    """The soak's config and the script's own arguments; `--kill-at -1`, the older spelling
    of `--no-kill`, is taken as it."""
    from jaxpipe_bench.cli import parser

    p = parser(doc)
    add_flags(p, SoakCommand, group="command")
    add_flags(p, SoakConfig, group="soak", skip=("seconds",),
              defaults={"max_requests": MAX_REQUESTS})
    args = p.parse_args(argv)
    if getattr(args, "kill_at", None) is not None and args.kill_at < 0:
        args.kill_at = None
    command = config_from_args(SoakCommand, args, p)
    return config_from_args(SoakConfig, args, p, seconds=command.minutes * 60), command


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(transport: str, extra: list[str] | tuple[str, ...],
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
    """Return once the server at `address` reports SERVING; exit if it dies or takes longer
    than `timeout` seconds."""
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


def run(config: SoakConfig, command: SoakCommand) -> SoakResult:
    """Start the server, soak it, stop it; print the tables and write the JSON as asked."""
    log_path = Path(command.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc, address, target = start_server(config.transport, command.server_args, log_path)
    try:
        wait_serving(address, proc)
        print(f"soaking {target} with {config.clients} clients for {command.minutes:g} min "
              f"(at most {config.max_requests} calls)", flush=True)
        result = Soak(target, proc.pid, config).run()
    finally:
        proc.terminate()
        proc.wait(120)
    print(result.table())
    print(result.rss_series())
    if command.json_path:
        Path(command.json_path).write_text(json.dumps(record(config, result), indent=1))
    return result


def record(config: SoakConfig, result: SoakResult) -> dict:
    """The result as JSON-able data."""
    return {"transport": config.transport,
            "calls": {f"{k}/{o}": n for (k, o), n in result.calls.items()},
            "items": dict(result.items), "violations": result.violations,
            "killed_at": result.killed_at, "restart_seconds": result.restart_seconds,
            "rss_before": result.rss_before, "rss_after": result.rss_after,
            "front_end_rss": list(result.front_end_rss),
            "seconds": result.seconds, "prefix_cache": result.prefix_cache,
            "first_restart_seconds": result.first_restart_seconds,
            "programs": list(result.programs),
            "rss_samples": [list(s) for s in result.rss_samples]}
