"""The front end's handle on the engine process: start it, send it requests, route its outputs.

One receiver thread reads the engine's output socket and puts each message on the queue of the
request it belongs to. If the engine process exits, every pending request gets an `EngineLost`
item and submissions raise `EngineUnavailable` until it is back, so no caller ever waits
forever. An engine that had been serving is restarted (up to `max_restarts` times in a row,
waiting `backoff` seconds doubled each time; a run of STABLE_SECONDS resets the count); one that
dies while starting is not (its configuration or weights are bad: restarting would fail again),
and the client gives up (`given_up`). The engine process dies with the front end (`lifeline`),
however the front end ends.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from jaxpipe.process import lifeline
from jaxpipe.process.lifeline import STABLE_SECONDS
from jaxpipe.serve import messages as m

log = logging.getLogger("jaxpipe.serve")

POLL_MS = 100


class EngineUnavailable(RuntimeError):
    """The engine process is not running (still starting, or dead)."""


@dataclass(frozen=True)
class EngineLost:
    """Queued for each pending request when the engine process dies."""

    request_id: str
    message: str


class EngineClient:
    """Start the engine process with `engine_kwargs` (EngineConfig fields) and talk to it.

    `on_health(serving)` is called when the engine becomes ready (True) or dies (False)."""

    def __init__(self, engine_kwargs: dict, on_health: Callable[[bool], None] = lambda s: None,
                 max_restarts: int = 5, backoff: float = 1.0):
        self._on_health = on_health
        self._engine_kwargs = engine_kwargs
        self.max_restarts, self.backoff = max_restarts, backoff
        self.restarts = 0  # restarts in a row (reset once an engine has been up STABLE_SECONDS)
        self.total_restarts = 0
        self.given_up = threading.Event()
        self._ready_at: float | None = None
        self.last_exit: int | None = None  # the exit code of the engine process that died
        self._dir = tempfile.mkdtemp(prefix="jaxpipe-serve-")
        self._ctx = zmq.Context()
        self._requests = self._bind(zmq.PUSH, "requests")
        self._outputs = self._bind(zmq.PULL, "outputs")
        self._lock = threading.Lock()  # guards _requests (zmq sockets are not thread-safe)
        self._queues: dict[str, queue.Queue] = {}
        self._stats: queue.Queue = queue.Queue()
        self._stats_lock = threading.Lock()
        self.info: m.Ready | None = None
        self.ready, self.dead = threading.Event(), threading.Event()
        self.proc = self._spawn(engine_kwargs)
        self._closing = False
        self._thread = threading.Thread(target=self._receive_loop, name="engine-client",
                                        daemon=True)
        self._thread.start()

    # ---- lifecycle ----------------------------------------------------------------------------

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{os.path.join(self._dir, name)}")
        return sock

    def _spawn(self, engine_kwargs: dict) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jaxpipe.serve.engine_process",
               "--config", json.dumps(engine_kwargs),
               "--inbox", self._requests.getsockopt_string(zmq.LAST_ENDPOINT),
               "--outbox", self._outputs.getsockopt_string(zmq.LAST_ENDPOINT)]
        # Own session: a Ctrl-C in the terminal reaches only the front end, which drains first.
        return lifeline.spawn(cmd, start_new_session=True)

    def wait_ready(self, timeout: float | None = None) -> m.Ready:
        """Block until the engine has loaded; raise EngineUnavailable if it died instead."""
        while not self.ready.wait(0.2):
            if self.dead.is_set():
                raise EngineUnavailable(
                    f"the engine process exited with code {self.proc.returncode} while starting "
                    "(its error is above)")
            if timeout is not None:
                timeout -= 0.2
                if timeout <= 0:
                    raise EngineUnavailable("the engine process did not become ready in time")
        return self.info

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to exit (killing it after `timeout` s) and release the sockets."""
        if self.proc.poll() is None:
            self._send(m.Shutdown(), quiet=True)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("engine process did not exit in %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        self._closing = True
        self._thread.join()  # returns within one poll interval
        with self._lock:
            self._requests.close()
        self._outputs.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: dict,
               out: queue.Queue) -> None:
        """Send one request; its TokenDelta / Rejected / EngineLost items arrive on `out`
        (with n > 1 each sample's deltas under its `messages.sample_key`)."""
        with self._lock:
            if self.dead.is_set() or not self.ready.is_set():
                raise EngineUnavailable(self.unavailable_reason())
            keys = m.sample_keys(request_id, params.get("n", 1))
            for key in keys:  # each sample's deltas come under its key
                self._queues[key] = out
            try:
                self._requests.send(m.encode(m.AddRequest(request_id, prompt_token_ids, params)),
                                    zmq.NOBLOCK)
            except zmq.Again:
                for key in keys:
                    del self._queues[key]
                raise EngineUnavailable("the engine process is not accepting requests") from None

    def abort(self, request_id: str) -> None:
        """Cancel a request if it is still pending (its final 'abort' deltas follow);
        `request_id`: any of its sample keys."""
        if request_id in self._queues:
            self._send(m.Abort(request_id), quiet=True)

    def stats(self, timeout: float = 5.0) -> m.Stats | None:
        """The engine process's load, or None if it does not answer in time."""
        with self._stats_lock:
            if not self.ready.is_set() or self.dead.is_set() or not self._send(m.QueryStats()):
                return None
            try:
                return self._stats.get(timeout=timeout)
            except queue.Empty:
                return None

    @property
    def serving(self) -> bool:
        """Whether requests can be taken now: the engine is loaded and alive."""
        return self.info is not None and not self.dead.is_set()

    def unavailable_reason(self) -> str:
        """Why requests cannot be taken now (the engine is starting, or has exited)."""
        if self.given_up.is_set():
            return f"the engine process has exited (code {self.last_exit})"
        if self.dead.is_set() or self.total_restarts:
            return (f"the engine process exited (code {self.last_exit}) and is being "
                    "restarted; retry when health reports SERVING")
        return "the engine is still starting; retry when health reports SERVING"

    def _send(self, msg, quiet: bool = False) -> bool:
        with self._lock:
            try:
                self._requests.send(m.encode(msg), zmq.NOBLOCK)
                return True
            except (zmq.Again, zmq.ZMQError) as e:
                if not quiet:
                    log.warning("could not send %s to the engine: %s", type(msg).__name__, e)
                return False

    # ---- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._closing:
            if self._outputs.poll(POLL_MS):
                self._drain()
            elif self.proc.poll() is not None:
                self._engine_died()
                if self._closing or not self._restart():
                    return

    def _restart(self) -> bool:
        """Start a new engine process after one that died; False when giving up."""
        served = self._ready_at is not None
        if served and time.monotonic() - self._ready_at >= STABLE_SECONDS:
            self.restarts = 0
        if not served or self.restarts >= self.max_restarts:
            why = ("it died while starting" if not served
                   else f"{self.restarts} restarts in a row")
            log.error("not restarting the engine process: %s", why)
            self.given_up.set()
            return False
        delay = self.backoff * 2 ** self.restarts
        self.restarts += 1
        self.total_restarts += 1
        log.warning("restarting the engine process in %.1f s (restart %d of at most %d in a "
                    "row)", delay, self.restarts, self.max_restarts)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if self._closing:
                return False
            time.sleep(min(POLL_MS / 1000, max(end - time.monotonic(), 0)))
        while not self._stats.empty():  # answers of the dead engine
            self._stats.get_nowait()
        with self._lock:
            self.info, self._ready_at = None, None
            self.ready.clear()
            self.proc = self._spawn(self._engine_kwargs)
            self.dead.clear()
        return True

    def _drain(self) -> None:
        while True:
            try:
                data = self._outputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._dispatch(m.decode(data))
            except m.ProtocolError as e:
                log.error("dropped a message from the engine: %s", e)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, m.Outputs):
            for delta in msg.deltas:
                self._route(delta.request_id, delta, final=delta.finish_reason is not None)
        elif isinstance(msg, m.Rejected):
            self._route(msg.request_id, msg, final=True)
            with self._lock:  # its other samples' keys (n > 1) hear nothing more
                for key in [k for k in self._queues if k.startswith(f"{msg.request_id}/")]:
                    del self._queues[key]
        elif isinstance(msg, m.Stats):
            self._stats.put(msg)
        elif isinstance(msg, m.Ready):
            self.info = msg
            self._ready_at = time.monotonic()
            self.ready.set()
            log.info("engine ready: pid %d, model %s, max_model_len %d, max_num_seqs %d; "
                     "programs: %d compiled, %d loaded from the persistent compilation cache",
                     msg.pid, msg.model, msg.max_model_len, msg.max_num_seqs,
                     msg.programs_compiled, msg.programs_loaded)
            self._on_health(True)

    def _route(self, request_id: str, item, final: bool) -> None:
        with self._lock:
            out = self._queues.pop(request_id, None) if final else self._queues.get(request_id)
        if out is not None:
            out.put(item)

    def _engine_died(self) -> None:
        code = self.last_exit = self.proc.returncode
        with self._lock:
            self.dead.set()
            pending, self._queues = self._queues, {}
        if not self._closing:
            log.error("the engine process exited with code %s; %d requests fail UNAVAILABLE",
                      code, len(pending))
        self._on_health(False)  # before the callers hear of it: health is never behind them
        for rid, out in pending.items():
            out.put(EngineLost(rid, f"the engine process exited (code {code}) before this "
                                    "request finished"))
