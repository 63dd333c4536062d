"""Soak: many concurrent clients against one `python -m jaxpipe.serve`, a mix of streamed,
plain, batch, cancelled and malformed requests, and the engine process killed part-way through.

The clients speak one transport (`SoakConfig.transport`): gRPC (`soak_grpc.GrpcCalls`: streamed,
batch, cancelled and malformed `Generate` / `GenerateBatch` calls) or the OpenAI-compatible HTTP
API (`soak_http.HttpCalls`: streamed, plain, cancelled and malformed completions). This module
holds what the transports share: the client threads and their deadline and request cap, the
exactly-once accounting (`Tally`), the engine kill and the wait for the restart, the RSS
sampler and its comparison, and the result's table.

What must hold (`SoakResult.violations` lists every breach): each call ends exactly once, with
a result (a stream's one final message, a batch's one result per item) or one error of the
kind its request earns (unavailable while the engine is down, invalid_argument for a malformed
request, cancelled for one the client cancelled, rate_limited past the server's concurrency
limit); no call hangs (each has a deadline); once the run is over the engine holds no request
(`Calls.engine_load` all zero within `IDLE_WAIT` s: a cancelled request's KV blocks are freed);
the server serves again after the kill; and RSS stays flat.

RSS is sampled every second, front end and engine. "Before" is the 90th percentile over the
`rss_window` seconds that end at the kill, "after" the same over the run's last `rss_window`
seconds, counting only samples taken at least `settle` seconds after the engine serves again
(a restart so slow that less than `rss_window` of the run would be left after it settles
extends the run, its clients still calling, until that much is; too few samples is then a
breach). The front end
lives through the run, and its RSS must stay within `rss_tolerance`; so must the total when no
engine was killed.
Across a kill the engine is a new process, and the two engines compared are made alike: a
soak that kills the engine first restarts it once before its clients start, and compares
that engine with the one after the kill. Both load their programs from JAX's persistent
compilation cache, where the server's first engine, on a cold cache, compiled them, and the
two ways differ in memory (`jaxpipe.serve.programs`): an engine built from the cache holds
each program's HLO besides (127 MB of heap for SmolLM2's 42 programs), one that compiled keeps
more freed compiler memory in malloc's arenas instead (492 against 254-281 MB free in them).
Their sum varied from run to run, so the first engine's RSS against a restarted one's did
too (equal, or 76 MB below it here): the unexplained part of "a restarted engine settles
higher". Two restarted engines hold the same heap to 3 MB (1,160 and 1,163 MB in use; RSS
1.85 -> 1.84 GiB, 2-core AMD EPYC, HTTP, 8 clients, a cold cache). An HTTP soak reports how
each engine compared got its programs (`SoakResult.programs`). What still differs is how far
each engine has used its KV pool through when its window is taken: the heap in use stays
flat (+21 MB) while RSS climbs by the pool's pages as blocks are first written (+300 MB;
prefix caching keeps every full block cached until no never-written block is left), and a
short run's windows catch both engines in that climb (the 90 s HTTP test: 2.34 -> 2.54 GiB).
So the total gets `restart_tolerance` across a kill: what a restart must not do is come back
grossly larger. A leak within one engine is the no-kill soak's to show
(`scripts/soak.py --no-kill`).
The windows compare warm engines: an engine that still compiles, or a restarted one still
loading, is not at its working size (a "before" window taken while the first engine still
compiled its shapes made 1.92 -> 2.23 GiB). A busy engine's RSS is bimodal: samples a second
apart sit at 1.72 or 2.05 GiB as XLA maps and unmaps its step buffers, in proportions that
change with the load (AMD EPYC, 64 clients); a median follows those proportions, the 90th
percentile is the engine at its busiest, which both windows reach, and a leak still moves it.
With no kill, "before" starts at `warmup_at` of the run. A run whose clients reach
`max_requests` early stops issuing calls but keeps sampling RSS until its `seconds` are up, so
that both windows exist.
Entry points: `scripts/soak.py` (through `soak_server`), tests/bench/test_soak.py.
"""

from __future__ import annotations

import random
import signal
import statistics
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from jaxpipe.config.checks import check_choices, check_counts

CALL_DEADLINE = 180.0  # seconds; a call that takes longer is a hang
PAUSES = {"unavailable": 0.25, "rate_limited": 1.0}  # seconds a client waits after these
IDLE_WAIT = 10.0  # seconds the engine gets, once the run is over, to hold no request
ENGINE_MODULE = "jaxpipe.serve.engine_process"  # how the engine process is found to be killed


@dataclass
class SoakConfig:
    """One soak's clients, length, engine kill and RSS verdict (`scripts/soak.py`'s flags; its
    `--minutes`, `soak_server.SoakCommand`'s, sets `seconds`).

    transport: what the clients speak: "grpc" (`soak_grpc.GrpcCalls`) or "http" (the
        OpenAI-compatible API, `soak_http.HttpCalls`)
    clients: concurrent client threads
    seconds: how long the clients issue calls (CI's soak: 180)
    kill_at: fraction of `seconds` at which the engine process is killed (--no-kill: never)
    warmup_at: with no kill: fraction of `seconds` where the "before" RSS window starts
    rss_window: fraction of `seconds` over which each side's RSS is taken
    settle: seconds after the restart before an "after" RSS sample counts
    min_samples: RSS samples each side needs (one a second)
    max_tokens: each request's max_tokens is drawn from this range (low high)
    seed: seeds the clients' choices of call and prompt
    rss_tolerance: the front end's allowed RSS growth, and the total's with no kill
    restart_tolerance: the total's allowed RSS growth across an engine kill (a new engine
        process, which may be further into using its KV pool through)
    max_requests: calls issued at most, over all clients (None: no cap; scripts/soak.py's
        default: soak_server.MAX_REQUESTS)
    """

    transport: Literal["grpc", "http"] = "grpc"
    clients: int = 64
    seconds: float = 180.0
    kill_at: float | None = field(default=0.4, metadata={"none_flag": "--no-kill"})
    warmup_at: float = 0.2
    rss_window: float = 0.2
    settle: float = 10.0
    min_samples: int = 5
    max_tokens: tuple[int, int] = (2, 12)
    seed: int = 0
    rss_tolerance: float = 0.10
    restart_tolerance: float = 0.25
    max_requests: int | None = None

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "clients", "min_samples", "max_requests")
        if not self.seconds > 0:
            raise ValueError(f"SoakConfig.seconds must be > 0, got {self.seconds!r}")
        for name in ("kill_at", "warmup_at", "rss_window"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"SoakConfig.{name} must be a fraction in [0, 1), got {value!r}")
        if len(self.max_tokens) != 2 or not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError(f"SoakConfig.max_tokens must be two integers 1 <= low <= high, "
                             f"got {self.max_tokens!r}")


@dataclass
class SoakResult:
    calls: Counter = field(default_factory=Counter)  # (kind, outcome) -> calls
    items: Counter = field(default_factory=Counter)  # batch items by outcome
    violations: list[str] = field(default_factory=list)
    killed_at: float | None = None
    restart_seconds: float | None = None
    rss_before: int = 0  # front end + engine, 90th percentile over the window before the kill
    rss_after: int = 0  # the same over the run's last window
    front_end_rss: tuple[int, int] = (0, 0)  # the front end's part of both (it outlives kills)
    serves_after: bool = False
    seconds: float = 0.0
    rss_samples: list = field(default_factory=list)  # (seconds into the run, front end, total)
    prefix_cache: dict = field(default_factory=dict)  # the last engine's, at the end (HTTP)
    first_restart_seconds: float | None = None  # the restart before the run (with a kill)
    # How the engine compared before the kill and the one after got their programs
    # ({"compiled": n, "loaded": n from the persistent cache}; HTTP only)
    programs: tuple[dict, dict] = ({}, {})

    def table(self) -> str:
        rows = [f"{'kind':<10}{'outcome':<14}{'calls':>8}"]
        rows += [f"{k:<10}{o:<14}{n:>8}" for (k, o), n in sorted(self.calls.items())]
        rows += [f"{'batch item':<10}{o:<14}{n:>8}" for o, n in sorted(self.items.items())]
        gib = [x / 2**30 for x in (self.rss_before, self.rss_after, *self.front_end_rss)]
        rows.append(f"{self.seconds:.0f} s; engine killed at {_fmt(self.killed_at)} s, serving "
                    f"again {_fmt(self.restart_seconds)} s later; RSS {gib[0]:.2f} -> {gib[1]:.2f}"
                    f" GiB (front end {gib[2]:.2f} -> {gib[3]:.2f}); serves after: "
                    f"{self.serves_after}; violations: {len(self.violations)}")
        if any(self.programs):
            before, after = (f"{p.get('compiled', '-')} + {p.get('loaded', '-')}"
                             for p in self.programs)
            rows.append(f"programs compiled + loaded from the persistent compilation cache: "
                        f"the engine before the kill {before}, after it {after}")
        if self.prefix_cache.get("queried_tokens"):
            hit, queried = self.prefix_cache["hit_tokens"], self.prefix_cache["queried_tokens"]
            rows.append(f"prefix cache (the last engine): {hit:.0f} of {queried:.0f} prompt "
                        f"tokens hit ({hit / queried:.1%})")
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


def _busiest(rss) -> int:
    """The 90th percentile of RSS samples: the process at its busiest, robust to one spike."""
    return int(statistics.quantiles(rss, n=10, method="inclusive")[-1])


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


class Tally:
    """The run's counts and breaches, written by every client thread (thread-safe)."""

    def __init__(self, result: SoakResult):
        self.result = result
        self._lock = threading.Lock()

    def call(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.result.calls[(kind, outcome)] += 1

    def item(self, outcome: str) -> None:
        """One batch item's outcome."""
        with self._lock:
            self.result.items[outcome] += 1

    def violation(self, text: str) -> None:
        with self._lock:
            self.result.violations.append(text)


class Calls(Protocol):
    """One transport's calls. Each kind's method makes one call, records any breach in the
    `Tally` it was built with, and returns the call's outcome ("ok", "cancelled",
    "unavailable", "invalid_argument", ...)."""

    KINDS: tuple[str, ...]

    def connect(self) -> AbstractContextManager:
        """A connection for one client thread (closed when the context exits)."""

    def call(self, kind: str, conn, rng: random.Random) -> str:
        """One call of `kind` over `conn`; its outcome."""

    def serving(self) -> bool:
        """Whether the server's health check says it serves."""

    def serves(self) -> bool:
        """Whether one real request gets its whole answer."""

    def engine_load(self) -> dict[str, float]:
        """What the engine holds (requests, KV): every value 0 when it is idle."""

    def prefix_cache(self) -> dict[str, float]:
        """The engine's prefix-cache counters since it started ("queried_tokens",
        "hit_tokens"); {} where the transport does not report them."""

    def programs(self) -> dict[str, float]:
        """How the engine process got its compiled programs ("compiled", "loaded" from the
        persistent compilation cache); {} where the transport does not report them."""


def make_calls(config: SoakConfig, target: str, tally: Tally) -> Calls:
    """The `Calls` of `config.transport` against `target` (gRPC host:port, or HTTP base URL)."""
    if config.transport == "grpc":
        from jaxpipe_bench.soak_grpc import GrpcCalls

        return GrpcCalls(target, tally, config.max_tokens, CALL_DEADLINE)
    if config.transport == "http":
        from jaxpipe_bench.soak_http import HttpCalls

        return HttpCalls(target, tally, config.max_tokens, CALL_DEADLINE)
    raise AssertionError(config.transport)  # SoakConfig refuses any other


class Soak:
    """One soak run against the server at `target` (a gRPC address, or the HTTP API's base URL
    for transport "http") whose front end has pid `server_pid`."""

    def __init__(self, target: str, server_pid: int, config: SoakConfig):
        self.server_pid, self.config = server_pid, config
        self.result = SoakResult()
        self.tally = Tally(self.result)
        self.calls = make_calls(config, target, self.tally)
        self._issued = 0
        self._cap_lock = threading.Lock()
        self._stop_at = 0.0  # when the clients stop calling (monotonic; `run` sets it)

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> SoakResult:
        cfg, res = self.config, self.result
        if cfg.kill_at is not None:  # the engines compared are both restarted ones
            res.first_restart_seconds = self._restart_engine()[1]
        start = time.monotonic()
        self._stop_at = start + cfg.seconds
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                   for i in range(cfg.clients)]
        samples = res.rss_samples
        done = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(start, samples, done),
                                   daemon=True)
        for t in [*threads, sampler]:
            t.start()
        if cfg.kill_at is not None:
            self._kill_and_wait(start + cfg.kill_at * cfg.seconds, start)
            self._stop_at = max(self._stop_at, start + self._after_window_end())
        for t in threads:
            t.join(timeout=max(self._stop_at - time.monotonic(), 0) + CALL_DEADLINE + 30)
            if t.is_alive():
                self.tally.violation(f"client thread {t.name} still running after its deadline")
        time.sleep(max(self._stop_at - time.monotonic(), 0))  # the cap was reached: RSS goes on
        res.seconds = time.monotonic() - start
        done.set()
        sampler.join()
        self._check_idle()
        res.prefix_cache = self._scrape(self.calls.prefix_cache)
        if cfg.kill_at is not None:
            res.programs = (res.programs[0], self._scrape(self.calls.programs))
        res.serves_after = self.calls.serves()
        if not res.serves_after:
            self.tally.violation("the server does not serve after the run")
        self._compare_rss(samples)
        return res

    @staticmethod
    def _scrape(read) -> dict:
        """`read()`, informational: a failed scrape is no breach, its error is the answer."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}

    def _check_idle(self) -> None:
        """The engine must hold nothing once every call has ended (cancelled ones included)."""
        deadline = time.monotonic() + IDLE_WAIT
        while True:
            try:
                held = {k: v for k, v in self.calls.engine_load().items() if v}
            except Exception as e:  # unreadable stats are a breach too, named
                held = {f"stats unreadable ({type(e).__name__}: {e})": 1}
            if not held or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if held:
            self.tally.violation(f"the engine still holds {held} {IDLE_WAIT:g} s after the run")

    def _sample_rss(self, start: float, samples: list, done: threading.Event) -> None:
        import psutil

        while not done.wait(1.0):
            try:
                front, total = self.rss()
            except psutil.NoSuchProcess:  # the front end is gone: the run reports it
                return
            samples.append((time.monotonic() - start, front, total))

    def _after_window_end(self) -> float:
        """Seconds into the run by which the "after" window holds `rss_window` of the run
        after the restarted engine settled (`settle`): the run's end, or later after a slow
        restart (44.5 s on a loaded 2-core Intel Xeon, against 22 s before the run)."""
        cfg, res = self.config, self.result
        if res.killed_at is None or res.restart_seconds is None:
            return cfg.seconds
        settled = res.killed_at + res.restart_seconds + cfg.settle
        return max(cfg.seconds, settled + cfg.rss_window * cfg.seconds)

    def _compare_rss(self, samples: list[tuple[float, int, int]]) -> None:
        cfg, res = self.config, self.result
        window = cfg.rss_window * cfg.seconds
        end = res.killed_at if res.killed_at is not None else cfg.warmup_at * cfg.seconds + window
        before = [s for s in samples if end - window <= s[0] < end]
        serving = (res.killed_at or 0.0) + (res.restart_seconds or 0.0) + cfg.settle
        after = [s for s in samples if s[0] >= max(cfg.seconds - window, serving)]
        if len(before) < cfg.min_samples or len(after) < cfg.min_samples:
            self.tally.violation(f"too few RSS samples to compare ({len(before)} before "
                                 f"{end:.0f} s, {len(after)} after {serving:.0f} s of "
                                 f"{cfg.seconds:.0f}): run longer")
            return
        res.rss_before, res.rss_after = (_busiest(s[2] for s in side) for side in (before, after))
        res.front_end_rss = tuple(_busiest(s[1] for s in side) for side in (before, after))
        total = cfg.rss_tolerance if res.killed_at is None else cfg.restart_tolerance
        self._bound("RSS", res.rss_before, res.rss_after, total)
        self._bound("the front end's RSS", *res.front_end_rss, cfg.rss_tolerance)

    def _bound(self, what: str, before: int, after: int, tolerance: float) -> None:
        if after > before * (1 + tolerance):
            self.tally.violation(f"{what} grew from {before:,} to {after:,} bytes "
                                 f"(> {tolerance:.0%})")

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

    def engine_pid(self) -> int | None:
        """The pid of the front end's engine process (None if it has none now)."""
        import psutil

        for child in psutil.Process(self.server_pid).children():
            try:
                if ENGINE_MODULE in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        return None

    def _kill_and_wait(self, when: float, start: float) -> None:
        """At `when`, SIGKILL the engine process; then wait until the server serves again."""
        time.sleep(max(when - time.monotonic(), 0))
        programs = self._scrape(self.calls.programs)
        killed, self.result.restart_seconds = self._restart_engine()
        if killed is not None:
            self.result.killed_at = killed - start
            self.result.programs = (programs, {})

    def _restart_engine(self) -> tuple[float | None, float | None]:
        """SIGKILL the engine process and wait until the server serves again: (when it was
        killed, the seconds it took to serve again); None for what did not happen (a breach
        is recorded)."""
        import psutil

        pid = self.engine_pid()
        if pid is None:
            self.tally.violation("no engine process to kill")
            return None, None
        psutil.Process(pid).send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 300:
            time.sleep(0.5)
            if time.monotonic() - killed > 1 and self.calls.serving():
                return killed, time.monotonic() - killed
        self.tally.violation("the engine was not serving again 300 s after the kill")
        return killed, None

    # ---- one client ---------------------------------------------------------------------------

    def _client(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        with self.calls.connect() as conn:
            while time.monotonic() < self._stop_at and self._take_one():
                kind = rng.choice(self.calls.KINDS)
                try:
                    outcome = self.calls.call(kind, conn, rng)
                except Exception as e:  # a client bug is a violation too, not a silent stop
                    self.tally.violation(f"{kind}: unexpected {type(e).__name__}: {e}")
                    outcome = "crashed"
                self.tally.call(kind, outcome)
                time.sleep(PAUSES.get(outcome, 0))  # as a client would, before retrying

    def _take_one(self) -> bool:
        """Count one more call against `max_requests`; False once the cap is reached."""
        with self._cap_lock:
            if self.config.max_requests is not None and self._issued >= self.config.max_requests:
                return False
            self._issued += 1
            return True
