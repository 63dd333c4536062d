"""Prometheus metrics of a running server (`python -m jaxpipe.serve --metrics-port PORT`).

Every scrape asks the engine process for `Engine.stats()` (one `QueryStats` message) and
renders it, so /metrics and `engine.stats()` are the same numbers; the front ends add the
request outcomes only they see (refused as invalid, rate limited, or unavailable) and the
latency their clients see (`Latency`: time to first token, per output token, end to end).
Names follow Prometheus' conventions: `_total` counters, `_seconds` units, labels for the tier,
part, kind and front end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

PREFIX = "jaxpipe_"
SCRAPE_TIMEOUT = 2.0  # seconds the engine gets to answer a scrape's stats query

# Engine.stats() counter -> (metric name, help)
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "prompt tokens of the requests queued"),
    "generated_tokens": ("generation_tokens", "tokens generated"),
    "transitions": ("transitions", "layout switches (prefill <-> decode)"),
    "preemptions": ("preemptions", "sequences evicted from the device KV pool"),
    "steps": ("steps", "engine steps run"),
    "swap_seconds": ("swap_seconds", "engine-thread seconds in host KV tier swaps"),
    "swap_out_bytes": ("swap_out_bytes", "KV bytes moved to the host tier"),
    "swap_in_bytes": ("swap_in_bytes", "KV bytes moved back from the host tier"),
    "prefix_cache_queried_tokens": ("prefix_cache_queried_tokens", "context tokens looked up "
                                    "in the prefix cache as sequences entered the device"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "context tokens found in the "
                                "prefix cache (whole blocks, not computed again)"),
    "prefix_cache_evictions": ("prefix_cache_evictions", "cached KV blocks nobody held, "
                               "given out for new KV"),
    "prefix_cache_device_hit_tokens": ("prefix_cache_device_hit_tokens", "prefix cache hit "
                                       "tokens found in the device KV pool"),
    "prefix_cache_host_hit_tokens": ("prefix_cache_host_hit_tokens", "prefix cache hit "
                                     "tokens copied back from the host tier"),
    "prefix_cache_host_stored_blocks": ("prefix_cache_host_stored_blocks", "evicted cached "
                                        "KV blocks kept in the host tier"),
    "prefix_cache_host_evictions": ("prefix_cache_host_evictions", "cached KV blocks the "
                                    "host tier forgot"),
}
# Engine.stats() gauge -> (metric name, help, labels)
GAUGES = {
    "waiting_requests": ("queue_requests", "sequences by where they wait or run",
                         {"tier": "waiting"}),
    "device_requests": ("queue_requests", "", {"tier": "device"}),
    "host_requests": ("queue_requests", "", {"tier": "host"}),
    "device_kv_used": ("kv_tokens_used", "KV tokens held, by tier", {"tier": "device"}),
    "host_kv_used": ("kv_tokens_used", "", {"tier": "host"}),
    "device_kv_capacity": ("kv_tokens_capacity", "KV tokens each tier holds at most",
                           {"tier": "device"}),
    "host_kv_capacity": ("kv_tokens_capacity", "", {"tier": "host"}),
    "device_idle_fraction": ("device_idle_fraction",
                             "upper bound of the device's idle share of decode time", {}),
    "pipeline_bubble_fraction": ("pipeline_bubble_fraction", "the pipeline stages' time "
                                 "without a micro-batch over pp x the pipeline's wall time "
                                 "since the engine's stats were last reset", {}),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "prefix cache hit tokens over queried "
                              "tokens since the engine's stats were last reset", {}),
    "programs_compiled": ("programs", "the engine process's compiled programs by where they "
                          "came from: compiled there, or loaded from the persistent "
                          "compilation cache", {"source": "compiled"}),
    "programs_loaded": ("programs", "", {"source": "cache"}),
}


class Outcomes:
    """Request outcomes only the front end sees, counted thread-safely."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def add(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class EngineCollector:
    """A prometheus_client collector over the engine process's stats."""

    def __init__(self, stats, outcomes: Outcomes):
        """`stats()`: the engine's `Engine.stats()` dict, or None when it cannot answer."""
        self.stats, self.outcomes = stats, outcomes

    def collect(self):
        stats = self.stats()
        up = GaugeMetricFamily(PREFIX + "engine_up", "1 when the engine process answered "
                               "this scrape's stats query")
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        yield self._requests(stats or {})
        if stats is None:
            return
        for key, (name, help_text) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=float(stats.get(key, 0)))
        yield from _gauges(stats)
        yield _stages(stats)
        yield _reshard(stats)
        yield from _latency(stats)

    def _requests(self, stats: dict) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + "requests", "requests by outcome: the engine's "
                                     "finish reasons, and the front ends' invalid, "
                                     "rate_limited and unavailable refusals",
                                     labels=["outcome"])
        counts = dict(stats.get("finish_reasons", {}))
        for outcome, n in self.outcomes.counts().items():
            counts[outcome] = counts.get(outcome, 0) + n
        for outcome in sorted(counts):
            family.add_metric([outcome], float(counts[outcome]))
        return family


def _gauges(stats: dict):
    families: dict[str, GaugeMetricFamily] = {}
    for key, (name, help_text, labels) in GAUGES.items():
        if name not in families:
            families[name] = GaugeMetricFamily(PREFIX + name, help_text, labels=list(labels))
        families[name].add_metric(list(labels.values()), float(stats.get(key, 0)))
    return families.values()


def _stages(stats: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + "pipeline_stage_seconds", "each pipeline stage's "
                               "seconds running a micro-batch (busy) or none (idle) since the "
                               "engine's stats were last reset, by layout phase",
                               labels=["phase", "stage", "state"])
    for state in ("busy", "idle"):
        for phase, seconds in sorted(stats.get(f"pipeline_stage_{state}_seconds", {}).items()):
            for stage, value in enumerate(seconds):
                family.add_metric([phase, str(stage), state], float(value))
    return family


def _reshard(stats: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + "reshard_seconds", "seconds moving weights and KV "
                                 "between layouts", labels=["part"])
    for part in ("weights", "kv"):
        family.add_metric([part], float(stats.get(f"reshard_{part}_seconds", 0.0)))
    return family


def _latency(stats: dict):
    bounds = stats.get("step_latency_bounds", [])
    family = HistogramMetricFamily(PREFIX + "step_latency_seconds", "seconds from a step's "
                                   "dispatch to its tokens on the host, by kind",
                                   labels=["kind"])
    for kind, h in sorted(stats.get("step_latency", {}).items()):
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, bounds), "+Inf"], h["counts"], strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric([kind], buckets, h["sum"])
    yield family


# Histogram bounds in seconds (vLLM's for the same metrics, trimmed to what CPU and GPU runs see).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Latency:
    """Per-request latency histograms as vLLM names them, labelled by front end ("grpc",
    "http"): time to first token, time per output token after the first, and end-to-end
    latency, each measured from the moment the front end accepted the request."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["front_end"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "seconds from a request's "
                              "arrival to its first token", labels, registry=registry,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "a request's mean "
                              "seconds per output token after its first", labels,
                              registry=registry, buckets=TPOT_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "seconds from a "
                             "request's arrival to its last token", labels, registry=registry,
                             buckets=E2E_BUCKETS)

    def timer(self, front_end: str) -> RequestTimer:
        """A timer for one request, started now."""
        return RequestTimer(self, front_end)


class RequestTimer:
    """One request's clock: `tokens(n)` as its tokens arrive, `finished()` once at the end."""

    def __init__(self, latency: Latency, front_end: str):
        self.latency, self.front_end = latency, front_end
        self.start = time.perf_counter()
        self.first: float | None = None
        self.count = 0

    def tokens(self, n: int) -> None:
        if n and self.first is None:
            self.first = time.perf_counter()
            self.latency.ttft.labels(self.front_end).observe(self.first - self.start)
        self.count += n

    def finished(self) -> None:
        now = time.perf_counter()
        self.latency.e2e.labels(self.front_end).observe(now - self.start)
        if self.count > 1:
            self.latency.tpot.labels(self.front_end).observe(
                (now - self.first) / (self.count - 1))


class ServerMetrics:
    """What the front ends record and every /metrics endpoint renders (its own port, and the
    HTTP front end's): the engine's stats (`stats()`, asked at each scrape), the outcomes only
    the front ends see, and the latency their clients see."""

    def __init__(self, stats):
        self.outcomes = Outcomes()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(stats, self.outcomes))
        self.latency = Latency(self.registry)


def serve_metrics(port: int, host: str, registry: CollectorRegistry):
    """Start the /metrics HTTP endpoint on a daemon thread; returns (server, bound port)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
