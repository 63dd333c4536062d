"""The soak (jaxpipe/bench/soak.py) in CI: 64 concurrent gRPC clients for about two minutes,
a mix of streamed, batch, cancelled and malformed requests, the engine process killed 40% of
the way in. Every accepted request ends with exactly one result or one error, the server serves
again after the restart, and its RSS at the end of the run is within 10% of its RSS when warm
(medians of per-second samples: a busy engine's RSS swings 15% within seconds)."""

from __future__ import annotations

from conftest import ServerProcess, gguf_dir

from jaxpipe.bench.soak import Soak, SoakConfig


def test_soak_with_an_engine_kill(tmp_path):
    gguf_dir()
    server = ServerProcess("--restart-backoff", "1", "--max-num-seqs", "32",
                           log_path=tmp_path / "server.log")
    try:
        server.wait_serving()
        result = Soak(server.address, server.proc.pid,
                      SoakConfig(clients=64, seconds=120)).run()
        print(result.table())
        assert not result.violations, result.table() + "\n" + server.log()
        assert result.killed_at is not None and result.restart_seconds is not None
        assert result.serves_after
        ok = {kind: result.calls[(kind, "ok")] for kind in ("stream", "batch")}
        assert all(n > 0 for n in ok.values()), result.table()
        assert result.calls[("malformed", "invalid_argument")] > 0
        assert result.calls[("cancel", "cancelled")] > 0
        assert sum(n for (_, outcome), n in result.calls.items() if outcome == "unavailable") > 0
    finally:
        server.stop()
