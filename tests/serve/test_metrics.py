"""Prometheus metrics (jaxpipe/serve/metrics.py): the collector renders `Engine.stats()`
exactly, and the server's /metrics moves by what a known workload did, as its clients saw it."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxpipe import SamplingParams
from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc
from jaxpipe.serve.metrics import COUNTERS, EngineCollector, Outcomes, ServerMetrics


def samples(text: str) -> dict:
    """(sample name, sorted label items) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_renders_engine_stats(engine):
    engine.reset_stats()
    outputs = engine.generate(["Name three colours:", "Count to five:", "Hello"],
                    SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    stats = engine.stats()
    outcomes = Outcomes()
    outcomes.add("invalid")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine.stats, outcomes))
    got = samples(generate_latest(registry).decode())
    for key, (name, _) in COUNTERS.items():
        assert got[(f"jaxpipe_{name}_total", ())] == pytest.approx(stats[key]), key
    assert got[("jaxpipe_generation_tokens_total", ())] == sum(
        len(o.outputs[0].token_ids) for o in outputs) > 0
    reasons = stats["finish_reasons"]
    assert sum(reasons.values()) == 3
    for reason, n in reasons.items():
        assert got[("jaxpipe_requests_total", (("outcome", reason),))] == n
    assert got[("jaxpipe_requests_total", (("outcome", "invalid"),))] == 1
    steps = sum(got[("jaxpipe_step_latency_seconds_count", (("kind", k),))]
                for k in ("prefill", "decode", "mixed"))
    # (a step dispatched before reset_stats and landed after it is in the histogram only)
    assert stats["steps"] <= steps <= stats["steps"] + 1 and stats["steps"] > 0
    assert got[("jaxpipe_kv_tokens_capacity", (("tier", "device"),))] == \
        stats["device_kv_capacity"]
    assert got[("jaxpipe_queue_requests", (("tier", "waiting"),))] == 0
    assert got[("jaxpipe_engine_up", ())] == 1


def test_request_timer_observes_each_latency_once_per_request():
    metrics = ServerMetrics(lambda: None)
    timer = metrics.latency.timer("http")
    timer.tokens(0)  # a delta with no tokens is not the first token
    timer.tokens(1)
    timer.tokens(3)
    timer.finished()
    metrics.latency.timer("http").finished()  # ended before any token: end-to-end only
    got = samples(generate_latest(metrics.registry).decode())
    http = (("front_end", "http"),)
    assert got[("jaxpipe_time_to_first_token_seconds_count", http)] == 1
    assert got[("jaxpipe_time_per_output_token_seconds_count", http)] == 1
    assert got[("jaxpipe_e2e_request_latency_seconds_count", http)] == 2
    assert got[("jaxpipe_e2e_request_latency_seconds_sum", http)] >= \
        got[("jaxpipe_time_to_first_token_seconds_sum", http)] >= 0


def test_collector_says_when_the_engine_does_not_answer():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(lambda: None, Outcomes()))
    got = samples(generate_latest(registry).decode())
    assert got[("jaxpipe_engine_up", ())] == 0


def scrape(server) -> dict:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return samples(resp.read().decode())


def test_server_metrics_follow_a_known_workload(grpc_server):
    """Three streamed requests and one invalid one: the counters move by what the clients
    received (tokens, usage, finish reasons), and agree with GetServerInfo."""
    before = scrape(grpc_server)
    tokens, prompt, reasons, several = 0, 0, {}, 0
    with grpc.insecure_channel(grpc_server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for text in ("One, two,", "Red, green,", "Monday, Tuesday,"):
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=4)
            request_tokens = 0
            for resp in stub.Generate(pb.GenerateRequest(text=text, sampling=sampling),
                                      timeout=300):
                tokens += len(resp.token_ids)
                request_tokens += len(resp.token_ids)
                if resp.finish_reason:
                    several += request_tokens > 1  # those have a time per output token
                    prompt += resp.usage.prompt_tokens
                    reasons[resp.finish_reason] = reasons.get(resp.finish_reason, 0) + 1
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(
                text="x", sampling=pb.SamplingParams(temperature=-1.0)), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        server_info = stub.GetServerInfo(pb.ServerInfoRequest())
    after = scrape(grpc_server)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("jaxpipe_generation_tokens_total") == tokens > 0
    assert moved("jaxpipe_prompt_tokens_total") == prompt > 0
    for reason, n in reasons.items():
        assert moved("jaxpipe_requests_total", outcome=reason) == n
    assert moved("jaxpipe_requests_total", outcome="invalid") == 1
    assert moved("jaxpipe_time_to_first_token_seconds_count", front_end="grpc") == 3
    assert moved("jaxpipe_e2e_request_latency_seconds_count", front_end="grpc") == 3
    assert moved("jaxpipe_time_per_output_token_seconds_count", front_end="grpc") == several
    assert after[("jaxpipe_generation_tokens_total", ())] == server_info.generated_tokens
    assert after[("jaxpipe_engine_up", ())] == 1
    # the engine process built its programs, compiled or from the persistent cache
    programs = {source: after[("jaxpipe_programs", (("source", source),))]
                for source in ("compiled", "cache")}
    assert sum(programs.values()) > 0, programs


def test_collector_renders_the_prefix_cache():
    stats = {"prefix_cache_queried_tokens": 300, "prefix_cache_hit_tokens": 96,
             "prefix_cache_evictions": 5, "prefix_cache_hit_rate": 0.32,
             "prefix_cache_device_hit_tokens": 64, "prefix_cache_host_hit_tokens": 32,
             "prefix_cache_host_stored_blocks": 7, "prefix_cache_host_evictions": 2}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(lambda: stats, Outcomes()))
    got = samples(generate_latest(registry).decode())
    assert got[("jaxpipe_prefix_cache_queried_tokens_total", ())] == 300
    assert got[("jaxpipe_prefix_cache_hit_tokens_total", ())] == 96
    assert got[("jaxpipe_prefix_cache_evictions_total", ())] == 5
    assert got[("jaxpipe_prefix_cache_hit_rate", ())] == pytest.approx(0.32)
    assert got[("jaxpipe_prefix_cache_device_hit_tokens_total", ())] == 64
    assert got[("jaxpipe_prefix_cache_host_hit_tokens_total", ())] == 32
    assert got[("jaxpipe_prefix_cache_host_stored_blocks_total", ())] == 7
    assert got[("jaxpipe_prefix_cache_host_evictions_total", ())] == 2
