"""Peers of the throughput benchmark: --peers parsing, best-of-sweep, the OpenVINO peer's pure
helpers and the report with three engines. Nothing here imports openvino."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxpipe_bench import BenchConfig, parse_peers
from jaxpipe_bench.report import best_point, render
from jaxpipe_bench.workload import Request
from jaxpipe_peers import openvino as ov

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_throughput.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_throughput", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_peers_orders_and_checks_names():
    assert parse_peers("hf, openvino") == ("openvino", "hf")
    assert parse_peers("llamacpp,hf") == ("hf", "llamacpp")
    assert parse_peers("hf") == ("hf",)
    assert parse_peers("") == ()
    with pytest.raises(ValueError, match="vllm"):
        parse_peers("openvino,vllm")


def test_flags_choose_the_peers():
    parse = _script().parse_config
    assert parse([]).active_peers == ("hf",)  # today's default
    assert parse(["--peers", "openvino,hf"]).active_peers == ("openvino", "hf")
    assert parse(["--peers", "openvino,hf", "--skip-hf"]).active_peers == ("openvino",)
    assert parse(["--ov-batched-tokens", "256,2048"]).ov_batched_tokens == (256, 2048)
    cfg = parse(["--peers", "llamacpp", "--llamacpp-threads", "1,2", "--llamacpp-max-seqs", "8"])
    assert (cfg.active_peers, cfg.llamacpp_threads, cfg.llamacpp_max_seqs) == (
        ("llamacpp",), (1, 2), (8,))
    with pytest.raises(SystemExit):  # a step must fit every running sequence's token
        parse(["--llamacpp-max-seqs", "64", "--llamacpp-batch-tokens", "32"])
    with pytest.raises(SystemExit):
        parse(["--peers", "tgi"])
    with pytest.raises(SystemExit):
        parse(["--skip-jaxpipe", "--skip-hf"])


def test_config_rejects_unknown_peer():
    with pytest.raises(ValueError, match="choose from"):
        BenchConfig(peers=("openvino", "vllm"))


def test_best_point_is_highest_output_rate():
    points = [{"output_tok_s": 5.0, "k": 1}, {"output_tok_s": 9.0, "k": 2},
              {"output_tok_s": 9.0, "k": 3}]
    assert best_point(points)["k"] == 2
    with pytest.raises(ValueError):
        best_point([])


def test_clear_gguf_quantization_leaves_a_dense_model():
    config = SimpleNamespace(quantization_config={"quant_method": "gguf"}, hidden_size=7)
    model = SimpleNamespace(config=config, hf_quantizer=object(), quantization_config=1)
    ov.clear_gguf_quantization(model)
    assert model.hf_quantizer is None
    assert not hasattr(model, "quantization_config")
    assert not hasattr(config, "quantization_config") and config.hidden_size == 7


def test_cache_dir_is_keyed_by_name_and_size(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"x" * 13)
    assert ov.peer_cache_dir(gguf, tmp_path / "peers") == tmp_path / "peers" / "m.Q4_1-13"


def test_openvino_prefix_caching_is_a_scheduler_setting():
    work = [Request((1,) * 10, 5)]
    assert ov.scheduler_settings(work, 256, 8, 100)["enable_prefix_caching"] is False
    assert ov.scheduler_settings(work, 256, 8, 100, True)["enable_prefix_caching"] is True


def test_kv_pool_size():
    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "hidden_size": 576}
    per_token = ov.kv_bytes_per_token(smollm2, "bf16")
    assert per_token == 2 * 30 * 3 * 64 * 2
    assert ov.kv_bytes_per_token(smollm2, "u8") * 2 == per_token
    small = [Request((1,) * 100, 100)] * 8
    assert ov.cache_size_gb(small, per_token, 256) == 1  # clamped up
    big = [Request((1,) * 1000, 500)] * 300  # 256 x 1500 x 23040 B x 1.25 = 10.3 GiB
    assert ov.cache_size_gb(big, per_token, 256) == 8  # clamped down
    assert ov.cache_size_gb(big, per_token, 64) == 3  # only max_num_seqs run at once


def test_report_shows_every_engine_and_a_ratio_per_peer():
    def row(engine, rate, **extra):
        return {"engine": engine, "dtype": "bfloat16", "batch_size": 8, "num_requests": 8,
                "requests_per_s": rate / 10, "total_tok_s": rate * 3, "output_tok_s": rate,
                "elapsed_s": 1.0, **extra}

    ov_points = [row("openvino", 40.0, max_num_batched_tokens=256),
                 row("openvino", 50.0, max_num_batched_tokens=512)]
    llama = row("llamacpp", 20.0, threads=2, max_num_batched_tokens=2048)
    result = {"jaxpipe": row("jaxpipe", 25.0, max_num_batched_tokens=4096),
              "openvino": {"points": ov_points, "best": ov_points[1]},
              "hf": {"points": [row("hf", 10.0)], "best": row("hf", 10.0)},
              "llamacpp": {"points": [llama], "best": llama}}
    result["jaxpipe"].update(prefix_caching=True, prefix_cache_hit_rate=0.8125)
    ov_points[0]["prefix_caching"] = True
    text = render(result)
    assert [line.split()[0] for line in text.splitlines()[3:8]] == [
        "jaxpipe", "openvino", "openvino", "hf", "llamacpp"]
    assert [line[-13:].strip() for line in text.splitlines()[3:7]] == [  # the last column
        "81.2% hit", "on", "-", "-"]
    assert "jaxpipe / OpenVINO (batched tokens 512): requests/s 0.50x" in text
    assert "jaxpipe / HF (batch 8): requests/s 2.50x" in text
    assert "jaxpipe / llama.cpp (2 threads, 8 sequences): requests/s 1.25x" in text


def test_engine_fields_are_jaxpipe_runs_each_named_and_compared():
    def row(engine, rate, **extra):
        return {"engine": engine, "dtype": "bfloat16", "batch_size": 8, "num_requests": 8,
                "requests_per_s": rate / 10, "total_tok_s": rate * 3, "output_tok_s": rate,
                "elapsed_s": 1.0, **extra}

    ov = row("openvino", 40.0, max_num_batched_tokens=512, weight_format="int8")
    result = {"jaxpipe": row("jaxpipe", 20.0, fields={"quantization": "none"}),
              "jaxpipe_variants": [row("jaxpipe", 30.0, fields={"quantization": "int8"})],
              "openvino": {"points": [ov], "best": ov}}
    lines = render(result).splitlines()
    assert "quantization=int8" in lines[4] and "weights int8" in lines[5]
    assert ("jaxpipe quantization=int8 / jaxpipe (quantization=none): requests/s 1.50x, "
            "total tok/s 1.50x, output tok/s 1.50x" in lines)
    assert ("jaxpipe quantization=none / OpenVINO (batched tokens 512, weights int8): "
            "requests/s 0.50x, total tok/s 0.50x, output tok/s 0.50x" in lines)
    assert any(line.startswith("jaxpipe quantization=int8 / OpenVINO") and "0.75x" in line
               for line in lines)


def test_engine_fields_flag_is_repeated_and_checked():
    parse = _script().parse_config
    cfg = parse(["--engine-field", "attention=xla,kernel", "--engine-field", "overlap=false"])
    assert cfg.engine_fields == ("attention=xla,kernel", "overlap=false")
    with pytest.raises(SystemExit):
        parse(["--engine-field", "no_such_field=1"])
    from jaxpipe_bench.engine_fields import field_choices

    assert field_choices(cfg.engine_fields) == [
        {"attention": "xla", "overlap": False}, {"attention": "kernel", "overlap": False}]
    assert field_choices(()) == [{}]


# -- the peers' own environment ----------------------------------------------------------------


def test_report_names_the_cpu_its_isa_and_the_kernels_jaxpipe_ran():
    machine = {"cpu_model": "AMD EPYC", "cpu_count": 2, "isa": ["avx2", "fma"],
               "kernel_paths": ["portable", "avx2"]}
    kernels = {"attention": "kernel",
               "matmul": {"wq": {"1": "portable", "8": "avx2"}, "lm_head": {"1": "xla"}}}
    result = {"machine": machine, "jaxpipe": {"engine_stats": {"kernels": kernels}}}
    assert render(result).splitlines()[0] == (
        "CPU: AMD EPYC x 2 (avx2, fma); bf16 kernel paths: portable, avx2; jaxpipe ran "
        "matmuls on avx2, portable, xla, attention on kernel")


def test_kv_cache_follows_the_cpu_plugins_bf16():
    assert ov.default_kv_precision("bfloat16", ["FP32", "BF16", "INT8"]) == "bf16"
    # OpenVINO's AVX2 executor refuses a bf16 cache ("expect kvcache type f32")
    assert ov.default_kv_precision("bfloat16", ["FP32", "INT8"]) == "f32"
    assert ov.default_kv_precision("float32", ["FP32", "BF16"]) == "f32"


def test_openvino_ir_is_exported_and_cached_per_weight_format(tmp_path, monkeypatch):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    commands = []

    def fake_export(cmd, check):  # optimum-cli's output: the three IR files in its last arg
        commands.append(cmd)
        out = Path(cmd[-1])
        out.mkdir(parents=True)
        for name in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml"):
            (out / name).write_text("")

    monkeypatch.setattr(ov, "require", lambda module: None)
    monkeypatch.setattr(ov.subprocess, "run", fake_export)
    monkeypatch.setattr(ov, "peer_cache_dir", lambda model, root=None: tmp_path / "cache")
    quiet = lambda line: None  # noqa: E731
    int8 = ov.ensure_ir(hf_dir, quiet, weight_format="int8")
    fp16 = ov.ensure_ir(hf_dir, quiet)
    assert ov.ensure_ir(hf_dir, quiet, weight_format="int8") == int8  # cached: no export
    assert (int8.name, fp16.name) == ("openvino-int8", "openvino-fp16")
    formats = [cmd[cmd.index("--weight-format") + 1] for cmd in commands]
    assert formats == ["int8", "fp16"]
    with pytest.raises(ValueError, match=r"fp16, int8; got 'int4'"):
        ov.ensure_ir(hf_dir, quiet, weight_format="int4")


def test_openvino_job_carries_the_weight_format():
    from jaxpipe_bench import _peer_job

    workload = [Request((1, 2, 3), 4)]
    job = _peer_job(BenchConfig(ov_weight_format="int8", peers=("openvino",)), "openvino",
                    workload, Path("m.gguf"))
    assert job["weight_format"] == "int8"
    with pytest.raises(ValueError):
        BenchConfig(ov_weight_format="int4")


def test_peers_package_imports_nothing_of_jaxpipe():
    # Its environment has no jax: one `import jaxpipe` there and every peer fails.
    import ast

    import jaxpipe_peers

    for path in Path(jaxpipe_peers.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] == "jaxpipe"], path


def test_peer_env_is_built_once_per_lock_and_cpu(tmp_path, monkeypatch):
    from jaxpipe_bench import peers

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd[1:3] if cmd[1] == "-m" else cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    lock, venv = tmp_path / "peers.lock", tmp_path / "venv"
    lock.write_text("transformers==5.5.4\n")
    python = peers.ensure_env(lambda _: None, venv, lock, flags={"avx2"})
    assert python == venv / "bin" / "python"
    assert calls == [["-m", "venv"], ["-m", "pip"]]
    peers.ensure_env(lambda _: None, venv, lock, flags={"avx2"})
    assert len(calls) == 2  # current: nothing runs
    lock.write_text("transformers==5.5.5\n")
    peers.ensure_env(lambda _: None, venv, lock, flags={"avx2"})
    assert calls[2:] == [["-m", "pip"]]  # a new lock reinstalls into the same venv
    logged = []
    peers.ensure_env(logged.append, venv, lock, flags={"avx2", "avx512f"})
    assert calls[3:] == [["-m", "pip"]] and "not built for this CPU" in logged[0]  # rebuilt
    with pytest.raises(FileNotFoundError, match="make lock"):
        peers.ensure_env(lambda _: None, venv, tmp_path / "missing.lock")


def test_llama_cpp_is_built_here_never_taken_from_pips_wheel_cache(tmp_path, monkeypatch):
    """pip caches a wheel it built by the package's version alone, whatever CPU and options
    built it: the lock's llama-cpp-python is built first, without the cache, then the lock."""
    from jaxpipe_bench import peers

    calls = []
    monkeypatch.setattr(peers.subprocess, "run", lambda cmd, env=None: (
        calls.append(cmd[4:]), SimpleNamespace(returncode=0))[1])
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    lock = tmp_path / "peers.lock"
    lock.write_text("jinja2==3.1.6\n    # via x\nllama-cpp-python==0.3.36\n    # via y\n")
    peers.ensure_env(lambda _: None, tmp_path / "venv", lock, flags={"avx2"})
    assert calls == [["-q", "--no-cache-dir", "--force-reinstall", "--no-deps",
                      "llama-cpp-python==0.3.36"], ["-q", "-r", str(lock)]]


def test_a_failing_peer_names_itself():
    import sys

    from jaxpipe_bench.peers import run_peer

    with pytest.raises(RuntimeError, match="the llamacpp peer failed"):
        run_peer({"peer": "llamacpp", "requests": []}, lambda _: None, Path(sys.executable))


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A 3-layer random Llama with SmolLM2's tokenizer, written as an HF directory."""
    import json

    transformers = pytest.importorskip("transformers")
    from conftest import GGUF_FILE, gguf_dir
    from test_checkpoint import TINY

    from jaxpipe.model.tokenizer import Tokenizer
    from jaxpipe_bench.checkpoint import hf_config, tensor_shapes, write_safetensors

    out = tmp_path_factory.mktemp("tiny_hf")
    tok = Tokenizer.from_gguf(gguf_dir() / GGUF_FILE)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend,
                                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    hf_tok.save_pretrained(out)
    vocab = tok.vocab_size
    config = hf_config(TINY, vocab, tok.bos_token_id, tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config))
    write_safetensors(out / "model.safetensors", tensor_shapes(TINY, vocab), seed=3)
    return out


def test_hf_peer_runs_a_job_through_files(tiny_hf_dir):
    # The protocol end to end: a job file in, a child process (here the test environment's
    # Python, which has torch and transformers), a result file out.
    import importlib.metadata
    import sys

    from jaxpipe_bench.peers import run_peer
    from jaxpipe_peers.protocol import requests_to_json

    requests = [Request((5, 6, 7), 3), Request((8, 9), 5), Request((10, 11, 12, 13), 2)]
    job = {"peer": "hf", "model": str(tiny_hf_dir), "dtype": "float32",
           "requests": requests_to_json(requests), "batch_sizes": [2, 3]}
    result = run_peer(job, lambda _: None, Path(sys.executable))
    assert [p["batch_size"] for p in result["points"]] == [2, 3]
    assert all(p["num_requests"] == 3 and p["output_tokens"] == 10 for p in result["points"])
    assert result["best"] in result["points"]
    assert result["versions"]["transformers"] == importlib.metadata.version("transformers")


def test_a_rollout_request_travels_with_its_samples():
    from jaxpipe_peers.protocol import requests_from_json, requests_to_json

    requests = [Request((1, 2), 3, samples=8), Request((4,), 2)]
    rows = requests_to_json(requests)
    assert rows[1] == [[4], 2]  # a plain request keeps the old spelling
    assert requests_from_json(rows) == requests


def test_openvino_samples_a_rollout_and_decodes_the_rest_greedily():
    genai = SimpleNamespace(GenerationConfig=SimpleNamespace)
    rollout = ov._generation_config(genai, Request((1,), 7, samples=8), seed=3)
    assert (rollout.do_sample, rollout.num_return_sequences, rollout.rng_seed) == (True, 8, 3)
    assert (rollout.temperature, rollout.max_new_tokens, rollout.min_new_tokens) == (1.0, 7, 7)
    greedy = ov._generation_config(genai, Request((1,), 7), seed=3)
    assert greedy.do_sample is False and not hasattr(greedy, "num_return_sequences")


def test_the_kv_pool_counts_every_sample():
    per_token = 1 << 16  # 4 x 2000 tokens x 1.25: 0.6 GiB -> 1; with 8 samples 2.9 GiB -> 3
    one = ov.cache_size_gb([Request((1,) * 1000, 1000)] * 4, per_token, 4)
    eight = ov.cache_size_gb([Request((1,) * 1000, 1000, samples=8)] * 4, per_token, 4)
    assert (one, eight) == (1, 3)


def test_hf_runs_a_rollout_one_row_per_sample(tiny_hf_dir):
    from jaxpipe_peers.hf import run_hf

    result = run_hf([Request((5, 6, 7), 3, samples=3), Request((8, 9), 3)], 8, "float32",
                    str(tiny_hf_dir), None)
    assert (result["num_requests"], result["output_tokens"]) == (4, 12)
    assert result["computed_token_slots"] == 4 * (3 + 3)  # one batch of 4 rows, padded to 3


def test_llama_cpp_is_built_without_amx_on_an_amx_cpu(tmp_path, monkeypatch):
    """On a CPU with AMX the peers' pip install builds llama.cpp with the CPU's other
    extensions named and AMX off (its AMX path stopped on an illegal instruction on an AMX
    Xeon); elsewhere it keeps llama-cpp-python's own -march=native; a CMAKE_ARGS the user
    set is kept."""
    from jaxpipe_bench import peers

    xeon = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
            "amx_int8", "amx_bf16"}
    args = peers.llama_cmake_args(xeon).split()
    assert args[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
            "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF"} <= set(args)
    assert "-DGGML_AVX_VNNI=ON" not in args  # not among the flags
    assert peers.llama_cmake_args({"avx", "avx2", "avx512f", "avx512_bf16"}) is None

    seen = []
    monkeypatch.setattr(peers.subprocess, "run", lambda cmd, env=None: (
        seen.append((env or {}).get("CMAKE_ARGS")), SimpleNamespace(returncode=0))[1])
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    lock = tmp_path / "peers.lock"
    for i, (flags, user) in enumerate([(xeon, None), ({"avx2"}, None), (xeon, "-DX=1")]):
        lock.write_text(f"llama-cpp-python==0.3.{i}\n")  # a new lock each time: a build
        monkeypatch.delenv("CMAKE_ARGS", raising=False)
        if user:
            monkeypatch.setenv("CMAKE_ARGS", user)
        peers.ensure_env(lambda _: None, tmp_path / "venv", lock, flags=flags)
    # Each build: llama-cpp-python alone, then the lock, with the same CMAKE_ARGS.
    assert seen == [arg for arg in (peers.llama_cmake_args(xeon), None, "-DX=1") for _ in "ab"]

