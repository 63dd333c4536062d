"""The scripts' flags come from their config dataclasses (jaxpipe_bench/cli.py over
jaxpipe.config.flags): the flag names and commands the scripts' docstrings and the README quote
reach the configs, values they refuse are usage errors, and no script parses by hand."""

import re
from pathlib import Path

import pytest

from jaxpipe.config.engine import EngineConfig
from jaxpipe_bench import cli
from jaxpipe_bench.layouts import LayoutBenchConfig

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _config(argv):
    return cli.parse("", LayoutBenchConfig, argv)


def test_no_flags_give_the_config_defaults():
    assert _config([]) == LayoutBenchConfig()
    assert _config(["--model", "m.gguf", "--out", "o.json"]) == LayoutBenchConfig(
        model="m.gguf", out_path="o.json")
    with pytest.raises(SystemExit):
        _config(["--stages", "0"])


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
    return cli.parse("", config_cls, argv)


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
    from jaxpipe_bench import BenchConfig, _engine_kwargs

    def kwargs(argv):
        return _engine_kwargs(cli.parse("", BenchConfig, argv), [])

    assert "prefix_caching" not in kwargs(["--max-model-len", "64"])  # the engine's default
    assert kwargs(["--max-model-len", "64", "--prefix-caching"])["prefix_caching"] is True
    assert kwargs(["--max-model-len", "64", "--no-prefix-caching"])["prefix_caching"] is False


def test_shared_prefix_reaches_the_workload_and_openvino_caches_as_jaxpipe_does():
    """--shared-prefix builds the shared workload; OpenVINO's job asks for its prefix cache
    exactly when jaxpipe's is on (by default, or --prefix-caching)."""
    from jaxpipe_bench import BenchConfig, _peer_job, bench_workload

    def cfg(*argv):
        return cli.parse("", BenchConfig, list(argv))

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


def test_no_script_parses_its_arguments_by_hand():
    """Every flag of scripts/ comes from a config dataclass."""
    by_hand = [f.name for f in sorted(SCRIPTS.glob("*.py"))
               if re.search(r"add_argument\(|sys\.argv\[|set_defaults\(", f.read_text())]
    assert by_hand == []


def test_the_default_model_and_dtype_are_the_engines():
    from jaxpipe_bench import BenchConfig, calibrate, demo, multihost, schedulers, timeline
    from jaxpipe_bench.structured import StructuredBenchConfig

    for cls in (BenchConfig, LayoutBenchConfig, demo.DemoConfig, multihost.MultihostConfig,
                schedulers.SchedulersConfig, timeline.TimelineConfig,
                StructuredBenchConfig):
        assert (cls().model, cls().dtype) == (EngineConfig().model, EngineConfig().dtype), cls
    assert calibrate.make_engine.__defaults__[0] == EngineConfig().model


def test_the_default_gguf_is_the_default_models():
    from jaxpipe.model.presets import resolve_model
    from jaxpipe_bench.workload import default_gguf_path

    assert default_gguf_path() == resolve_model(EngineConfig().model).path


@pytest.mark.parametrize("module, cls, argv, want", [
    ("attention", "AttentionBenchConfig", ["--tables", "identity,shuffled", "--repeats", "10"],
     {"tables": ("identity", "shuffled"), "repeats": 10}),
    ("attention", "AttentionBenchConfig", ["--cases", "prefill 1x512", "--json", "a.json"],
     {"cases": ("prefill 1x512",), "json_path": "a.json"}),
    ("matmul_kernel", "MatmulKernelConfig", ["--rows", "1,8", "--shapes", "576x3072,64x32"],
     {"rows": (1, 8), "weight_shapes": [(576, 3072), (64, 32)]}),
    ("matmul_kernel", "MatmulKernelConfig", ["--gguf-formats", "q8_0,q4_0", "--gguf-paths", "avx2"],
     {"gguf_formats": ("q8_0", "q4_0"), "gguf_paths": ("avx2",)}),
    ("moe_kernel", "MoeKernelConfig", ["--tokens", "8,64", "--cases", "8x2x256x512",
                                       "--ragged-max-gflop", "5"],
     {"tokens": (8, 64), "expert_shapes": [(8, 2, 256, 512)], "ragged_max_gflop": 5.0}),
    ("ep_exchange", "EpExchangeConfig", ["--ep", "8", "--tokens", "8,64,512",
                                         "--capacity-factor", "1.5"],
     {"ep": 8, "tokens": (8, 64, 512), "capacity_factor": 1.5, "path": None}),
    ("sampler", "SamplerBenchConfig", ["--rows", "64", "256", "--threads", "2", "--repeats", "9"],
     {"rows": (64, 256), "threads": 2, "repeats": 9}),
    ("calibrate", "CalibrateConfig", ["--json", "c.json", "--write-preset"],
     {"json_path": "c.json", "write_preset": True, "repeats": 5}),
    ("convert", "ConvertConfig", ["smollm2-135m", "out/orbax", "--dtype", "bfloat16"],
     {"model": "smollm2-135m", "output": "out/orbax", "dtype": "bfloat16"}),
    ("demo", "DemoConfig", ["--max-tokens", "8", "--dtype", "float32"],
     {"max_tokens": 8, "dtype": "float32"}),
    ("checkpoint", "CheckpointConfig", ["out/qwen2-05b", "--family", "qwen2"],
     {"out": "out/qwen2-05b", "family": "qwen2", "seed": 0}),
    ("rebuild", "RebuildConfig", ["--meshes", "cpu-8", "cpu-1", "cpu-8", "--requests", "32"],
     {"meshes": ("cpu-8", "cpu-1", "cpu-8"), "requests": 32, "devices": 8}),
    ("reproduce", "ReproduceConfig", ["--json", "g.json", "--quick", "--num-requests", "100"],
     {"json_path": "g.json", "quick": True, "num_requests": 100}),
    ("lock_drift", "LockDriftConfig", ["requirements/test.lock"],
     {"lock": "requirements/test.lock"}),
    ("structured", "StructuredBenchConfig", ["--num-prompts", "512", "--json-path", "s.json",
                                             "--temperature", "1", "--output-len", "32",
                                             "--match-lengths"],
     {"num_prompts": 512, "json_path": "s.json", "temperature": 1.0, "output_len": 32,
      "match_lengths": True, "max_num_seqs": 256, "repeats": 3}),
])
def test_the_scripts_documented_flags_reach_their_configs(module, cls, argv, want):
    import importlib

    config = cli.parse("", getattr(importlib.import_module(f"jaxpipe_bench.{module}"), cls),
                       argv)
    for name, value in want.items():
        got = getattr(config, name)
        assert (got() if callable(got) else got) == value, name


@pytest.mark.parametrize("module, cls, argv, message", [
    ("attention", "AttentionBenchConfig", ["--tables", "random"], "invalid choice: 'random'"),
    ("matmul_kernel", "MatmulKernelConfig", ["--shapes", "576"],
     "MatmulKernelConfig.shapes: '576' is not 2 positive integers NxN"),
    ("matmul_kernel", "MatmulKernelConfig", ["--gguf-formats", "q5_k"],
     "MatmulKernelConfig.gguf_formats must be one or more of ['q8_0', 'q4_0', 'q4_1', "
     "'q4_k', 'q6_k']"),
    ("moe_kernel", "MoeKernelConfig", ["--cases", "8x2x256"], "is not 4 positive integers"),
    ("ep_exchange", "EpExchangeConfig", ["--capacity-factor", "0"],
     "EpExchangeConfig.capacity_factor must be > 0"),
    ("sampler", "SamplerBenchConfig", ["--rows", "0"],
     "SamplerBenchConfig.rows must be one or more integers >= 1"),
    ("convert", "ConvertConfig", ["only-the-model"], "the following arguments are required"),
    ("checkpoint", "CheckpointConfig", ["out/x", "--family", "gpt2"], "invalid choice"),
    ("rebuild", "RebuildConfig", ["--meshes", "h100x8-nvlink"],
     "RebuildConfig.meshes must be one or more cpu-N presets"),
    ("reproduce", "ReproduceConfig", ["--num-requests", "0"],
     "ReproduceConfig.num_requests must be an integer >= 1"),
    ("structured", "StructuredBenchConfig", ["--temperature", "-1"],
     "StructuredBenchConfig.temperature must be in [0, 2], got -1.0"),
])
def test_a_value_a_script_refuses_is_a_usage_error(module, cls, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as info:
        cli.parse("", getattr(importlib.import_module(f"jaxpipe_bench.{module}"), cls), argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_reproductions_quick_runs_a_quarter_of_the_requests():
    from jaxpipe_bench.reproduce import ReproduceConfig

    assert ReproduceConfig().requests(2000) == 2000
    assert ReproduceConfig(quick=True).requests(2000) == 500
    assert ReproduceConfig(quick=True, num_requests=100).requests(2000) == 25


def test_soak_flags_minutes_server_args_and_the_scripts_request_cap():
    from jaxpipe_bench.soak import SoakConfig
    from jaxpipe_bench.soak_server import MAX_REQUESTS, parse

    config, command = parse("", ["--minutes", "2", "--kill-at", "-1", "--clients", "8", "--",
                                 "--max-num-seqs", "8", "--scheduler", "a,b"])
    assert (config.seconds, config.kill_at, config.clients) == (120.0, None, 8)
    assert command.server_args == ("--max-num-seqs", "8", "--scheduler", "a,b")
    assert config.max_requests == MAX_REQUESTS != SoakConfig().max_requests
    config, command = parse("", ["--max-requests", "5", "--json", "s.json", "--no-kill"])
    assert (config.max_requests, config.kill_at, command.json_path) == (5, None, "s.json")
    assert (config.seconds, command.server_args) == (SoakConfig().seconds, ())


def test_reshard_profile_and_reproduce_moe_defaults_show_in_help():
    import argparse

    from jaxpipe.config.flags import add_flags
    from jaxpipe_bench import BenchConfig, profile, reproduce_moe
    from jaxpipe_bench.reproduce import ReproduceConfig

    for cls, default in ((BenchConfig, profile.JSON_PATH),
                         (ReproduceConfig, reproduce_moe.JSON_PATH)):
        p = argparse.ArgumentParser()
        add_flags(p, cls, defaults={"json_path": default})
        assert f"(default: {default})" in " ".join(p.format_help().split())
        assert cli.parse("", cls, [], defaults={"json_path": default}).json_path == default
