"""The tools over jaxpipe, a package of their own that imports jaxpipe one way (jaxpipe never
imports it; tests/test_imports.py): benchmarks, the peers' environment, the soak, the step
profiler, the GPU check, the cost model's calibration and the papers' reproductions.

This module is the offline throughput benchmark: jaxpipe vs its peers (OpenVINO GenAI, HF
transformers, llama.cpp) on one seeded workload.

Entry point: `scripts/bench_throughput.py`. The pieces:
  * `workload`    -- the seeded request set (`make_workload`, `Request`);
  * `peers`       -- the peers' environment and one child process per peer, which runs
                     `jaxpipe_peers` (OpenVINO GenAI's token-budget sweep, HF's batch-size
                     sweep, llama.cpp's threads x sequences sweep) on the same workload;
  * `matmul`      -- measured JAX matmul GFLOP/s and the model FLOP count;
  * `report`      -- the table, the JSON.
This module runs jaxpipe through its public `Engine` API and ties the pieces together.
torch/transformers/openvino are imported only in the peers' environment.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from jaxpipe.config.checks import check_choices
from jaxpipe.config.engine import Attention, EngineConfig, Sampler
from jaxpipe.config.model import Dtype
from jaxpipe_bench.engine_fields import field_choices, label
from jaxpipe_bench.matmul import DEFAULT_SHAPES
from jaxpipe_bench.report import machine_info, render, throughput, write_json
from jaxpipe_bench.workload import (
    NUM_PROMPTS,
    SEED,
    Request,
    default_gguf_path,
    describe_workload,
    make_workload,
    parse_shared_prefix,
    peer_vocab,
    share_prefixes,
)
from jaxpipe_peers.protocol import requests_to_json

Log = Callable[[str], None]

PEER_NAMES = ("openvino", "hf", "llamacpp")
OV_MAX_NUM_SEQS = 256  # OpenVINO's own default; --max-num-seqs overrides it for every engine


def parse_peers(text: str) -> tuple[str, ...]:
    """Parse `--peers` ('openvino,hf', '' for none) into peer names in PEER_NAMES order."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(PEER_NAMES))
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEER_NAMES)}")
    return tuple(n for n in PEER_NAMES if n in names)


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run depends on; each entry below is also its flag's help
    (jaxpipe.config.flags).

    num_prompts: requests in the seeded workload.
    seed: the workload's seed.
    input_len: fixed prompt length (None: lognormal, ShareGPT-like).
    output_len: fixed output length (None: lognormal, ShareGPT-like).
    input_range: LO-HI: prompt lengths drawn uniformly in LO..HI (instead of input_len).
    samples: completions per prompt: > 1 is a rollout, each prompt's samples drawn at
        temperature 1 with the request's seed (jaxpipe's SamplingParams.n, OpenVINO's
        num_return_sequences; HF runs each prompt that many times); 1: greedy.
    dtype: the engines' compute dtype.
    model: jaxpipe's model (a preset name or a path).
    peer_model: the peers' model and the workload's vocabulary: a GGUF file or an HF directory
        (config.json + safetensors + tokenizer); None: the bundled SmolLM2-135M-Instruct GGUF
        (pass the same to --model).
    max_num_seqs: jaxpipe's batch limit (None: the engine's default).
    max_num_batched_tokens: jaxpipe's step token budget (None: the engine's default).
    kv_cache_gb: jaxpipe's device KV pool in GB; None or 0: the engine's own, sized from the
        free RAM, so the benchmark measures what a user gets from `Engine()`.
    max_model_len: None: the longest request, rounded up to 128.
    overlap: EngineConfig.overlap; off, each step lands before the next is dispatched
        (ablation).
    sampler: jaxpipe's sampler (EngineConfig.sampler): the device program or NumPy on host
        threads.
    mesh: jaxpipe's mesh preset, e.g. cpu-8 (EngineConfig.mesh).
    attention: jaxpipe's attention path (EngineConfig.attention; None: its default, "auto").
    prefix_caching: EngineConfig.prefix_caching (None: the engine's default, on); OpenVINO
        runs with its enable_prefix_caching set the same, so both engines cache or neither.
    shared_prefix: N:LEN or N:LO-HI, e.g. 5:500-1100: N shared prefixes (system prompts) of
        LEN tokens, or of lengths drawn in LO..HI, each request one of them (evenly, in a
        shuffled order) + its own prompt from the usual workload (None: no sharing).
    layout: one jaxpipe layout for prefill and decode, e.g. pp=2,tp=4.
    warmup_prompts: short warm-up requests run before the timed ones.
    hf_batch_sizes: HF's batch-size sweep (the best point is kept).
    hf_num_prompts: run HF on only the first N prompts (None: the whole workload).
    hf_max_seconds: stop each HF sweep point after about this many seconds.
    peers: the peers to measure, a comma list of openvino, hf and llamacpp ('' for none).
    ov_batched_tokens: OpenVINO's max_num_batched_tokens sweep (the best point is kept).
    ov_kv_cache_precision: OpenVINO's KV cache precision (None: the compute dtype, as jaxpipe
        keeps its KV).
    ov_weight_format: OpenVINO's IR weights: fp16, or int8 (NNCF's per-channel weight
        compression, what optimum-cli gives LLMs by default; the peer of quantization int8).
    llamacpp_threads: llama.cpp's thread counts to sweep (its best point is kept).
    llamacpp_max_seqs: llama.cpp's parallel sequences to sweep (its server's -np; the unified
        KV cache holds that many of the longest requests).
    llamacpp_batch_tokens: llama.cpp's tokens per llama_decode call (its n_batch): the running
        sequences' next tokens, then prompt chunks.
    skip_hf: no hf, whatever peers says (the old spelling of leaving hf out of peers).
    skip_jaxpipe: do not run jaxpipe (peers only).
    skip_matmul: no matmul peak / FLOP/s line.
    matmul_repeats: repeats of each matmul timing.
    json_path: where the result's JSON is written.
    engine_fields: KEY=VALUE[,VALUE...], repeated: EngineConfig fields passed to jaxpipe as
        given (e.g. quantization=none,int8); each value is one jaxpipe run on the same
        workload, crossed with the other fields' values, the first the baseline of the others.
    """

    num_prompts: int = NUM_PROMPTS
    seed: int = SEED
    input_len: int | None = None
    output_len: int | None = None
    input_range: str | None = None
    samples: int = 1
    dtype: Dtype = EngineConfig.dtype
    model: str = EngineConfig.model
    peer_model: str | None = field(default=None, metadata={"flags": ("--peer-model", "--gguf")})
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_gb: float | None = None
    max_model_len: int | None = None
    overlap: bool = EngineConfig.overlap
    sampler: Sampler = EngineConfig.sampler
    mesh: str = EngineConfig.mesh
    attention: Attention | None = None
    prefix_caching: bool | None = None
    shared_prefix: str | None = None
    layout: str | None = None
    warmup_prompts: int = 4
    hf_batch_sizes: tuple[int, ...] = (16, 32, 64)
    hf_num_prompts: int | None = None
    hf_max_seconds: float | None = None
    peers: tuple[str, ...] = ("hf",)
    ov_batched_tokens: tuple[int, ...] = (256, 512, 2048)
    ov_kv_cache_precision: Literal["bf16", "f32", "u8"] | None = None
    ov_weight_format: Literal["fp16", "int8"] = "fp16"
    llamacpp_threads: tuple[int, ...] = (1, 2)
    llamacpp_max_seqs: tuple[int, ...] = (64,)
    llamacpp_batch_tokens: int = 2048
    skip_hf: bool = False
    skip_jaxpipe: bool = False
    skip_matmul: bool = False
    matmul_repeats: int = 10
    json_path: str = field(default="out/bench_throughput.json", metadata={"flags": ("--json",)})
    engine_fields: tuple[str, ...] = field(default=(), metadata={"flags": ("--engine-field",),
                                                                 "repeat": True})

    def __post_init__(self) -> None:
        # checked, in PEER_NAMES order
        object.__setattr__(self, "peers", parse_peers(",".join(self.peers)))
        if self.shared_prefix is not None:
            parse_shared_prefix(self.shared_prefix)
        if self.input_range is not None and self.input_len is not None:
            raise ValueError("give input_len or input_range, not both")
        _ = self.prompt_range  # raises on a malformed input_range
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) \
                or self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {self.samples!r}")
        check_choices(self)
        for name in ("hf_batch_sizes", "ov_batched_tokens", "llamacpp_threads",
                     "llamacpp_max_seqs"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive integers, got {getattr(self, name)}")
        if self.llamacpp_batch_tokens < max(self.llamacpp_max_seqs):
            raise ValueError(f"llamacpp_batch_tokens ({self.llamacpp_batch_tokens}) must be >= "
                             f"every llamacpp_max_seqs {self.llamacpp_max_seqs}: each step feeds "
                             "every running sequence a token")
        field_choices(self.engine_fields)  # raises on a malformed field
        if self.skip_jaxpipe and not self.active_peers:
            raise ValueError("--skip-jaxpipe with no peers (--peers '' or --skip-hf) measures "
                             "nothing")

    @property
    def prompt_range(self) -> tuple[int, int] | None:
        """input_range "LO-HI" as (LO, HI) (None when not given)."""
        if self.input_range is None:
            return None
        lo, _, hi = self.input_range.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            raise ValueError(f"input_range must be LO-HI with 1 <= LO <= HI (e.g. 256-1024), "
                             f"got {self.input_range!r}")
        return int(lo), int(hi)

    @property
    def active_peers(self) -> tuple[str, ...]:
        """The peers this run measures: `peers`, less hf under `skip_hf`."""
        return tuple(p for p in self.peers if not (p == "hf" and self.skip_hf))

    @property
    def caching(self) -> bool:
        """Whether jaxpipe runs with its prefix cache: `prefix_caching`, else the engine's
        default."""
        if self.prefix_caching is not None:
            return self.prefix_caching
        return EngineConfig.prefix_caching


def peer_model_path(cfg: BenchConfig) -> Path:
    """The peers' model: `cfg.peer_model`, else the bundled SmolLM2 GGUF."""
    return Path(cfg.peer_model) if cfg.peer_model else default_gguf_path()


def default_max_model_len(workload: Sequence[Request], multiple: int = 128) -> int:
    """Longest prompt + output in the workload, rounded up to a multiple of `multiple`."""
    longest = max(r.prompt_len + r.output_len for r in workload)
    return -(-longest // multiple) * multiple


def warmup_requests(workload: Sequence[Request], n: int, max_output: int = 16) -> list[Request]:
    """`n` short warm-up requests shaped like the workload's first ones.

    Prompts are reversed so they share no prefix with the measured requests: a prefix cache
    warmed by them would otherwise make the timed run look faster than it is.
    """
    return [
        Request(tuple(reversed(r.prompt_token_ids)), min(r.output_len, max_output), r.samples)
        for r in workload[:n]
    ]


def check_outputs(outs: Sequence[Any], workload: Sequence[Request]) -> None:
    """Raise unless every request came back, in order, with exactly its output_len tokens.

    ignore_eos makes the token count part of the contract; a throughput number computed over
    short or missing outputs would silently overstate the engine.
    """
    if len(outs) != len(workload):
        raise RuntimeError(f"engine returned {len(outs)} outputs for {len(workload)} requests")
    for i, (out, req) in enumerate(zip(outs, workload, strict=True)):
        got = [len(o.token_ids) for o in out.outputs]
        if got != [req.output_len] * req.samples:
            raise RuntimeError(f"request {i}: got {got} output tokens, expected "
                               f"{req.samples} x {req.output_len}")
        prompt = getattr(out, "prompt_token_ids", None)
        if prompt is not None and tuple(prompt) != req.prompt_token_ids:
            raise RuntimeError(f"request {i}: output is for a different prompt (order mixed up?)")


def _generate(engine: Any, requests: Sequence[Request], progress: bool = False,
              stop: str | None = None) -> list[Any]:
    """Greedy (a rollout's samples: temperature 1, seeded by the request's index), ignore_eos
    generation of `requests` through the public Engine API (`progress`: the engine's progress
    bar, for runs that take many minutes; `stop`: a stop string for every request)."""
    from jaxpipe import SamplingParams

    params = [
        SamplingParams(n=r.samples, temperature=1.0 if r.samples > 1 else 0.0, seed=i,
                       max_tokens=r.output_len, ignore_eos=True, stop=stop)
        for i, r in enumerate(requests)
    ]
    return engine.generate(
        prompt_token_ids=[list(r.prompt_token_ids) for r in requests],
        sampling_params=params,
        use_tqdm=progress,
    )


def run_jaxpipe(
    cfg: BenchConfig, workload: Sequence[Request], log: Log = print,
    fields: dict[str, Any] | None = None,
) -> tuple[dict, Any]:
    """Build the engine (`fields`: EngineConfig fields over the benchmark's), warm it up, time
    `generate` over the workload, close it.

    Returns (result row, the engine's ModelConfig). Engine construction (weights load, compile)
    and the warm-up are timed separately and excluded from throughput.
    """
    from jaxpipe import Engine, EngineConfig

    fields = dict(fields or {})
    engine_cfg = EngineConfig(**_engine_kwargs(cfg, workload) | fields)
    if fields:
        log(f"[jaxpipe] {label(fields)}")
    start = time.perf_counter()
    engine = Engine(engine_cfg)
    startup_s = time.perf_counter() - start
    log(f"[jaxpipe] engine built in {startup_s:.1f}s")
    try:
        result = _measured(cfg, engine, workload, log)
    finally:
        engine.close()
    result.update(engine="jaxpipe", dtype=engine_cfg.dtype, batch_size=engine.max_num_seqs,
                  fields=fields, startup_s=startup_s, engine_config=dict(vars(engine_cfg)))
    result.update(max_num_batched_tokens=vars(engine_cfg).get("max_num_batched_tokens"),
                  prefix_caching=vars(engine_cfg).get("prefix_caching"))
    return result, engine.model_config


def _measured(cfg: BenchConfig, engine: Any, workload: Sequence[Request], log: Log) -> dict:
    """Warm `engine` up, then time `generate` over the workload: the throughput row, with the
    warm-up's seconds and the run's stats."""
    warmup = warmup_requests(workload, cfg.warmup_prompts)
    start = time.perf_counter()
    if warmup:
        check_outputs(_generate(engine, warmup), warmup)
    warmup_s = time.perf_counter() - start
    elapsed, stats = _timed_generate(engine, workload, log)
    result = throughput(workload, elapsed) | stats | {"warmup_s": warmup_s}
    result["prefix_cache_hit_rate"] = stats["engine_stats"].get("prefix_cache_hit_rate")
    log(f"[jaxpipe] {result['output_tok_s']:.1f} output tok/s in {elapsed:.1f}s "
        f"(CPU: {stats['process_cpu_s']:.1f}s, of which the engine's thread "
        f"{stats['engine_thread_cpu_s']:.2f}s)")
    return result


def _timed_generate(engine: Any, workload: Sequence[Request], log: Log) -> tuple[float, dict]:
    """Time one `generate` over the workload and check its outputs.

    Returns (seconds, extra result fields): the engine's stats for this run alone (reset first
    when the engine supports it) and any XLA compile time that leaked into the timed region,
    which would mean warm-up missed a shape and the throughput is understated; and the CPU
    seconds the run took: the whole process's (XLA's threads included) and the calling
    thread's, which runs the scheduler and builds the steps (`Engine.generate` drives the
    engine from it), so host-side costs show apart from the wall time's noise.
    """
    compile_before = _engine_stats(engine).get("compile_seconds", 0.0)
    if callable(getattr(engine, "reset_stats", None)):
        engine.reset_stats()
    process, thread = time.process_time(), time.thread_time()
    start = time.perf_counter()
    outs = _generate(engine, workload)
    elapsed = time.perf_counter() - start
    thread, process = time.thread_time() - thread, time.process_time() - process
    check_outputs(outs, workload)
    stats = _engine_stats(engine)
    leaked = float(stats.get("compile_seconds", 0.0)) - float(compile_before)
    if leaked > 0:
        log(f"[jaxpipe] WARNING: {leaked:.1f}s of compilation inside the timed run")
    return elapsed, {"engine_stats": stats, "compile_s_in_timed_run": leaked,
                     "process_cpu_s": process, "engine_thread_cpu_s": thread}


def _engine_kwargs(cfg: BenchConfig, workload: Sequence[Request]) -> dict[str, Any]:
    """EngineConfig arguments: the benchmark's, plus the engine knobs the user set."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len or default_max_model_len(workload),
        seed=cfg.seed,
    )
    # Unset knobs are left out so the engine's own defaults apply (and show up in the JSON).
    if cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.kv_cache_gb:
        kwargs["kv_cache_gb"] = cfg.kv_cache_gb
    for name in ("overlap", "sampler", "mesh"):
        if getattr(cfg, name) != getattr(EngineConfig, name):
            kwargs[name] = getattr(cfg, name)
    if cfg.attention is not None:
        kwargs["attention"] = cfg.attention
    if cfg.layout is not None:
        kwargs["prefill"] = kwargs["decode"] = cfg.layout
    if cfg.prefix_caching is not None:
        kwargs["prefix_caching"] = cfg.prefix_caching
    return kwargs


def _engine_stats(engine: Any) -> dict:
    """`engine.stats()` if the engine provides it (the contract allows a partial dict)."""
    try:
        return dict(engine.stats())
    except Exception as exc:  # noqa: BLE001 -- stats are informational, never fatal
        return {"error": repr(exc)}


def _flops_summary(
    cfg: BenchConfig, model_config: Any, jaxpipe: dict, matmul: dict, workload: Sequence[Request]
) -> dict:
    """Achieved model FLOP/s of the jaxpipe run and its fraction of the matmul peak."""
    from jaxpipe_bench.matmul import model_flops

    flops = model_flops(
        model_config, [r.prompt_len for r in workload], [r.output_len for r in workload]
    )
    achieved = flops / jaxpipe["elapsed_s"] / 1e9
    return {
        "dtype": cfg.dtype,
        "model_flops": flops,
        "achieved_gflops": achieved,
        "matmul_peak_gflops": matmul["peak_gflops"],
        "matmul_peak_impl": matmul.get("peak_impl", "xla"),
        "fraction_of_matmul_peak": achieved / matmul["peak_gflops"],
    }


def _peer_job(cfg: BenchConfig, peer: str, workload: Sequence[Request], model: Path) -> dict:
    """The job file of one peer (`jaxpipe_peers.protocol`)."""
    job: dict[str, Any] = {"peer": peer, "model": str(model), "dtype": cfg.dtype,
                           "requests": requests_to_json(workload)}
    if peer == "openvino":
        job.update(warmup=requests_to_json(warmup_requests(workload, cfg.warmup_prompts)),
                   batched_tokens=list(cfg.ov_batched_tokens),
                   max_num_seqs=cfg.max_num_seqs or OV_MAX_NUM_SEQS,
                   kv_precision=cfg.ov_kv_cache_precision, prefix_caching=cfg.caching,
                   weight_format=cfg.ov_weight_format)
    elif peer == "llamacpp":
        job.update(warmup=requests_to_json(warmup_requests(workload, cfg.warmup_prompts)),
                   threads=list(cfg.llamacpp_threads), max_seqs=list(cfg.llamacpp_max_seqs),
                   batch_tokens=cfg.llamacpp_batch_tokens)
    else:
        job.update(batch_sizes=list(cfg.hf_batch_sizes), max_seconds=cfg.hf_max_seconds)
        if not cfg.skip_matmul:  # torch's matmul peak beside jax's, for context
            job.update(matmul_shapes=[list(s) for s in DEFAULT_SHAPES],
                       matmul_repeats=cfg.matmul_repeats)
    return job


def _run_peer(cfg: BenchConfig, peer: str, workload: Sequence[Request], model: Path,
              log: Log) -> dict:
    """One peer's sweep in the peers' environment (HF on the first `hf_num_prompts`)."""
    from jaxpipe_bench.peers import run_peer

    if peer == "hf" and cfg.hf_num_prompts:
        workload = workload[: cfg.hf_num_prompts]
    result = run_peer(_peer_job(cfg, peer, workload, model), log)
    result["workload"] = describe_workload(workload)  # what the peer actually ran
    return result


def _measure_matmul(cfg: BenchConfig, log: Log) -> dict:
    """JAX matmul peak (the FLOP/s denominator)."""
    from jaxpipe_bench.matmul import measure_peak_gflops

    matmul = measure_peak_gflops(cfg.dtype, repeats=cfg.matmul_repeats)
    log(f"[matmul] {cfg.dtype} peak {matmul['peak_gflops']:.1f} GFLOP/s ({matmul['peak_impl']})")
    return matmul


def bench_workload(cfg: BenchConfig, vocab_size: int,
                   special_ids: Sequence[int]) -> tuple[list[Request], list[tuple[int, ...]]]:
    """The run's requests (`make_workload`, behind `share_prefixes`' prefixes under
    `shared_prefix`) and those shared prefixes (none without it)."""
    workload = make_workload(
        cfg.num_prompts, cfg.seed, vocab_size, cfg.input_len, cfg.output_len, special_ids,
        cfg.prompt_range, cfg.samples
    )
    if cfg.shared_prefix is None:
        return workload, []
    n, lo, hi = parse_shared_prefix(cfg.shared_prefix)
    return share_prefixes(workload, n, (lo, hi), cfg.seed, vocab_size, special_ids)


def run_benchmark(cfg: BenchConfig, log: Log = print) -> dict:
    """Run the whole benchmark, print the report, write the JSON; return the result dict."""
    model = peer_model_path(cfg)
    vocab_size, special_ids = peer_vocab(model)
    workload, shared = bench_workload(cfg, vocab_size, special_ids)
    result: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info()}
    result["workload"] = describe_workload(workload) | {"seed": cfg.seed, "vocab": vocab_size}
    if shared:
        result["workload"]["shared_prefix_lens"] = [len(p) for p in shared]
    log(f"[workload] {result['workload']}")
    if not cfg.skip_matmul:
        result["matmul"] = _measure_matmul(cfg, log)
    if not cfg.skip_jaxpipe:
        runs = []
        for fields in field_choices(cfg.engine_fields):
            row, model_config = run_jaxpipe(cfg, workload, log, fields)
            runs.append(row)
            gc.collect()  # free the engine's device buffers before the next allocates its own
        result["jaxpipe"] = runs[0]  # the baseline: the peers' ratios are to it
        if len(runs) > 1:
            result["jaxpipe_variants"] = runs[1:]
        if "matmul" in result:
            result["flops"] = _flops_summary(
                cfg, model_config, result["jaxpipe"], result["matmul"], workload
            )
    for peer in cfg.active_peers:
        result[peer] = _run_peer(cfg, peer, workload, model, log)
    if "torch_matmul" in result.get("hf", {}) and "matmul" in result:
        result["matmul"]["torch_reference"] = result["hf"]["torch_matmul"]
    log(render(result))
    log(f"wrote {write_json(result, cfg.json_path)}")
    return result
