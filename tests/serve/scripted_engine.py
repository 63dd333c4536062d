"""A scripted stand-in for the engine process behind `EngineClient`, for front-end tests that
need no model (tests/serve/test_http_app.py, test_batches.py)."""

from __future__ import annotations

import threading
import time

from jaxpipe.serve import messages as m
from jaxpipe.serve.engine_client import EngineLost, EngineUnavailable

MODEL = "scripted"


class ScriptedEngine:
    """EngineClient's surface. Each request gets its first and last prompt ids back as two
    deltas (sample i of n: its first + i), unless `hold` is set: then it waits until aborted
    or `lose()` kills the engine."""

    def __init__(self):
        self.info = m.Ready(pid=1, model=MODEL, max_model_len=64, vocab_size=1000,
                            max_num_seqs=4)
        self.dead = threading.Event()
        self.hold = False
        self.pending: dict = {}
        self.aborted: list[str] = []

    @property
    def serving(self) -> bool:
        return not self.dead.is_set()

    def unavailable_reason(self) -> str:
        return "the scripted engine is down"

    def submit(self, rid: str, ids: list[int], params: dict, out) -> None:
        if self.dead.is_set():
            raise EngineUnavailable(self.unavailable_reason())
        if self.hold:
            self.pending[rid] = out
            return
        for i, key in enumerate(m.sample_keys(rid, params.get("n", 1))):
            threading.Thread(target=self._answer, args=(key, [ids[0] + i, *ids[1:]], out)).start()

    @staticmethod
    def _answer(rid: str, ids: list[int], out) -> None:
        """Sample i of a request (n > 1) answers its first prompt id + i, then its last."""
        out.put(m.TokenDelta(rid, [ids[0]], [[[ids[0], -0.5]]]))
        out.put(m.TokenDelta(rid, [ids[-1]], [[[ids[-1], -0.25]]], "length"))

    def abort(self, rid: str) -> None:
        out = self.pending.pop(rid, None)
        if out is not None:
            self.aborted.append(rid)
            out.put(m.TokenDelta(rid, [], None, "abort"))

    def lose(self) -> None:
        self.dead.set()
        pending, self.pending = self.pending, {}
        for rid, out in pending.items():
            out.put(EngineLost(rid, "the engine process exited (code -9)"))

    def stats(self, timeout: float = 5.0):
        return None


def until(condition, timeout: float = 10.0, every: float = 0.02) -> bool:
    """Whether `condition()` holds within `timeout` s (asked every `every` s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
