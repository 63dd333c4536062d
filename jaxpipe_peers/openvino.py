"""OpenVINO GenAI peer: continuous batching with paged attention over the benchmark workload.

The strongest CPU serving engine we know of, run on the same weights as jaxpipe and HF: the
workload's GGUF is dequantized by transformers to a float32 HF checkpoint, then exported by
optimum-intel to an fp16 OpenVINO IR (plus the OpenVINO tokenizer/detokenizer the pipeline
loads). Both are cached under `~/.cache/jaxpipe/peers/` keyed by the GGUF's name and size.

An HF directory (config.json + safetensors + tokenizer; `scripts/make_checkpoint.py`) is
exported as it is, with no dequantizing step.

Requests go in as the workload's own token ids (`ContinuousBatchingPipeline.generate` on
`ov.Tensor`s, one GenerationConfig per request), greedy, ignore_eos, exactly output_len new
tokens each. `LLMPipeline(..., scheduler_config=...)` wraps the same engine but takes one
GenerationConfig per call, which cannot express per-request output lengths.

The KV cache is kept in the compute dtype, as jaxpipe keeps it, unless OpenVINO's CPU plugin
says it has no bf16 (`OPTIMIZATION_CAPABILITIES`; its AVX2 paged-attention executor refuses a
bf16 cache with "expect kvcache type f32"): then f32, and the result says so.

openvino, openvino_genai, transformers and torch are imported only inside the functions here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxpipe_peers.protocol import Request, best_point, throughput

Log = Callable[[str], None]

DEFAULT_BATCHED_TOKENS = (256, 512, 2048)
_INSTALL_HINT = "make bench-env (the peers' environment, from requirements/peers.lock)"
# --dtype -> OpenVINO's INFERENCE_PRECISION_HINT / KV_CACHE_PRECISION spelling.
_OV_PRECISION = {"bfloat16": "bf16", "float32": "f32"}
KV_CACHE_PRECISIONS = ("bf16", "f32", "u8")
_CACHE_GB_BOUNDS = (1, 8)  # the KV pool never below 1 GB nor above 8 GB of this 24 GB machine


def require(module: str) -> Any:
    """Import `module`, or fail with a message naming the `bench` extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"the OpenVINO peer needs {module!r}, which is not importable ({exc}); "
            f"it lives in the peers' environment: {_INSTALL_HINT}"
        ) from exc


def peer_cache_dir(model: Path, root: Path | None = None) -> Path:
    """Where the converted checkpoints of `model` (a GGUF file or an HF directory) live:
    `<root>/<stem>-<size bytes>` (an HF directory: the size of its files).

    The size is in the key so that a different model under the same name is converted afresh.
    """
    root = root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxpipe/peers"
    size = (sum(f.stat().st_size for f in model.iterdir() if f.is_file()) if model.is_dir()
            else model.stat().st_size)
    return root / f"{model.stem}-{size}"


def clear_gguf_quantization(model: Any) -> None:
    """Drop the GGUF quantizer and its config from a dequantized HF model, so that
    `save_pretrained` writes a plain dense checkpoint that exporters load as such."""
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None


def _export_hf(gguf_path: Path, hf_dir: Path, log: Log) -> None:
    """GGUF -> float32 HF checkpoint + tokenizer in `hf_dir` (written aside, then renamed)."""
    torch = require("torch")
    transformers = require("transformers")
    log(f"[openvino] dequantizing {gguf_path.name} to a float32 HF checkpoint in {hf_dir}")
    kwargs = dict(gguf_file=gguf_path.name, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **kwargs)
    clear_gguf_quantization(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(hf_dir)


WEIGHT_FORMATS = ("fp16", "int8")  # optimum-cli export openvino --weight-format


def _export_ir(hf_dir: Path, ir_dir: Path, log: Log, weight_format: str = "fp16") -> None:
    """HF checkpoint -> OpenVINO IR with tokenizer/detokenizer, via `optimum-cli export
    openvino` in a child process (its tracing memory is gone before anything is timed).
    `weight_format` "fp16", or "int8": NNCF's weight compression (int8 codes per output
    channel, OpenVINO's default for LLMs; its CPU plugin multiplies them without expanding)."""
    require("optimum.exporters.openvino")
    require("openvino_tokenizers")
    tmp = ir_dir.with_name(ir_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "optimum.commands.optimum_cli",
        "export",
        "openvino",
        "--weight-format",
        weight_format,
        "--task",
        "text-generation-with-past",
        "--model",
        str(hf_dir),
        str(tmp),
    ]
    log(f"[openvino] exporting the IR: {' '.join(cmd[2:])}")
    subprocess.run(cmd, check=True)
    for name in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml"):
        if not (tmp / name).exists():
            raise RuntimeError(f"optimum-cli wrote no {name} in {tmp}; see its output above")
    tmp.rename(ir_dir)


def ensure_hf(model: Path, log: Log = print, root: Path | None = None) -> Path:
    """The float32 HF checkpoint of `model`: itself when it is an HF directory, else its GGUF
    dequantized once into the peers' cache (also what scripts/eval_harness.py's HF run reads)."""
    if model.is_dir():
        return model
    base = peer_cache_dir(model, root)
    hf_dir = base / "hf-float32"
    if not (hf_dir / "config.json").exists():
        base.mkdir(parents=True, exist_ok=True)
        _export_hf(model, hf_dir, log)
    return hf_dir


def ensure_ir(model: Path, log: Log = print, root: Path | None = None,
              weight_format: str = "fp16") -> Path:
    """The cached OpenVINO IR directory for `model` (a GGUF file, dequantized to an HF
    checkpoint first, or an HF directory) with its weights as `weight_format`, converting
    what is missing."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"OpenVINO weight format must be one of {', '.join(WEIGHT_FORMATS)}; "
                         f"got {weight_format!r}")
    ir_dir = peer_cache_dir(model, root) / f"openvino-{weight_format}"
    if (ir_dir / "openvino_model.xml").exists():
        log(f"[openvino] reusing the cached IR in {ir_dir}")
        return ir_dir
    start = time.perf_counter()
    _export_ir(ensure_hf(model, log, root), ir_dir, log, weight_format)
    log(f"[openvino] converted in {time.perf_counter() - start:.1f}s")
    return ir_dir


def kv_bytes_per_token(hf_config: dict, kv_precision: str) -> int:
    """Bytes of K and V one token occupies across all layers (u8 counted as 1 byte per value)."""
    heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    head_dim = (
        hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    width = {"bf16": 2, "f32": 4, "u8": 1}[kv_precision]
    return 2 * hf_config["num_hidden_layers"] * heads * head_dim * width


def cache_size_gb(workload: Sequence[Request], bytes_per_token: int, max_num_seqs: int) -> int:
    """KV pool size in whole GB: room for the `max_num_seqs` longest requests at full length
    with 25% slack for block rounding, clamped to `_CACHE_GB_BOUNDS`."""
    lengths = sorted((r.prompt_len + r.output_len * r.samples for r in workload), reverse=True)
    need = 1.25 * sum(lengths[:max_num_seqs]) * bytes_per_token / 2**30
    return int(min(max(-(-need // 1), _CACHE_GB_BOUNDS[0]), _CACHE_GB_BOUNDS[1]))


def _generation_config(genai: Any, request: Request, seed: int) -> Any:
    """Never stopping early: exactly `output_len` new tokens; greedy, or `samples` > 1
    sequences drawn at temperature 1 (multinomial) seeded with `seed`."""
    cfg = genai.GenerationConfig()
    cfg.do_sample = request.samples > 1
    if cfg.do_sample:
        cfg.temperature, cfg.top_p, cfg.top_k = 1.0, 1.0, 0
        cfg.num_return_sequences, cfg.rng_seed = request.samples, seed
    cfg.ignore_eos = True
    cfg.max_new_tokens = request.output_len
    cfg.min_new_tokens = request.output_len
    return cfg


def _generate(pipe: Any, requests: Sequence[Request]) -> None:
    """Generate `requests` from their token ids; raise unless each got exactly output_len."""
    import numpy as np

    ov, genai = require("openvino"), require("openvino_genai")
    ids = [ov.Tensor(np.asarray([r.prompt_token_ids], dtype=np.int64)) for r in requests]
    configs = [_generation_config(genai, r, i) for i, r in enumerate(requests)]
    results = pipe.generate(ids, configs)
    if len(results) != len(requests):
        raise RuntimeError(f"OpenVINO returned {len(results)} results for {len(requests)}")
    for i, (res, req) in enumerate(zip(results, requests, strict=True)):
        got = [len(ids) for ids in res.m_generation_ids]
        if got != [req.output_len] * req.samples:
            raise RuntimeError(f"OpenVINO request {i}: {got} tokens, expected {req.samples} x "
                               f"{req.output_len}")


def build_pipeline(
    ir_dir: Path, scheduler: dict[str, Any], dtype: str, kv_precision: str
) -> tuple[Any, dict[str, Any]]:
    """A CPU ContinuousBatchingPipeline on `ir_dir`; returns (pipeline, its properties)."""
    genai = require("openvino_genai")
    sc = genai.SchedulerConfig()
    for key, value in scheduler.items():
        setattr(sc, key, value)
    props = {"INFERENCE_PRECISION_HINT": _OV_PRECISION[dtype], "KV_CACHE_PRECISION": kv_precision}
    return genai.ContinuousBatchingPipeline(str(ir_dir), sc, "CPU", props), props


def scheduler_settings(
    workload: Sequence[Request], batched_tokens: int, max_num_seqs: int, kv_bytes: int,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """SchedulerConfig fields for one sweep point (dynamic split-fuse: prefill chunks and
    decodes share each step's `batched_tokens` budget, as in vLLM's chunked prefill;
    `prefix_caching`: OpenVINO's own prefix cache, as jaxpipe's is set)."""
    return {
        "max_num_batched_tokens": batched_tokens,
        "max_num_seqs": max_num_seqs,
        "dynamic_split_fuse": True,
        "cache_size": cache_size_gb(workload, kv_bytes, max_num_seqs),
        "enable_prefix_caching": prefix_caching,
    }


def run_openvino(
    ir_dir: Path,
    workload: Sequence[Request],
    warmup: Sequence[Request],
    scheduler: dict[str, Any],
    dtype: str,
    kv_precision: str,
) -> dict:
    """Build a pipeline for one scheduler setting, warm it up on `warmup`, time the workload.

    Construction (model compile) and warm-up are timed separately and excluded from throughput.
    """
    start = time.perf_counter()
    pipe, props = build_pipeline(ir_dir, scheduler, dtype, kv_precision)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    if warmup:
        _generate(pipe, warmup)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    _generate(pipe, workload)
    elapsed = time.perf_counter() - start
    result = throughput(workload, elapsed)
    result.update(engine="openvino", dtype=dtype, batch_size=scheduler["max_num_seqs"])
    result.update(scheduler_config=dict(scheduler), properties=props)
    result.update(max_num_batched_tokens=scheduler["max_num_batched_tokens"])
    result.update(prefix_caching=scheduler.get("enable_prefix_caching", False))
    result.update(startup_s=startup_s, warmup_s=warmup_s)
    return result


def default_kv_precision(dtype: str, capabilities: Sequence[str]) -> str:
    """The KV cache's precision when none is asked for: the compute dtype, as jaxpipe keeps
    its KV, unless the CPU plugin lists no BF16 among its `capabilities` (then f32: its
    executor on such CPUs refuses a bf16 cache)."""
    wanted = _OV_PRECISION[dtype]
    return "f32" if wanted == "bf16" and "BF16" not in capabilities else wanted


def cpu_capabilities() -> list[str]:
    """OpenVINO's CPU plugin's OPTIMIZATION_CAPABILITIES (e.g. FP32, BF16, INT8)."""
    return list(require("openvino").Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def sweep_openvino(
    model: Path,
    workload: Sequence[Request],
    warmup: Sequence[Request],
    batched_tokens: Sequence[int],
    *,
    dtype: str,
    max_num_seqs: int,
    kv_precision: str | None = None,
    prefix_caching: bool = False,
    weight_format: str = "fp16",
    log: Log = print,
) -> dict:
    """Convert (or reuse) the IR, run `run_openvino` at each token budget; all points + best.

    `kv_precision` None: `default_kv_precision` for this CPU (OpenVINO's own CPU default
    would be u8). `prefix_caching`: SchedulerConfig.enable_prefix_caching (each point builds
    a fresh pipeline, so no point inherits another's cache). `weight_format`: the IR's
    weights (`WEIGHT_FORMATS`).
    """
    import json

    ir_dir = ensure_ir(model, log, weight_format=weight_format)
    capabilities = cpu_capabilities()
    chosen = kv_precision or default_kv_precision(dtype, capabilities)
    if chosen != _OV_PRECISION[dtype] and kv_precision is None:
        log(f"[openvino] the CPU plugin has no BF16 ({', '.join(capabilities)}): KV cache f32")
    hf_config = json.loads((ir_dir / "config.json").read_text())
    kv_bytes = kv_bytes_per_token(hf_config, chosen)
    points = []
    for tokens in batched_tokens:
        scheduler = scheduler_settings(workload, tokens, max_num_seqs, kv_bytes, prefix_caching)
        point = run_openvino(ir_dir, workload, warmup, scheduler, dtype, chosen)
        point["weight_format"] = weight_format
        log(
            f"[openvino] batched tokens {tokens}: {point['output_tok_s']:.1f} output tok/s over "
            f"{point['num_requests']} requests in {point['elapsed_s']:.1f}s "
            f"(compile {point['startup_s']:.1f}s, KV pool {scheduler['cache_size']} GB)"
        )
        points.append(point)
    return {"points": points, "best": best_point(points), "ir_dir": str(ir_dir),
            "weight_format": weight_format,
            "kv_cache_precision": chosen, "cpu_capabilities": capabilities}


def run_job(job: dict, requests: Sequence[Request], warmup: Sequence[Request]) -> dict:
    """A job file's OpenVINO sweep (`jaxpipe_peers.__main__`)."""
    return sweep_openvino(
        Path(job["model"]), requests, warmup, job["batched_tokens"], dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"], kv_precision=job.get("kv_precision"),
        prefix_caching=job.get("prefix_caching", False),
        weight_format=job.get("weight_format", "fp16"),
        log=lambda line: print(line, flush=True),
    )
