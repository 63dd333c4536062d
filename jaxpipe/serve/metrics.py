"""Prometheus metrics of a running server (`python -m jaxpipe.serve --metrics-port PORT`).

Every scrape asks the engine process for `Engine.stats()` (one `QueryStats` message) and
renders it, so /metrics and `engine.stats()` are the same numbers; the front end adds the
request outcomes only it sees (refused as invalid, or unavailable). Names follow Prometheus'
conventions: `_total` counters, `_seconds` units, labels for the tier, part and kind.
"""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import CollectorRegistry, start_http_server
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
        yield _reshard(stats)
        yield from _latency(stats)

    def _requests(self, stats: dict) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + "requests", "requests by outcome: the engine's "
                                     "finish reasons, and the front end's invalid and "
                                     "unavailable refusals", labels=["outcome"])
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


def serve_metrics(port: int, host: str, stats, outcomes: Outcomes):
    """Start the /metrics HTTP endpoint on a daemon thread; returns (server, bound port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, outcomes))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
