"""What an `Engine` is built with: `EngineConfig`, validated once, in `__post_init__`, with
messages that name the bad value and what is accepted, and read-only afterwards.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from jaxpipe.config import cluster
from jaxpipe.config.cache_dir import cache_dir
from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.config.model import DTYPES, Dtype

# EngineConfig's options that take one of a fixed set of values: a Literal each, so its flag
# lists (and argparse checks) the choices; __post_init__ checks them too, for Python callers.
Attention = Literal["auto", "kernel", "pallas", "pallas-interpret", "xla"]
# "auto", "xla", the bf16 kernel's paths (jaxpipe.kernels.matmul.PATHS) and the int8 kernel's
# own (jaxpipe.kernels.int8_matmul.PATHS; "portable" and "avx2" name a path of each).
Matmul = Literal["auto", "xla", "portable", "avx2", "avx512_bf16", "amx", "avx_vnni",
                 "avx512_vnni", "amx_int8"]
# How the linear layers' weights are stored (vLLM's field): jaxpipe/model/quantized.py
# ("gguf": jaxpipe/model/gguf_quantized.py).
Quantization = Literal["none", "int8", "fp8", "gguf"]
Scheduler = Literal["auto", "seesaw", "prefill_first", "decode_first", "tdpipe", "throttle"]
Predictor = Literal["learned", "oracle"]  # jaxpipe.scheduler.predictor
Sampler = Literal["device", "host"]
KvCacheDtype = Literal["auto", "int8"]  # jaxpipe/kernels/paged.py KV_CACHE_DTYPES
ConstrainedSteps = Literal["skip", "land"]  # jaxpipe/engine/structured.py
ATTENTION = typing.get_args(Attention)
MATMULS = typing.get_args(Matmul)
QUANTIZATIONS = typing.get_args(Quantization)
SCHEDULERS = typing.get_args(Scheduler)
PREDICTORS = typing.get_args(Predictor)
SAMPLERS = typing.get_args(Sampler)
CONSTRAINED_STEPS = typing.get_args(ConstrainedSteps)
KV_CACHE_DTYPES = typing.get_args(KvCacheDtype)


def _default_cache_dir() -> str:
    return str(cache_dir("xla"))


# The fields of EngineConfig that tune one scheduling policy (Engine.set_scheduler's knobs).
POLICY_KNOBS = ("throttle_iterations", "throttle_max_prefill", "throttle_min_prefill",
                "throttle_kv_thresh", "tdpipe_predictor", "tdpipe_finish_ratio")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `Engine` needs. Validated and normalised once, at construction, then
    read-only: the switches an engine may flip while it lives (`Engine.set_scheduler`,
    `set_overlap`, `set_detok_worker`) are the engine's own state, not this config's.

    model: a preset name from `models/` (e.g. "smollm2-135m"), a path to a `.gguf` file, an HF
        directory (config.json + *.safetensors) or an orbax checkpoint made by scripts/convert.py.
    dtype: "bfloat16" (fast on CPU with f32 accumulation) or "float32".
    quantization: how the linear layers' weights are stored (vLLM's field). "none": in
        `dtype`. "int8": dynamic W8A8, weights quantized once at load to int8 with a scale per
        output channel, activations per token at run time, int32 sums (the C++ int8 kernel
        where measured fastest, XLA's int8 dot elsewhere): about half bf16's weight bytes.
        The float weights are first smoothed (SmoothQuant, `model/smoothing.py`: activation
        outlier channels folded into the weights, calibrated on a shipped text at load).
        "fp8": e4m3 weights per output channel and per-token e4m3 activations through XLA's
        fp8 dot (for GPUs; on CPU it checks the numbers, it is not fast). Every decoder
        linear (q, kv, o, gate/up, down, MoE experts) and the LM head (see quantize_lm_head);
        the embedding lookup, norms and biases stay in `dtype`. None (vLLM's) is "none".
        "gguf" (a GGUF model only; every layout, tp too): the file's quantized blocks (Q8_0, Q4_0,
        Q4_1, Q4_K, Q6_K) kept as they are, multiplied by the GGUF kernel or XLA's reference
        of the format, activations quantized per block as llama.cpp does; a tied LM head is
        the embedding's blocks, and the lookup decodes only the gathered rows. Tensors of
        other types are dequantized at load, as with "none" (one log line each);
        quantize_lm_head does not apply.
    quantize_lm_head: with quantization, quantize the LM head too (True; tied embeddings: a
        quantized copy of the embedding, the lookup keeps `dtype`); False keeps it in `dtype`.
    max_model_len: longest prompt + output, in tokens (default: min(model limit, 2048)).
    max_num_seqs: sequences on the device at once (decode batch rows). Default: 256 (fewer
        only if the device KV pool has fewer blocks). Each sequence takes blocks as it grows;
        when the pool fills, the scheduler preempts the newest.
    max_num_batched_tokens: the token budget of one step: prompt chunks plus decode tokens (a
        step may carry up to max(this, max_num_seqs) tokens, so that every running sequence
        can decode in one step).
    kv_cache_gb: size of the device KV store, a pool of 16-token blocks shared by the running
        sequences (each holds the blocks its tokens need). kv_cache_tokens, when given, sets
        it in tokens instead. When the running sequences grow past it, the scheduler preempts
        the newest (to the host tier, or to be recomputed). It must hold one max_model_len
        sequence. Default (both None): sized from the free memory, see memory_utilization.
    kv_cache_tokens: the device KV store in tokens (wins over kv_cache_gb).
    kv_cache_dtype: how the KV cache is stored (vLLM's field): "auto", the model's dtype, or
        "int8": each token's K and V per KV head as int8 codes with a bf16 scale (symmetric,
        max|x| / 127), dequantized as attention reads them; about half the bytes a token, so
        the same memory holds about twice the tokens.
    memory_utilization: the fraction of the devices' free memory (accelerators: memory_stats;
        CPU devices: the host's available RAM), once the weights and the activations of the
        largest step are taken from it, that the device KV pool gets when kv_cache_gb /
        kv_cache_tokens are not given. None: 0.9 on accelerators (vLLM's
        gpu_memory_utilization), 0.4 on CPU, whose RAM the host tier, the compiled programs
        and the rest of the machine share (there the pool takes memory only as its blocks
        are first written).
    seed: the seed of the requests that give none (each draws one from this stream).
    random_weights: seeded random weights instead of the model's (architecture-only presets,
        benchmarks).
    compilation_cache_dir: JAX's persistent compilation cache (None turns it off).
    warmup: compile every step shape at construction, so that no request waits for a compile.
    show_progress: progress bars (compilation, generate).
    mesh: a device-topology preset from `meshes/` ("cpu-1", "cpu-8", ...). A cpu-N preset asks
        JAX for N virtual CPU devices when the engine starts.
    prefill, decode: layouts like "pp=4,tp=2" or "ep=4,tp=2" (ep: experts split over devices, MoE
        models only; default: the mesh preset's), or "auto": the planner's choice for this
        model and mesh (jaxpipe.planner.choose_layouts). pp*tp*ep*dp must equal the mesh's
        device count. Prefill runs on one, decode on the other; the weights
        and the KV store's live blocks are re-sharded between them at each phase change.
    attention: the step's attention over the paged KV: "auto" (the Pallas kernel on GPU; on
        CPU the C++ kernels, ragged attention and bf16 matmuls, where they build, else
        XLA), "kernel" (the C++ kernels or an error), "pallas" (the Pallas kernel, GPU only),
        "pallas-interpret" (it in Pallas' interpreter: any backend, slow; for tests) or
        "xla". On CPU "auto" times the C++ kernel and XLA on the model's heads once per
        machine and takes the faster (jaxpipe.runtime.kernel_choice).
    matmul: which implementation multiplies bf16 weights on CPU: "auto" (each weight and row
        count timed once per machine, the fastest used: XLA's dot or a path of the bf16
        kernel; jaxpipe.runtime.kernel_choice), "xla", or one kernel path for every matmul:
        "portable", "avx2", "avx512_bf16", "amx" (an error where this machine's build has no
        such path).
    scheduler: the scheduling policy (jaxpipe.scheduler): "seesaw" (prefill into the host KV
        tier until it is full, then decode out of it until it is empty: few layout switches),
        "prefill_first" (continuous batching with chunked prefill: decode tokens first, the
        rest of each step's budget to prompt chunks) or "decode_first" (fill a batch, decode
        it to the end), "tdpipe" (TD-Pipe: long prefill and decode phases on one pp-heavy
        layout; greedy prefill up to the KV its predicted output lengths will need, decode in
        pp balanced batches, back to prefill when decode efficiency drops below the switch's
        cost) or "throttle" (gLLM: each micro-batch throttles its prompt tokens by the waiting
        tokens and free KV, and carries 1/pp of the decode tokens). "auto" (the default):
        seesaw when the prefill and decode layouts differ and the host tier is on, else
        prefill_first. tdpipe and throttle run on the prefill layout, pp micro-batches a step.
    throttle_iterations, throttle_max_prefill, throttle_min_prefill, throttle_kv_thresh:
        gLLM's #T, #MaxP, #MinP and KV_thresh (the paper's defaults 8, 2048, 32, 0.05).
    tdpipe_predictor: TD-Pipe's output-length predictor, "learned" (online, from finished
        requests) or "oracle" (each request's max_tokens).
    tdpipe_finish_ratio: None switches decode -> prefill by TD-Pipe's intensity comparison
        (from step times the engine measures once per model and layout and caches), a
        fraction in (0, 1] once that fraction of the decode phase's requests finished.
    overlap: dispatch each step before the previous step's tokens reach the host (decode
        tokens are fed from the device), so the host's scheduling, input building and stop
        checks run while the device computes; outputs are the same either way. A request that
        stops is then in one more step, whose token for it is discarded. Over pp stages the
        micro-batch entering next takes the sequences of the one that just left the last
        stage, their tokens fed from it (SiPipe's token-safe execution); without overlap they
        wait for it to land.
    detok_worker: detokenize (for stop strings and streaming) and search stop strings on a
        worker thread, off the engine loop; outputs are the same either way.
    sampler: where the next token is chosen: "device" (a small program after the LM head) or
        "host" (SiPipe's CPU sampling: the sampled rows' logits come to the host and
        `sampler_threads` worker threads sample them in NumPy, penalties kept per slot and
        updated with each token). The same tokens either way (up to float32 summation order
        at a token's boundary). With overlap, a host-sampled step is sampled just before the
        step that takes its tokens is dispatched; the device waits for that, not for the rest
        of the host's work. "device" is the default (see the README's measurements).
    sampler_threads: the host sampler's worker threads.
    constrained_steps: how structured outputs keep overlap (a constrained row's token mask
        needs its previous token on the host): "skip" (a constrained sequence sits out the
        step after its own; every other row keeps overlapping) or "land" (while any
        constrained request runs, each step lands before the next is built).
    host_kv_gb: size of the host KV tier (finished prefills and preempted sequences wait there,
        in host memory, for a device slot). host_kv_tokens, when given, sets it in tokens
        instead. seesaw needs it > 0; 0 turns the tier off (preemption then recomputes).
        Default (both None): 0.1 of the host's available RAM (less the device pool on CPU).
        The tier takes memory only for what it holds: sequences, and (prefix_caching) the
        cached blocks the device pool evicted, in the room the sequences leave.
    host_kv_tokens: the host KV tier in tokens (wins over host_kv_gb).
    prefix_caching: automatic prefix caching, on by default: full 16-token KV blocks are kept
        under a hash of the model and every token up to theirs, and a request whose prompt
        starts with cached blocks shares them (its prefill starts after them). Blocks the
        device pool evicts after they were hit are kept in the host tier, as far as
        swapped-out sequences leave room, and copied back on a hit. Where nothing is shared
        it costs a hash per full block on the host. The same tokens either way.
    coordinator: "HOST:PORT" of process 0 when the engine spans several processes (one per
        host; jaxpipe.config.cluster): JAX's coordinator listens there and the leader's control
        channel on PORT+1. Default: $JAX_COORDINATOR_ADDRESS, else one process. The mesh's
        devices are split evenly over the processes, process 0's first, so a layout's
        outermost split axis (pp) crosses the host boundary and tp stays within a host when
        tp divides the devices per host.
    num_processes: processes in the cluster (default: $JAX_NUM_PROCESSES).
    process_id: this process's index, 0 the leader (scheduler and front ends), the others
        followers that run the leader's steps (default: $JAX_PROCESS_ID).
    """

    model: str = "smollm2-135m"
    dtype: Dtype = "bfloat16"
    quantization: Quantization = "none"
    quantize_lm_head: bool = True
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 4096
    kv_cache_gb: float | None = None
    kv_cache_tokens: int | None = None
    kv_cache_dtype: KvCacheDtype = "auto"
    seed: int = 0
    random_weights: bool = False
    compilation_cache_dir: str | None = field(default_factory=_default_cache_dir)
    warmup: bool = True
    show_progress: bool = True
    attention: Attention = "auto"
    matmul: Matmul = "auto"
    mesh: str = "cpu-1"
    prefill: str | Layout | None = None
    decode: str | Layout | None = None
    scheduler: Scheduler = "auto"
    host_kv_gb: float | None = None
    host_kv_tokens: int | None = None
    throttle_iterations: int = 8
    throttle_max_prefill: int = 2048
    throttle_min_prefill: int = 32
    throttle_kv_thresh: float = 0.05
    tdpipe_predictor: Predictor = "learned"
    tdpipe_finish_ratio: float | None = None
    overlap: bool = True
    detok_worker: bool = True
    sampler: Sampler = "device"
    sampler_threads: int = 2
    constrained_steps: ConstrainedSteps = "skip"
    prefix_caching: bool = True
    memory_utilization: float | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        self._check_model()
        self._check_batch()
        self._check_memory()
        self._check_step()
        self.check_scheduler(self.scheduler)
        self._check_policy_knobs()
        if self.compilation_cache_dir is not None:
            _set(self, "compilation_cache_dir", str(Path(self.compilation_cache_dir).expanduser()))
        self._check_layouts()
        self._check_cluster()

    def _check_model(self) -> None:
        """The model as a str, and its dtype."""
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(
                f"EngineConfig.model must be a preset name or a path, got {self.model!r}")
        _set(self, "model", str(self.model))
        _check_choice("dtype", self.dtype, DTYPES)
        if self.quantization is None:  # vLLM's spelling of no quantization
            _set(self, "quantization", "none")
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"EngineConfig.quantize_lm_head must be True or False, got "
                             f"{self.quantize_lm_head!r}")

    def _check_batch(self) -> None:
        """The batch's limits: sequences on the device, tokens a step, tokens a sequence."""
        if self.max_num_seqs is not None:
            _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 16, 1 << 20)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, 1 << 20)

    def _check_memory(self) -> None:
        """The device KV pool's and the host KV tier's sizes."""
        _check_number("kv_cache_gb", self.kv_cache_gb, "a positive number or None",
                      lambda x: x > 0)
        if self.kv_cache_tokens is not None:
            _check_int("kv_cache_tokens", self.kv_cache_tokens, 1, 1 << 40)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_number("memory_utilization", self.memory_utilization, "a number in (0, 1] or None",
                      lambda x: 0 < x <= 1)
        _check_number("host_kv_gb", self.host_kv_gb, "a number >= 0 or None", lambda x: x >= 0)
        if self.host_kv_tokens is not None:
            _check_int("host_kv_tokens", self.host_kv_tokens, 0, 1 << 40)

    def _check_step(self) -> None:
        """How a step runs: its kernels, the sampler and its seed, the on/off switches."""
        _check_choice("attention", self.attention, ATTENTION)
        _check_choice("matmul", self.matmul, MATMULS)
        _check_choice("sampler", self.sampler, SAMPLERS)
        _check_int("sampler_threads", self.sampler_threads, 1, 256)
        _check_choice("constrained_steps", self.constrained_steps, CONSTRAINED_STEPS)
        _check_int("seed", self.seed, 0, 2**32 - 1)
        for name in ("overlap", "detok_worker", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")

    def _check_cluster(self) -> None:
        """Fill the cluster settings from JAX's environment variables and check them."""
        settings = cluster.settings(self.coordinator, self.num_processes, self.process_id)
        names = ("coordinator", "num_processes", "process_id")
        for name, value in zip(names, settings, strict=True):
            _set(self, name, value)
        cluster.check(self.coordinator, self.num_processes, self.process_id,
                          load_mesh(self.mesh).num_devices, self.sampler)

    def check_scheduler(self, name: str) -> None:
        """Refuse a policy name this config cannot run (unknown, or seesaw with no host tier)."""
        _check_choice("scheduler", name, SCHEDULERS)
        if name == "seesaw" and (self.host_kv_tokens == 0 or (
                self.host_kv_tokens is None and self.host_kv_gb == 0)):
            raise ValueError("EngineConfig.scheduler='seesaw' buffers finished prefills in the "
                             "host KV tier, which is off (host_kv_gb=0 / host_kv_tokens=0); "
                             "give it room or use scheduler='prefill_first'")

    def _check_policy_knobs(self) -> None:
        _check_int("throttle_iterations", self.throttle_iterations, 1, 1 << 20)
        _check_int("throttle_min_prefill", self.throttle_min_prefill, 0, 1 << 20)
        _check_int("throttle_max_prefill", self.throttle_max_prefill,
                   max(1, self.throttle_min_prefill), 1 << 20)
        if isinstance(self.throttle_kv_thresh, bool) or not (
                isinstance(self.throttle_kv_thresh, (int, float))
                and 0 <= self.throttle_kv_thresh < 1):
            raise ValueError(f"EngineConfig.throttle_kv_thresh must be in [0, 1), "
                             f"got {self.throttle_kv_thresh!r}")
        _check_choice("tdpipe_predictor", self.tdpipe_predictor, PREDICTORS)
        ratio = self.tdpipe_finish_ratio
        if ratio is not None and (isinstance(ratio, bool) or not (
                isinstance(ratio, (int, float)) and 0 < ratio <= 1)):
            raise ValueError(f"EngineConfig.tdpipe_finish_ratio must be None or in (0, 1], "
                             f"got {ratio!r}")

    def _check_layouts(self) -> None:
        """Resolve `prefill` / `decode` to `Layout`s (preset defaults) that fit the mesh."""
        try:
            preset = load_mesh(self.mesh)
        except ValueError as err:
            raise ValueError(f"EngineConfig.mesh: {err}") from None
        for phase in ("prefill", "decode"):
            value = getattr(self, phase)
            if value == "auto":  # resolved by the planner once the model is known (engine.py)
                continue
            try:
                layout = getattr(preset, phase) if value is None else Layout.parse(value)
                layout.check_devices(preset.num_devices, f"{phase} layout")
            except ValueError as err:
                raise ValueError(f"EngineConfig.{phase}={value!r} on mesh {self.mesh!r}: "
                                 f"{err}") from None
            _set(self, phase, layout)


def _set(config: EngineConfig, name: str, value) -> None:
    """Normalise a field of the frozen config, in `__post_init__` only."""
    object.__setattr__(config, name, value)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"EngineConfig.{name} must be one of {choices}, got {value!r}")


def _check_number(name: str, value, accepted: str, ok) -> None:
    """None, or a number (not a bool) for which ok(value) holds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"EngineConfig.{name} must be {accepted}, got {value!r}")


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"EngineConfig.{name} must be an integer in [{lo}, {hi}], got {value!r}")
