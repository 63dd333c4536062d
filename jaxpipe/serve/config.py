"""`ServerConfig`: how the gRPC and HTTP front ends listen and what they accept. Validated
once."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpipe.request.tool_parsers import TOOL_PARSERS


@dataclass
class ServerConfig:
    """Front-end settings; `engine` holds the EngineConfig fields for the engine process. Each
    entry below is also its flag's help (jaxpipe.config.flags). At least one front end is on.

    host: address gRPC listens on.
    port: port gRPC listens on; 0 picks a free one, None (--no-grpc) runs no gRPC front end.
    http_host: address the OpenAI-compatible HTTP API listens on.
    http_port: port of the HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
        /health, /metrics); 0 picks a free one, None (--no-http) runs no HTTP front end.
    max_message_mb: largest gRPC message (a whole GenerateBatch call), in MiB; a larger one is
        refused by gRPC itself with RESOURCE_EXHAUSTED.
    max_request_bytes: largest single request (a Generate request or one batch item); a larger
        one gets INVALID_ARGUMENT and the rest of its batch still runs.
    max_concurrent_requests: concurrent calls per front end; more are refused (gRPC:
        RESOURCE_EXHAUSTED, HTTP: 429 with Retry-After).
    drain_timeout: seconds in-flight calls get to finish after SIGTERM / SIGINT.
    engine_restarts: restarts of an engine process that died after it had served, in a row
        (an engine up for a minute resets the count); the server exits when they run out.
    restart_backoff: seconds before the first engine restart, doubled for each one in a row.
    metrics_port: serve Prometheus metrics at http://metrics_host:metrics_port/metrics (None:
        off; 0 picks a free port).
    metrics_host: address the metrics endpoint listens on.
    batch_dir: serve the OpenAI Batch API (/v1/files, /v1/batches) on the HTTP port, keeping
        its files and jobs in this directory (None: no Batch API); jobs found there unfinished
        resume at start.
    max_file_mb: the largest Batch API upload, in MiB.
    tool_call_parser: how a chat answer with tool_choice "auto" is read for tool calls: the
        model's own call format, "hermes" (Hermes / Qwen `<tool_call>` JSON) or
        "llama3_json" (Llama 3's JSON form).
    engine: EngineConfig fields (its defaults apply); their flags are EngineConfig's.
    """

    host: str = "127.0.0.1"
    port: int | None = field(default=50051, metadata={"none_flag": "--no-grpc"})
    http_host: str = "127.0.0.1"
    http_port: int | None = field(default=8000, metadata={"none_flag": "--no-http"})
    max_message_mb: float = 64.0
    max_request_bytes: int = 1 << 20
    max_concurrent_requests: int = 256
    drain_timeout: float = 600.0
    engine_restarts: int = 5
    restart_backoff: float = 1.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    batch_dir: str | None = None
    max_file_mb: float = 512.0
    tool_call_parser: str = "hermes"
    engine: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServerConfig.host must be a host name or address, got {self.host!r}")
        if not isinstance(self.http_host, str) or not self.http_host:
            raise ValueError("ServerConfig.http_host must be a host name or address, got "
                             f"{self.http_host!r}")
        if self.port is None and self.http_port is None:
            raise ValueError("ServerConfig: port and http_port are both None; turn at least "
                             "one front end (gRPC or HTTP) on")
        for name in ("port", "http_port"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, 65535)
        _check_int("max_request_bytes", self.max_request_bytes, 1, 1 << 31)
        _check_int("max_concurrent_requests", self.max_concurrent_requests, 1, 100_000)
        _check_number("max_message_mb", self.max_message_mb, 2047)
        _check_number("drain_timeout", self.drain_timeout, 1e9)
        _check_int("engine_restarts", self.engine_restarts, 0, 1000)
        _check_number("restart_backoff", self.restart_backoff, 3600)
        _check_number("max_file_mb", self.max_file_mb, 1 << 20)
        if self.batch_dir is not None and self.http_port is None:
            raise ValueError("ServerConfig.batch_dir needs the HTTP front end (http_port)")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"ServerConfig.tool_call_parser must be one of "
                             f"{', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, 0, 65535)
        if self.max_request_bytes > self.max_message_bytes:
            raise ValueError(f"ServerConfig.max_request_bytes ({self.max_request_bytes}) must not "
                             f"exceed max_message_mb ({self.max_message_mb} MiB)")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 2**20)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"ServerConfig.{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _check_number(name: str, value, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= hi:
        raise ValueError(f"ServerConfig.{name} must be a number in (0, {hi}], got {value!r}")
