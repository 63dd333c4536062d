"""Validated configuration: the model's architecture and the engine's budgets.

`ModelConfig` is frozen and hashable so it can be a static argument of jitted functions.
`EngineConfig` is what a user builds; it is validated once, in `__post_init__`, with messages
that name the bad value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from jaxpipe.cache_dir import cache_dir
from jaxpipe.layout import Layout
from jaxpipe.meshes import load_mesh

Dtype = Literal["float32", "bfloat16"]
DTYPES = typing.get_args(Dtype)


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")
MLP_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF's `rope_scaling` / `rope_parameters` defines it.

    rope_type: "llama3" (factor, low/high_freq_factor, original_max_position_embeddings),
        "linear" (every frequency / factor), "dynamic" (NTK: HF rescales only past
        max_position_embeddings, which the engine never runs, so the frequencies are the
        base ones), "yarn" (factor, beta_fast/slow, original_max_position_embeddings,
        truncate; cos and sin scaled by attention_factor), "longrope" (Phi-3: each frequency
        divided by its short_factor, cos and sin by attention_factor; long_factor is HF's past
        original_max_position_embeddings, where the engine does not run such a model)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type {self.rope_type!r} is not supported; "
                             f"supported: {list(ROPE_TYPES)}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
        if self.rope_type == "longrope" and not self.short_factor:
            raise ValueError("RopeScaling of type 'longrope' needs its short_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of the Llama family and its relatives (Mistral, Qwen2/2.5,
    Qwen3, Gemma, Phi, and the mixtures of experts Qwen2/3-MoE and Mixtral). Hashable:
    usable as a static jit argument. Each family's module (`jaxpipe/model/families/`) says
    which of these switches it turns on and reads them from its checkpoints.

    qkv_bias: the q, k and v projections add a bias (Qwen2/2.5).
    qk_norm: q and k are RMS-normalised per head (a [head_dim] weight each) before RoPE
        (Qwen3).
    sliding_window: the layers in sliding_layers attend only over their last sliding_window
        keys (HF: key position > query position - sliding_window); the kernels read only
        the blocks inside each query's window.
    embed_scale: the embeddings' multiplier (Gemma: sqrt(hidden_size), rounded to the
        weights' dtype as HF does).
    sandwich_norms: the attention output and the MLP output are RMS-normalised before their
        residual adds too (Gemma 2/3: four norms per layer).
    mlp_act: the gated MLP's activation, "silu" or "gelu_tanh" (Gemma).
    attn_scale: the multiplier of q.k (None: 1/sqrt(head_dim); Gemma:
        query_pre_attn_scalar ** -0.5).
    attn_softcap, final_softcap: tanh soft-capping of the attention scores and of the
        logits, cap * tanh(x / cap) (Gemma 2); None: none.
    rotary_dim: how many of each head's leading dimensions RoPE rotates (Phi's
        partial_rotary_factor * head_dim); None: all of them.
    rope_local_theta: the RoPE base of the sliding-window layers (plain RoPE, no scaling),
        where it differs from the global layers' rope_theta / rope_scaling (Gemma 3's
        rope_local_base_freq); None: every layer uses rope_theta.
    num_experts: a mixture of experts (Qwen2/3-MoE, Mixtral) in every layer's MLP: this
        many experts, each a gated MLP moe_intermediate_size wide; 0: a dense model. Each
        token goes to its num_experts_per_tok experts of highest router probability (a
        softmax over all experts; exact ties to the lower expert index, where HF's
        torch.topk picks in an order of its own), weighted
        by those probabilities, renormalised to sum to 1 with norm_topk_prob (Mixtral's
        softmax over the top-k logits is the same thing).
    intermediate_size: the dense MLP's width; in an MoE model the shared expert's (Qwen2-MoE:
        a dense MLP beside the experts, its output times sigmoid(x . shared_gate)), 0 for
        none.
    dense_layers, dense_intermediate_size: in an MoE model, the layers whose MLP is a plain
        dense gated MLP dense_intermediate_size wide instead of the experts (Qwen2/3-MoE's
        mlp_only_layers and decoder_sparse_step); () and 0: every layer MoE. Such a model
        stores one uniform layer stack (`decoder.param_decls`): every layer holds the
        experts (zero in a dense layer) and a dense MLP `mlp_width` wide (zero-padded)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    mlp_act: str = "silu"
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_local_theta: float | None = None
    rotary_dim: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        self._check_mlp()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_layers and not (isinstance(self.sliding_window, int)
                                        and self.sliding_window >= 1):
            raise ValueError(f"ModelConfig.sliding_layers {self.sliding_layers} need a positive "
                             f"integer sliding_window, got {self.sliding_window!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ModelConfig.mlp_act {self.mlp_act!r} is not supported; "
                             f"supported: {list(MLP_ACTS)}")
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in [2, head_dim="
                             f"{self.head_dim}], got {self.rotary_dim!r}")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"ModelConfig.sliding_layers {bad} are not layers of "
                             f"0..{self.num_layers - 1}")

    def _check_mlp(self) -> None:
        """The dense MLP's width, and the experts' counts where the model has experts."""
        f, moe = self.intermediate_size, self.is_moe
        if not isinstance(f, int) or isinstance(f, bool) or f < (0 if moe else 1):
            raise ValueError(f"ModelConfig.intermediate_size must be a positive integer "
                             f"({'or 0 (no shared expert) ' if moe else ''}got {f!r})")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be an integer >= 0 (0: dense), "
                             f"got {self.num_experts!r}")
        if not moe:
            if (self.num_experts_per_tok or self.moe_intermediate_size or self.norm_topk_prob
                    or self.dense_layers or self.dense_intermediate_size):
                raise ValueError("ModelConfig.num_experts_per_tok, moe_intermediate_size, "
                                 "norm_topk_prob, dense_layers and dense_intermediate_size "
                                 "need num_experts >= 1 (got num_experts=0)")
            return
        k = self.num_experts_per_tok
        if not isinstance(k, int) or not 1 <= k <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                             f"{self.num_experts}], got {k!r}")
        if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig.moe_intermediate_size must be a positive integer "
                             f"in an MoE model, got {self.moe_intermediate_size!r}")
        if self.mlp_act != "silu":
            raise ValueError(f"ModelConfig.mlp_act {self.mlp_act!r} is not supported with "
                             "experts; supported: 'silu'")
        self._check_dense_layers()

    def _check_dense_layers(self) -> None:
        """An MoE model's dense layers: real layer indices, with a width (and a width only
        with them)."""
        layers, f = self.dense_layers, self.dense_intermediate_size
        bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"ModelConfig.dense_layers {bad} are not layers of "
                             f"0..{self.num_layers - 1}")
        if not isinstance(f, int) or isinstance(f, bool) or f < (1 if layers else 0):
            raise ValueError(f"ModelConfig.dense_intermediate_size must be a positive integer "
                             f"with dense_layers {list(layers)} (got {f!r})")
        if f and not layers:
            raise ValueError(f"ModelConfig.dense_intermediate_size={f} needs dense_layers "
                             "(the layers whose MLP is dense); got none")

    @property
    def is_moe(self) -> bool:
        """Whether the model has experts (in every layer but `dense_layers`)."""
        return self.num_experts > 0

    @property
    def mlp_width(self) -> int:
        """The width of the stacked dense MLP (`w_gate_up`, `w_down`): intermediate_size,
        or in a mixed dense/MoE model the wider of it (the shared expert's) and
        dense_intermediate_size (the narrower zero-padded: exact, silu(0) * 0 = 0)."""
        return max(self.intermediate_size, self.dense_intermediate_size)

    @property
    def context_limit(self) -> tuple[int, str]:
        """The longest sequence the engine runs this model at, and what sets it: its position
        embeddings, or LongRoPE's original_max_position_embeddings (HF switches every
        position's frequencies to long_factor once a forward pass passes it, which a batch
        engine whose sequences share steps cannot reproduce)."""
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            n = min(self.max_position_embeddings, s.original_max_position_embeddings)
            return n, (f"rope_scaling.original_max_position_embeddings={n} (LongRoPE: past it "
                       "HF changes every position's frequencies)")
        return self.max_position_embeddings, (
            f"max_position_embeddings={self.max_position_embeddings}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count as stored (the LM head counts separately only when untied; a mixed
        dense/MoE model's zero experts and zero-padded MLPs included)."""
        e, f, h, k, d = (self.hidden_size, self.mlp_width, self.num_heads,
                         self.num_kv_heads, self.head_dim)
        per_layer = e * (h * d) * 2 + e * (k * d) * 2 + 3 * e * f + 2 * e
        if self.is_moe:  # the router, the experts, the shared expert's gate
            per_layer += e * self.num_experts * (1 + 3 * self.moe_intermediate_size)
            per_layer += e if self.intermediate_size else 0
        per_layer += (h + 2 * k) * d if self.qkv_bias else 0
        per_layer += 2 * d if self.qk_norm else 0
        per_layer += 2 * e if self.sandwich_norms else 0
        total = self.num_layers * per_layer + e
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return total + head + (self.vocab_size * e if include_embedding else 0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a plain dict (a preset's `[architecture]` table or saved JSON)."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; accepted: {sorted(known)}")
        if d.get("rope_scaling") is not None and not isinstance(d["rope_scaling"], RopeScaling):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for name in ("eos_token_ids", "sliding_layers", "dense_layers"):
            if name in d:
                d[name] = tuple(d[name])
        rope = d.get("rope_scaling")
        if isinstance(rope, RopeScaling):
            d["rope_scaling"] = dataclasses.replace(
                rope, short_factor=tuple(rope.short_factor), long_factor=tuple(rope.long_factor))
        return cls(**d)

    def to_dict(self) -> dict:
        """Inverse of `from_dict` (JSON-serialisable)."""
        return dataclasses.asdict(self)


# EngineConfig's options that take one of a fixed set of values: a Literal each, so its flag
# lists (and argparse checks) the choices; __post_init__ checks them too, for Python callers.
Attention = Literal["auto", "kernel", "pallas", "pallas-interpret", "xla"]
# "auto", "xla" and the bf16 kernel's paths (jaxpipe.kernels.matmul.PATHS).
Matmul = Literal["auto", "xla", "portable", "avx2", "avx512_bf16", "amx"]
Scheduler = Literal["auto", "seesaw", "prefill_first", "decode_first", "tdpipe", "throttle"]
Predictor = Literal["learned", "oracle"]  # jaxpipe.scheduler.predictor
Sampler = Literal["device", "host"]
ATTENTION = typing.get_args(Attention)
MATMULS = typing.get_args(Matmul)
SCHEDULERS = typing.get_args(Scheduler)
PREDICTORS = typing.get_args(Predictor)
SAMPLERS = typing.get_args(Sampler)


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
        machine and takes the faster (jaxpipe.kernels.dispatch).
    matmul: which implementation multiplies bf16 weights on CPU: "auto" (each weight and row
        count timed once per machine, the fastest used: XLA's dot or a path of the bf16
        kernel; jaxpipe.kernels.dispatch), "xla", or one kernel path for every matmul:
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
        stops is then in one more step, whose token for it is discarded.
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
        host; jaxpipe.distributed): JAX's coordinator listens there and the leader's control
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
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 4096
    kv_cache_gb: float | None = None
    kv_cache_tokens: int | None = None
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
    prefix_caching: bool = True
    memory_utilization: float | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(
                f"EngineConfig.model must be a preset name or a path, got {self.model!r}")
        _set(self, "model", str(self.model))
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_num_seqs is not None:
            _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 16, 1 << 20)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, 1 << 20)
        _check_int("seed", self.seed, 0, 2**32 - 1)
        _check_number("kv_cache_gb", self.kv_cache_gb, "a positive number or None",
                      lambda x: x > 0)
        _check_number("memory_utilization", self.memory_utilization, "a number in (0, 1] or None",
                      lambda x: 0 < x <= 1)
        if self.attention not in ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {ATTENTION}, "
                             f"got {self.attention!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"EngineConfig.matmul must be one of {MATMULS}, "
                             f"got {self.matmul!r}")
        _check_number("host_kv_gb", self.host_kv_gb, "a number >= 0 or None", lambda x: x >= 0)
        if self.host_kv_tokens is not None:
            _check_int("host_kv_tokens", self.host_kv_tokens, 0, 1 << 40)
        if self.kv_cache_tokens is not None:
            _check_int("kv_cache_tokens", self.kv_cache_tokens, 1, 1 << 40)
        for name in ("overlap", "detok_worker", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"EngineConfig.sampler must be one of {SAMPLERS}, "
                             f"got {self.sampler!r}")
        _check_int("sampler_threads", self.sampler_threads, 1, 256)
        self.check_scheduler(self.scheduler)
        self._check_policy_knobs()
        if self.compilation_cache_dir is not None:
            _set(self, "compilation_cache_dir", str(Path(self.compilation_cache_dir).expanduser()))
        self._check_layouts()
        self._check_cluster()

    def _check_cluster(self) -> None:
        """Fill the cluster settings from JAX's environment variables and check them."""
        from jaxpipe import distributed

        settings = distributed.settings(self.coordinator, self.num_processes, self.process_id)
        names = ("coordinator", "num_processes", "process_id")
        for name, value in zip(names, settings, strict=True):
            _set(self, name, value)
        distributed.check(self.coordinator, self.num_processes, self.process_id,
                          load_mesh(self.mesh).num_devices, self.sampler)

    def check_scheduler(self, name: str) -> None:
        """Refuse a policy name this config cannot run (unknown, or seesaw with no host tier)."""
        if name not in SCHEDULERS:
            raise ValueError(f"EngineConfig.scheduler must be one of {SCHEDULERS}, "
                             f"got {name!r}")
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
        if self.tdpipe_predictor not in PREDICTORS:
            raise ValueError(f"EngineConfig.tdpipe_predictor must be one of {PREDICTORS}, "
                             f"got {self.tdpipe_predictor!r}")
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


def _check_number(name: str, value, accepted: str, ok) -> None:
    """None, or a number (not a bool) for which ok(value) holds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"EngineConfig.{name} must be {accepted}, got {value!r}")


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"EngineConfig.{name} must be an integer in [{lo}, {hi}], got {value!r}")
