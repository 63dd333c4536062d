"""Soak: many concurrent gRPC clients against one `python -m jaxpipe.serve`, a mix of streamed,
batch, cancelled and malformed requests, and the engine process killed part-way through.

What must hold (`SoakResult.violations` lists every breach): each call ends exactly once, with
a result (a stream's one final message, a batch's one result per item) or one error of the
kind its request earns (UNAVAILABLE while the engine is down, INVALID_ARGUMENT for a malformed
request, CANCELLED for one the client cancelled); no call hangs (each has a deadline); the
server serves again after the kill; and its RSS (front end + engine) once the restarted engine
has served a while is within `rss_tolerance` of its RSS just before the kill. RSS is sampled
every second; "before" is the median over the `rss_window` seconds that end at the kill, "after"
the median over the run's last `rss_window` seconds, counting only samples taken at least
`settle` seconds after the engine serves again (too few such samples is a breach: the run was
too short for its restart). The windows compare two warm engines at the same stage: an engine
that still compiles, or a restarted one still loading, is not at its working size, and a
busy engine's RSS swings by 15% within seconds as XLA allocates and frees step buffers (one
sample each side made a leak of nothing fail; so did a "before" window taken while the first
engine still compiled its shapes, 1.92 -> 2.23 GiB). With no kill, "before" starts at
`warmup_at` of the run.
Entry points: `scripts/soak.py`, tests/bench/test_soak.py.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpipe.serve import jaxpipe_pb2 as pb
from jaxpipe.serve import jaxpipe_pb2_grpc as pb_grpc

KINDS = ("stream", "batch", "cancel", "malformed")
CALL_DEADLINE = 180.0  # seconds; a call that takes longer is a hang
UNAVAILABLE_PAUSE = 0.25  # seconds a client waits after UNAVAILABLE


@dataclass
class SoakConfig:
    clients: int = 64
    seconds: float = 180.0  # CI's soak; scripts/soak.py --minutes sets it
    kill_at: float | None = 0.4  # fraction of `seconds` at which the engine is killed (None: no)
    warmup_at: float = 0.2  # with no kill: fraction of `seconds` where the "before" RSS starts
    rss_window: float = 0.2  # fraction of `seconds` over which each side's median RSS is taken
    settle: float = 10.0  # seconds after the restart before an "after" RSS sample counts
    min_samples: int = 5  # RSS samples each side needs (one a second)
    max_tokens: tuple[int, int] = (2, 12)
    seed: int = 0
    rss_tolerance: float = 0.10


@dataclass
class SoakResult:
    calls: Counter = field(default_factory=Counter)  # (kind, outcome) -> calls
    items: Counter = field(default_factory=Counter)  # batch items by outcome
    violations: list[str] = field(default_factory=list)
    killed_at: float | None = None
    restart_seconds: float | None = None
    rss_before: int = 0  # front end + engine, median over the warm window before the kill
    rss_after: int = 0  # the same over the run's last window
    front_end_rss: tuple[int, int] = (0, 0)  # the front end's part of both (it outlives kills)
    serves_after: bool = False
    seconds: float = 0.0
    rss_samples: list = field(default_factory=list)  # (seconds into the run, front end, total)

    def table(self) -> str:
        rows = [f"{'kind':<10}{'outcome':<14}{'calls':>8}"]
        rows += [f"{k:<10}{o:<14}{n:>8}" for (k, o), n in sorted(self.calls.items())]
        rows += [f"{'batch item':<10}{o:<14}{n:>8}" for o, n in sorted(self.items.items())]
        gib = [x / 2**30 for x in (self.rss_before, self.rss_after, *self.front_end_rss)]
        rows.append(f"{self.seconds:.0f} s; engine killed at {_fmt(self.killed_at)} s, serving "
                    f"again {_fmt(self.restart_seconds)} s later; RSS {gib[0]:.2f} -> {gib[1]:.2f}"
                    f" GiB (front end {gib[2]:.2f} -> {gib[3]:.2f}); serves after: "
                    f"{self.serves_after}; violations: {len(self.violations)}")
        return "\n".join(rows + self.violations[:20])

    def rss_series(self, every: float = 10.0) -> str:
        """The total RSS one sample per `every` seconds: where a breach of the RSS bound came
        from (a level after the restart, or a climb)."""
        shown, next_at = [], 0.0
        for t, _, total in self.rss_samples:
            if t >= next_at:
                shown.append(f"{t:.0f}s {total / 2**30:.2f}")
                next_at = t + every
        return "RSS GiB: " + ", ".join(shown)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


class Soak:
    """One soak run against the server at `address` whose front end has pid `server_pid`."""

    def __init__(self, address: str, server_pid: int, config: SoakConfig):
        self.address, self.server_pid, self.config = address, server_pid, config
        self.result = SoakResult()
        self._lock = threading.Lock()
        self._ids = iter(range(1 << 62))

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> SoakResult:
        cfg, res = self.config, self.result
        start = time.monotonic()
        stop_at = start + cfg.seconds
        threads = [threading.Thread(target=self._client, args=(i, stop_at), daemon=True)
                   for i in range(cfg.clients)]
        samples = res.rss_samples
        done = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(start, samples, done),
                                   daemon=True)
        for t in [*threads, sampler]:
            t.start()
        if cfg.kill_at is not None:
            self._kill_and_wait(start + cfg.kill_at * cfg.seconds, start)
        for t in threads:
            t.join(timeout=max(stop_at - time.monotonic(), 0) + CALL_DEADLINE + 30)
            if t.is_alive():
                self._violation(f"client thread {t.name} still running after its deadline")
        res.seconds = time.monotonic() - start
        done.set()
        sampler.join()
        res.serves_after = self._serves()
        if not res.serves_after:
            self._violation("the server does not serve after the run")
        self._compare_rss(samples)
        return res

    def _sample_rss(self, start: float, samples: list, done: threading.Event) -> None:
        import psutil

        while not done.wait(1.0):
            try:
                front, total = self.rss()
            except psutil.NoSuchProcess:  # the front end is gone: the run reports it
                return
            samples.append((time.monotonic() - start, front, total))

    def _compare_rss(self, samples: list[tuple[float, int, int]]) -> None:
        cfg, res = self.config, self.result
        window = cfg.rss_window * cfg.seconds
        end = res.killed_at if res.killed_at is not None else cfg.warmup_at * cfg.seconds + window
        before = [s for s in samples if end - window <= s[0] < end]
        serving = (res.killed_at or 0.0) + (res.restart_seconds or 0.0) + cfg.settle
        after = [s for s in samples if s[0] >= max(cfg.seconds - window, serving)]
        if len(before) < cfg.min_samples or len(after) < cfg.min_samples:
            self._violation(f"too few RSS samples to compare ({len(before)} before {end:.0f} s, "
                            f"{len(after)} after {serving:.0f} s of {cfg.seconds:.0f}): "
                            "run longer")
            return
        res.rss_before, res.rss_after = (int(statistics.median(s[2] for s in side))
                                         for side in (before, after))
        res.front_end_rss = tuple(int(statistics.median(s[1] for s in side))
                                  for side in (before, after))
        if res.rss_after > res.rss_before * (1 + cfg.rss_tolerance):
            self._violation(f"RSS grew from {res.rss_before:,} to {res.rss_after:,} bytes "
                            f"(> {cfg.rss_tolerance:.0%})")

    def rss(self) -> tuple[int, int]:
        """RSS of the front end, and of it with its children (the engine process), bytes."""
        import psutil

        proc = psutil.Process(self.server_pid)
        front = proc.memory_info().rss
        children = 0
        for child in proc.children(recursive=True):
            try:
                children += child.memory_info().rss
            except psutil.NoSuchProcess:  # the engine, killed or restarting
                pass
        return front, front + children

    def _kill_and_wait(self, when: float, start: float) -> None:
        time.sleep(max(when - time.monotonic(), 0))
        with grpc.insecure_channel(self.address) as ch:
            pid = pb_grpc.GenerationStub(ch).GetServerInfo(pb.ServerInfoRequest(),
                                                           timeout=30).engine_pid
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            self.result.killed_at = killed - start
            health = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() - killed < 300:
                time.sleep(0.5)
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                except grpc.RpcError:
                    continue
                if status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - \
                        killed > 1:
                    self.result.restart_seconds = time.monotonic() - killed
                    return
        self._violation("the engine was not serving again 300 s after the kill")

    def _serves(self) -> bool:
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            try:
                out = list(stub.Generate(pb.GenerateRequest(
                    text="Say hi.", sampling=pb.SamplingParams(temperature=0.0, max_tokens=2)),
                    timeout=CALL_DEADLINE))
            except grpc.RpcError:
                return False
        return bool(out) and bool(out[-1].finish_reason)

    # ---- one client ---------------------------------------------------------------------------

    def _client(self, index: int, stop_at: float) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while time.monotonic() < stop_at:
                kind = rng.choice(KINDS)
                try:
                    outcome = getattr(self, f"_{kind}")(stub, rng)
                except Exception as e:  # a client bug is a violation too, not a silent stop
                    self._violation(f"{kind}: unexpected {type(e).__name__}: {e}")
                    outcome = "crashed"
                with self._lock:
                    self.result.calls[(kind, outcome)] += 1
                if outcome == "unavailable":
                    time.sleep(UNAVAILABLE_PAUSE)  # as a client would, before retrying

    def _sampling(self, rng: random.Random) -> pb.SamplingParams:
        lo, hi = self.config.max_tokens
        return pb.SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(lo, hi),
                                 seed=rng.randrange(1 << 30))

    def _prompt(self, rng: random.Random) -> str:
        return f"Request {next(self._ids)}: tell me about the number {rng.randrange(1000)}."

    def _stream(self, stub, rng) -> str:
        call = stub.Generate(pb.GenerateRequest(text=self._prompt(rng),
                                                sampling=self._sampling(rng)),
                             timeout=CALL_DEADLINE)
        finals = 0
        try:
            for resp in call:
                if finals:
                    self._violation("stream: a message after the final one")
                finals += bool(resp.finish_reason)
        except grpc.RpcError as e:
            return self._error("stream", e, (grpc.StatusCode.UNAVAILABLE,), finals)
        if finals != 1:
            self._violation(f"stream: ended with {finals} final messages")
        return "ok"

    def _cancel(self, stub, rng) -> str:
        sampling = self._sampling(rng)
        sampling.max_tokens = 64
        call = stub.Generate(pb.GenerateRequest(text=self._prompt(rng), sampling=sampling),
                             timeout=CALL_DEADLINE)
        try:
            first = next(call)
            if first.finish_reason:
                return "finished"
            call.cancel()
            for _ in call:
                pass
        except grpc.RpcError as e:
            return self._error("cancel", e, (grpc.StatusCode.CANCELLED,
                                             grpc.StatusCode.UNAVAILABLE), 0)
        except StopIteration:
            self._violation("cancel: a stream with no message")
            return "empty"
        return "finished"  # it ended before the cancel reached it

    def _malformed(self, stub, rng) -> str:
        bad = rng.choice([pb.SamplingParams(temperature=-1.0),
                          pb.SamplingParams(max_tokens=10**9), pb.SamplingParams(top_p=2.0)])
        try:
            for _ in stub.Generate(pb.GenerateRequest(text=self._prompt(rng), sampling=bad),
                                   timeout=CALL_DEADLINE):
                pass
        except grpc.RpcError as e:
            return self._error("malformed", e, (grpc.StatusCode.INVALID_ARGUMENT,
                                                grpc.StatusCode.UNAVAILABLE), 0)
        self._violation(f"malformed: {bad} was accepted")
        return "accepted"

    def _batch(self, stub, rng) -> str:
        n = rng.randint(2, 4)
        bad = rng.randrange(n) if rng.random() < 0.5 else None
        items = [pb.BatchItem(custom_id=f"c{i}", text=self._prompt(rng),
                              sampling=(pb.SamplingParams(temperature=-1.0) if i == bad
                                        else self._sampling(rng))) for i in range(n)]
        seen: Counter = Counter()
        try:
            for result in stub.GenerateBatch(pb.BatchRequest(items=items), timeout=CALL_DEADLINE):
                seen[result.custom_id] += 1
                is_error = result.WhichOneof("result") == "error"
                want_error = result.custom_id == f"c{bad}"
                if is_error != want_error or (is_error and
                                              result.error.code != "INVALID_ARGUMENT"):
                    self._violation(f"batch: item {result.custom_id} got {result}")
                self._count_item("invalid" if is_error else "ok")
        except grpc.RpcError as e:
            for item in items:
                if not seen[item.custom_id]:
                    self._count_item("unavailable")
            return self._error("batch", e, (grpc.StatusCode.UNAVAILABLE,), 0)
        finally:
            for cid, count in seen.items():
                if count != 1:
                    self._violation(f"batch: {count} results for {cid}")
        missing = [i.custom_id for i in items if not seen[i.custom_id]]
        if missing:
            self._violation(f"batch: no result for {missing}")
        return "ok"

    # ---- accounting -----------------------------------------------------------------------------

    def _error(self, kind: str, error: grpc.RpcError, allowed, finals: int) -> str:
        code = error.code()
        if code not in allowed:
            self._violation(f"{kind}: {code.name}: {error.details()}")
        if finals:
            self._violation(f"{kind}: an error after the final message")
        return code.name.lower()

    def _count_item(self, outcome: str) -> None:
        with self._lock:
            self.result.items[outcome] += 1

    def _violation(self, text: str) -> None:
        with self._lock:
            self.result.violations.append(text)
