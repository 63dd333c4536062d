"""Benchmark flags come from the bench config dataclasses (jaxpipe_bench/cli.py over
jaxpipe.config_flags)."""

import pytest

from jaxpipe.config_flags import config_from_args
from jaxpipe_bench import cli
from jaxpipe_bench.layouts import LayoutBenchConfig


def _config(argv):
    p = cli.parser("", LayoutBenchConfig, "out/x.json")
    return config_from_args(LayoutBenchConfig, p.parse_args(argv), p)


def test_no_flags_give_the_config_defaults():
    assert _config([]) == LayoutBenchConfig()


def test_flags_reach_the_config():
    cfg = _config(["--stages", "1", "2", "--context", "512", "--dtype", "float32"])
    assert cfg.stages == (1, 2) and cfg.context == 512 and cfg.dtype == "float32"
    assert _config(["--stages", "1,2,4"]).stages == (1, 2, 4)


def test_nested_tuple_fields_are_not_flags():
    with pytest.raises(SystemExit):
        _config(["--pairs", "x"])
    assert _config([]).pairs == LayoutBenchConfig().pairs


def test_dtype_is_checked():
    with pytest.raises(SystemExit):
        _config(["--dtype", "int8"])


def _parsed(config_cls, argv):
    import argparse

    from jaxpipe.config_flags import add_flags

    p = argparse.ArgumentParser()
    add_flags(p, config_cls)
    return config_from_args(config_cls, p.parse_args(argv), p)


def test_schedulers_runs_flag_is_parsed_and_checked():
    from jaxpipe_bench.schedulers import RunSpec, SchedulersConfig

    cfg = _parsed(SchedulersConfig, ["--runs", "seesaw:pp=2,tp=4:tp=8", "--host-kv-tokens", "64"])
    assert cfg.run_specs() == [RunSpec("seesaw", "pp=2,tp=4", "tp=8")]
    assert cfg.engine_kwargs()["host_kv_tokens"] == 64
    assert len(_parsed(SchedulersConfig, []).run_specs()) == 3
    with pytest.raises(ValueError, match="'seesaw' is not policy:prefill-layout:decode-layout"):
        SchedulersConfig(runs="seesaw")
    with pytest.raises(SystemExit):
        _parsed(SchedulersConfig, ["--runs", "pp=8:tp=8"])


def test_timeline_variants_are_checked():
    from jaxpipe_bench.timeline import TimelineConfig

    assert _parsed(TimelineConfig, ["--variants", "baseline", "+detok"]).variants == (
        "baseline", "+detok")
    assert _parsed(TimelineConfig, ["--variants", "+overlap,host-sampler"]).variants == (
        "+overlap", "host-sampler")
    with pytest.raises(ValueError, match=r"TimelineConfig.variants must be one or more of"):
        TimelineConfig(variants=("fast",))


def test_multihost_flags_reach_the_config():
    from jaxpipe_bench.multihost import MultihostConfig

    cfg = _parsed(MultihostConfig, ["--num-prompts", "64", "--prefill", "pp=8", "--input-len",
                                    "32"])
    assert cfg == MultihostConfig(num_prompts=64, prefill="pp=8", input_len=32)


def test_prefix_caching_reaches_the_throughput_engine():
    """scripts/bench_throughput.py's flag, as it builds its parser."""
    import argparse

    from jaxpipe.config_flags import add_flags
    from jaxpipe_bench import BenchConfig, _engine_kwargs

    def kwargs(argv):
        p = argparse.ArgumentParser()
        add_flags(p, BenchConfig, group="benchmark")
        return _engine_kwargs(config_from_args(BenchConfig, p.parse_args(argv), p), [])

    assert "prefix_caching" not in kwargs(["--max-model-len", "64"])  # the engine's default
    assert kwargs(["--max-model-len", "64", "--prefix-caching"])["prefix_caching"] is True
    assert kwargs(["--max-model-len", "64", "--no-prefix-caching"])["prefix_caching"] is False


def test_shared_prefix_reaches_the_workload_and_openvino_caches_as_jaxpipe_does():
    """--shared-prefix builds the shared workload; OpenVINO's job asks for its prefix cache
    exactly when jaxpipe's is on (by default, or --prefix-caching)."""
    import argparse

    from jaxpipe.config_flags import add_flags
    from jaxpipe_bench import BenchConfig, _peer_job, bench_workload

    p = argparse.ArgumentParser()
    add_flags(p, BenchConfig, group="benchmark")

    def cfg(*argv):
        return config_from_args(BenchConfig, p.parse_args(list(argv)), p)

    workload, prefixes = bench_workload(cfg("--num-prompts", "6", "--shared-prefix", "2:20-30"),
                                        1000, ())
    assert len(workload) == 6 and len(prefixes) == 2
    assert all(any(r.prompt_token_ids[:len(x)] == x for x in prefixes) for r in workload)
    assert bench_workload(cfg("--num-prompts", "6"), 1000, ())[1] == []
    with pytest.raises(SystemExit):
        cfg("--shared-prefix", "2:30-20")
    job = _peer_job(cfg(), "openvino", workload, "m.gguf")
    assert job["prefix_caching"] is True
    assert _peer_job(cfg("--no-prefix-caching"), "openvino", workload, "m")["prefix_caching"] \
        is False
