"""The soak's HTTP calls (`jaxpipe_bench.soak`) against the OpenAI-compatible API, with httpx:

  stream     a chat completion with stream=True, every SSE event read to [DONE]
  plain      a whole (non-streamed) chat completion, or text completion of one or two prompts
  cancel     a streamed chat completion the client closes after its first event, or a short
             random while later: the cancellation (its outcome is "cancelled")
  malformed  a request the API must refuse: 400 (temperature -1, top_p 2, max_tokens 10**9, a
             body that is not JSON) or 404 (another model), with an OpenAI error body

A refusal's outcome comes from its status (`OUTCOMES`): 503 "unavailable" (the engine is down),
429 "rate_limited" (past max_concurrent_requests; allowed), 400 / 404 "invalid_argument" (only
for malformed calls). Every other status, a transport error (the front end never goes away in a
soak: only its engine is killed), a call past its deadline, and a stream that does not end with
exactly one terminal (its finish chunk, or one error event, and then [DONE] last) are breaches.
/health says whether the server serves; /metrics gives the engine's load.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from contextlib import AbstractContextManager

import httpx

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OUTCOMES = {503: "unavailable", 429: "rate_limited", 400: "invalid_argument",
            404: "invalid_argument"}
REFUSALS = ("unavailable", "rate_limited")  # what any call may get
CANCEL_MAX_TOKENS = 64  # long enough that a cancel arrives mid-stream
CANCEL_DELAY = 0.5  # seconds a cancel reads at most before it closes the stream
# the engine's load on /metrics: metric name -> the label values whose samples count
LOAD = {"jaxpipe_kv_tokens_used": ("device", "host"),
        "jaxpipe_queue_requests": ("waiting", "device", "host")}
# the prefix cache's counters on /metrics -> their names in SoakResult.prefix_cache
CACHE = {"jaxpipe_prefix_cache_queried_tokens": "queried_tokens",
         "jaxpipe_prefix_cache_hit_tokens": "hit_tokens"}
PROGRAMS = "jaxpipe_programs"  # the engine's programs by where they came from


class HttpCalls:
    """Calls to the HTTP API at base URL `url`, checked into `tally`."""

    KINDS = ("stream", "plain", "cancel", "malformed")

    def __init__(self, url: str, tally, max_tokens: tuple[int, int], deadline: float):
        self.url, self.tally = url.rstrip("/"), tally
        self.max_tokens, self.deadline = max_tokens, deadline
        self._ids = itertools.count()

    def connect(self) -> AbstractContextManager:
        return httpx.Client(base_url=self.url, timeout=self.deadline)

    def call(self, kind: str, conn: httpx.Client, rng: random.Random) -> str:
        """One call of `kind`; a timeout or a transport error is a breach, named here."""
        start = time.monotonic()
        try:
            return getattr(self, f"_{kind}")(conn, rng)
        except httpx.TimeoutException as e:
            self.tally.violation(f"{kind}: no answer within {self.deadline:g} s "
                                 f"({type(e).__name__})")
            return "hang"
        except httpx.TransportError as e:
            self.tally.violation(f"{kind}: {type(e).__name__} after "
                                 f"{time.monotonic() - start:.1f} s: {e}")
            return "transport_error"

    # ---- the server as a whole ----------------------------------------------------------------

    def serving(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def serves(self) -> bool:
        try:
            resp = httpx.post(self.url + CHAT, timeout=self.deadline, json={
                "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2,
                "temperature": 0})
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] is not None

    def engine_load(self) -> dict[str, float]:
        return engine_load(httpx.get(self.url + "/metrics", timeout=30).text)

    def prefix_cache(self) -> dict[str, float]:
        return prefix_cache(httpx.get(self.url + "/metrics", timeout=30).text)

    def programs(self) -> dict[str, float]:
        return programs(httpx.get(self.url + "/metrics", timeout=30).text)

    # ---- the kinds ----------------------------------------------------------------------------

    def _stream(self, conn: httpx.Client, rng: random.Random) -> str:
        body = {**self._chat(rng), "stream": True}
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return self._read("stream", conn, body)

    def _cancel(self, conn: httpx.Client, rng: random.Random) -> str:
        body = {**self._chat(rng), "stream": True, "max_tokens": CANCEL_MAX_TOKENS,
                "ignore_eos": True}
        close_at = time.monotonic() + (0.0 if rng.random() < 0.5 else
                                       rng.uniform(0, CANCEL_DELAY))
        return self._read("cancel", conn, body, close_at, ok="finished")

    def _read(self, kind: str, conn: httpx.Client, body: dict, close_at: float | None = None,
              ok: str = "ok") -> str:
        """POST a streamed chat and read its events to the end, or until `close_at` (then
        "cancelled": leaving the block closes the connection mid-stream)."""
        with conn.stream("POST", CHAT, json=body) as resp:
            if resp.status_code != 200:
                return self._refused(kind, resp, REFUSALS)
            events = SseEvents()
            for data in _data_lines(resp):
                events.add(data)
                if close_at is not None and not events.done and time.monotonic() >= close_at:
                    return "cancelled"
            return self._ended(kind, events, ok=ok)

    def _plain(self, conn: httpx.Client, rng: random.Random) -> str:
        if rng.random() < 0.5:
            url, body, n = CHAT, self._chat(rng), 1
        else:
            n = rng.choice([1, 2])
            prompts = [self._prompt(rng) for _ in range(n)]
            url, body = COMPLETIONS, {**self._sampling(rng),
                                      "prompt": prompts[0] if n == 1 else prompts}
        resp = conn.post(url, json=body)
        if resp.status_code != 200:
            return self._refused("plain", resp, REFUSALS)
        choices = resp.json()["choices"]
        ended = sorted(c["index"] for c in choices if c["finish_reason"] is not None)
        if ended != list(range(n)):
            self.tally.violation(f"plain: {n} prompts, finished choices {ended}: {choices}")
        return "ok"

    def _malformed(self, conn: httpx.Client, rng: random.Random) -> str:
        status, url, body = rng.choice([
            (400, CHAT, {**self._chat(rng), "temperature": -1}),
            (400, COMPLETIONS, {**self._sampling(rng), "prompt": "x", "top_p": 2.0}),
            (400, COMPLETIONS, {**self._sampling(rng), "prompt": "x", "max_tokens": 10**9}),
            (400, CHAT, "{not json"),
            (404, CHAT, {**self._chat(rng), "model": "gpt-4o"})])
        if rng.random() < 0.5 and isinstance(body, dict):
            body["stream"] = True
        content = body if isinstance(body, str) else json.dumps(body)
        resp = conn.post(url, content=content, headers={"Content-Type": "application/json"})
        if resp.status_code == 200:
            self.tally.violation(f"malformed: {content[:200]} was accepted")
            return "accepted"
        if resp.status_code in (400, 404) and resp.status_code != status:
            self.tally.violation(f"malformed: HTTP {resp.status_code}, not {status}, for "
                                 f"{content[:200]}")
        return self._refused("malformed", resp, (*REFUSALS, "invalid_argument"))

    # ---- bodies and answers -------------------------------------------------------------------

    def _prompt(self, rng: random.Random) -> str:
        return f"Request {next(self._ids)}: tell me about the number {rng.randrange(1000)}."

    def _sampling(self, rng: random.Random) -> dict:
        lo, hi = self.max_tokens
        return {"temperature": rng.choice([0.0, 0.8]), "max_tokens": rng.randint(lo, hi),
                "seed": rng.randrange(1 << 30)}

    def _chat(self, rng: random.Random) -> dict:
        return {**self._sampling(rng),
                "messages": [{"role": "user", "content": self._prompt(rng)}]}

    def _refused(self, kind: str, resp: httpx.Response, allowed: tuple[str, ...]) -> str:
        """The outcome of an error response; a breach unless it is `allowed` and its body is
        OpenAI's {"error": {"message", "type", ...}}."""
        resp.read()
        outcome = OUTCOMES.get(resp.status_code, f"http_{resp.status_code}")
        if outcome not in allowed:
            self.tally.violation(f"{kind}: HTTP {resp.status_code}: {resp.text[:300]}")
        elif not _is_error_body(resp):
            self.tally.violation(f"{kind}: HTTP {resp.status_code} with the body "
                                 f"{resp.text[:300]!r}")
        return outcome

    def _ended(self, kind: str, events: SseEvents, ok: str = "ok") -> str:
        """The outcome of a stream read to its end: `ok`, or "unavailable" for an engine lost
        mid-stream; a breach unless it had exactly one terminal and [DONE] last."""
        breach = events.breach()
        if breach:
            self.tally.violation(f"{kind}: {breach}")
            return "bad_stream"
        if events.errors:
            error = events.errors[0]
            if error.get("type") != "service_unavailable":
                self.tally.violation(f"{kind}: an error event mid-stream: {error}")
            return "unavailable"
        return ok


class SseEvents:
    """What one SSE stream said so far: finish chunks, error events, [DONE]s, events after the
    first [DONE]."""

    def __init__(self):
        self.finals, self.done, self.late = 0, 0, 0
        self.errors: list[dict] = []

    def add(self, data: str) -> None:
        """One event's data (the text after "data: ")."""
        if self.done:
            self.late += 1
        if data == "[DONE]":
            self.done += 1
            return
        event = json.loads(data)
        if "error" in event:
            self.errors.append(event["error"])
            return
        self.finals += sum(c.get("finish_reason") is not None for c in event["choices"])

    def breach(self) -> str | None:
        """Why the stream, read to its end, did not end exactly once (None if it did)."""
        if not self.done:
            return (f"the stream ended without [DONE] ({self.finals} finish chunks, "
                    f"{len(self.errors)} error events)")
        if self.late:
            return f"{self.late} events after [DONE]"
        if self.finals + len(self.errors) != 1:
            return (f"{self.finals} finish chunks and {len(self.errors)} error events "
                    "before [DONE], not one terminal")
        return None


def engine_load(metrics_text: str) -> dict[str, float]:
    """KV tokens held and requests queued or running, from a /metrics scrape (an engine that
    did not answer the scrape counts as {"engine_up == 0": 1})."""
    load, up = {}, 0.0
    for s in _samples(metrics_text):
        if s.name == "jaxpipe_engine_up":
            up = s.value
        if s.labels.get("tier") in LOAD.get(s.name, ()):
            load[f"{s.name}{{{s.labels['tier']}}}"] = s.value
    return load if up else {"engine_up == 0": 1}


def prefix_cache(metrics_text: str) -> dict[str, float]:
    """The prefix cache's prompt tokens looked up and found, from a /metrics scrape (counted
    since the engine process started: a kill restarts them); {} where the scrape has none
    (an engine that did not answer)."""
    return {CACHE[name]: s.value for s in _samples(metrics_text)
            if (name := s.name.removesuffix("_total")) in CACHE}


def programs(metrics_text: str) -> dict[str, float]:
    """How the engine process got its compiled programs ("compiled", "loaded" from the
    persistent compilation cache), from a /metrics scrape; {} where the scrape has none."""
    names = {"compiled": "compiled", "cache": "loaded"}
    return {names[s.labels["source"]]: s.value for s in _samples(metrics_text)
            if s.name == PROGRAMS and s.labels.get("source") in names}


def _samples(metrics_text: str):
    """Every sample of a /metrics scrape (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        yield from family.samples


def _data_lines(resp: httpx.Response):
    """The data of each SSE event of `resp` (one "data: " line each, as this server sends)."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def _is_error_body(resp: httpx.Response) -> bool:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and bool(error.get("message")) and "type" in error
