"""The runner owns every device array and compiled function; it decides nothing.

One runner for every mesh: a single device is the mesh `pp=1,tp=1`. It holds the weights and
the paged KV pool in the current phase's layout (prefill or decode; `set_phase` re-shards both
with `device_put`), the penalty state of each slot (a sequence's row of per-token counts), and
the compiled step programs of `pipeline.py`, one per token bucket (`buckets.py`).

A step (`step`) takes a ragged token batch built by the caller (`step_inputs.build`: tokens,
positions, block-table rows, spans), runs every layer over it, then the LM head and the
sampler on the rows that sample a token. Sampling is a separate small program so that its
variants (greedy, top-k/p, penalties, logprobs) do not multiply the model's compilations.
`dispatch` returns at once (`Dispatched`: the tokens on their way to the host); the next step
may take its input tokens from them on the device. With a host sampler (`sampler="host"`)
the step ends at the LM head instead and `HostSampled.fetch` samples on the host's worker
threads; the penalty state then lives on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels import ragged_attention
from jaxpipe.kernels.paged import OUT_OF_RANGE, storage_dtype
from jaxpipe.kv import device_cache
from jaxpipe.kv.device_cache import BLOCK, KVCache
from jaxpipe.model import orbax_dir, quantized
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import Quantization, QuantizedWeight
from jaxpipe.runtime import (
    memory,
    pipeline,
    prompt_scores,
    sampling,
    sharding,
    sizing,
    step_inputs,
)
from jaxpipe.runtime.buckets import Buckets, round_up
from jaxpipe.runtime.flow import MicroBatch, Pending
from jaxpipe.runtime.host_sampler import HostSampler, host_logprobs
from jaxpipe.runtime.kernel_choice import (
    HEAD_ROWS,
    ROWS,
    AttentionCase,
    KernelChoice,
    experts_path,
)
from jaxpipe.runtime.sampling import SamplingTensors
from jaxpipe.runtime.step_inputs import StepInputs
from jaxpipe.runtime.ticks import Ticks

PHASES = ("prefill", "decode")
_STATIC = ("mode", "penalties", "num_logprobs")


@dataclass(frozen=True)
class Moved:
    """What a layout switch moved: seconds for the weights and for the KV pool (its live
    blocks, kv_blocks of them, and the new layout's empty pool around them)."""

    weights_seconds: float
    kv_seconds: float
    kv_blocks: int

    @property
    def seconds(self) -> float:
        return self.weights_seconds + self.kv_seconds


@dataclass
class StepOutput:
    """Host-side results of one step, one row per sampled sequence (padding rows removed)."""

    tokens: np.ndarray  # [n] i32
    logprob: np.ndarray | None = None  # [n] f32: logprob of each sampled token
    top_ids: np.ndarray | None = None  # [n, num] i32
    top_logprobs: np.ndarray | None = None  # [n, num] f32
    prompt: prompt_scores.PromptScores | None = None  # the step's prompt positions' scores


@dataclass(frozen=True)
class SamplingInputs:
    """Host-built sampling inputs of one step plus its static switches."""

    tensors: SamplingTensors
    mode: str
    penalties: bool
    num_logprobs: int | None  # None: no logprobs this step


class Dispatched:
    """A dispatched step: its sampled tokens (padded to the runner's `max_rows`, for the next
    step's `prev`) and logprobs on the device, on their way to the host."""

    def __init__(self, done: jax.Array, n: int, tokens: jax.Array | None = None, lp=None):
        self.done, self.n, self.tokens, self.lp = done, n, tokens, lp
        self.prompt = None  # (device parts, count) of its prompt scores (`_score_prompt`)

    def ready(self) -> bool:
        """Whether the device has finished the step (never blocks)."""
        return self.done.is_ready()

    def wait(self) -> None:
        """Block until the device has finished the step."""
        jax.block_until_ready(self.done)

    def fetch(self) -> StepOutput:
        """The step's results on the host (waits for the device)."""
        if self.tokens is None:
            self.wait()
            return _with_prompt(StepOutput(np.zeros(0, np.int32)), self.prompt)
        return _with_prompt(_to_host(self.tokens, self.lp, self.n), self.prompt)


class HostSampled:
    """A dispatched step whose logits the host samples (`host_sampler.py`). `sample()` runs
    the host sampler once (when the next step needs its tokens, or when it lands) and puts
    the tokens on the device too, for the next step to take its inputs from."""

    def __init__(self, logits: jax.Array, lp, slots: np.ndarray,
                 sampling_inputs: SamplingInputs,
                 sampler: HostSampler, put):
        self.logits, self.lp, self.slots, self.sampling_inputs = logits, lp, slots, sampling_inputs
        self._sampler, self._put = sampler, put  # put: host tokens -> padded device tokens
        self._out: StepOutput | None = None
        self._tokens: jax.Array | None = None
        self.prompt = None  # (device parts, count) of its prompt scores

    def ready(self) -> bool:
        return self.logits.is_ready()

    def wait(self) -> None:
        jax.block_until_ready(self.logits)

    @property
    def sampled(self) -> bool:
        return self._out is not None

    @property
    def tokens(self) -> jax.Array | None:
        """The sampled tokens on the device, for the next step's `prev` (None until sampled;
        put there only when a step asks for them)."""
        if self._out is not None and self._tokens is None:
            self._tokens = self._put(self._out.tokens)
        return self._tokens

    def sample(self) -> StepOutput:
        """Sample the step's rows on the host (once; waits for the logits)."""
        if self._out is None:
            n, sampling_inputs = len(self.slots), self.sampling_inputs
            x = np.asarray(self.logits)[:n]
            si = sampling_inputs
            tokens = self._sampler.sample(x, self.slots, si.tensors, si.mode, si.penalties)
            self._out = StepOutput(tokens)
            if self.lp is not None:
                lse, top_ids, top_lp = (np.asarray(a)[:n] for a in self.lp)
                self._out.logprob = host_logprobs(x, tokens, lse)
                self._out.top_ids, self._out.top_logprobs = top_ids, top_lp
            _with_prompt(self._out, self.prompt)
        return self._out

    fetch = sample


def _sample(logits, prompt_mask, out_counts, slots, tensors, *, mode, penalties, num_logprobs,
            out_rows):
    """Tokens for logits [n, V] of slots [n] (out of range: padding), zero-padded to
    `out_rows`; updates the penalty counts of those slots."""
    pm = jnp.take(prompt_mask, slots, axis=0, mode="clip") if penalties else None
    oc = jnp.take(out_counts, slots, axis=0, mode="clip") if penalties else None
    tokens = sampling.sample(logits, tensors, pm, oc, mode=mode, penalties=penalties)
    if penalties:
        out_counts = out_counts.at[slots, tokens].add(1, mode="drop")
    lp = None if num_logprobs is None else sampling.compute_logprobs(logits, tokens, num_logprobs)
    return jnp.pad(tokens, (0, out_rows - tokens.shape[0])), lp, prompt_mask, out_counts


def _set_penalty_row(prompt_mask, out_counts, slot, mask_row, count_row):
    """One slot's penalty state: which tokens its prompt has, how often each was output."""
    return prompt_mask.at[slot].set(mask_row), out_counts.at[slot].set(count_row)


class Placement:
    """One layout's mesh and the shardings of everything that moves between layouts."""

    def __init__(self, cfg: ModelConfig, padding: sharding.Padding, layout: Layout, devices,
                 num_blocks: int, kv_dtype, kernels: KernelChoice | None = None,
                 quant: Quantization | None = None):
        """`kernels`: the weights' measured choices; the matmul weights whose chosen
        implementation is a C++ kernel (`self.packed`, and the LM head: `self.head_path`)
        are kept in its panel order (`kernels/matmul.py`, int8's for int8 weights), each
        device's shards reordered. None: XLA's dot on natural order (f32 weights, or no
        kernels). `quant`: the weights kept quantized (`model/quantized.py`; None: none)."""
        self.layout, self.quant = layout, quant
        self.mesh = sharding.make_mesh(layout, devices)
        self.params = sharding.param_shardings(cfg, padding, layout, self.mesh, quant)
        # every parameter as placed before it is quantized (a tied head: the embedding)
        self.float_params = sharding.param_shardings(cfg, padding, layout, self.mesh)
        layers, head = pipeline.kernel_matmuls(cfg, padding, self.params, kernels, layout)
        self.packed = {n: partial(kernels.impl, mm) for n, mm in layers.items()}
        self.head_path = None if head is None else partial(kernels.impl, head)
        self.experts = partial(experts_path, chosen=kernels)  # the experts' chooser
        self._pack = self._unpack = None  # None: the step reads the natural order
        # Weights in GGUF blocks are read in the file's order: nothing to pack.
        names = tuple(n for n in self.packed if not isinstance(self.params[n], GgufWeight))
        head_name = "lm_head" if "lm_head" in self.params else "embed"
        head = self.head_path is not None and not isinstance(self.params[head_name], GgufWeight)
        if names or head:
            args = (cfg, layout, self.mesh, names, head, quant)
            self._pack, self._unpack = (pipeline.pack_program(*args),
                                        pipeline.unpack_program(*args))
        self.logits = pipeline.logits_program(cfg, cfg.vocab_size, layout, self.mesh,
                                              self.head_path, quant)
        kv = sharding.kv_sharding(cfg, padding, layout, self.mesh, num_blocks, kv_dtype)
        self.cache = KVCache(kv, kv)
        self._kv_shape = sharding.kv_shape(cfg, padding, num_blocks, kv_dtype)
        self._kv_dtype = kv_dtype
        spec = sharding.spec(("layers", "kv_heads", "seq", "head_dim"), layout)
        self.staging = [NamedSharding(self.mesh, spec)] * 2  # one sequence's K, V
        self.act_sharding = NamedSharding(self.mesh, P("pp"))  # [pp, T, E]: a slot per stage
        self.spare: KVCache | None = None  # this layout's zeroed pool, kept by `keep`

    def pack(self, params: dict, keep: dict | None = None) -> dict:
        """Weights placed in this layout (natural order; donated) as the step reads them.
        `keep`: weights that must outlive the packing (another layout's, kept): a leaf of
        `params` holding one of their buffers is copied before the program takes it."""
        if self._pack is None:
            return params
        return self._pack(params if keep is None else sharding.unshared(params, keep))

    def unpack(self, params: dict) -> dict:
        """The step's weights in this layout back in natural order (a new tree), for a
        re-shard."""
        return self._unpack(params) if self._unpack else params

    def empty_cache(self) -> KVCache:
        """A zeroed KV pool in this layout's sharding: the one `keep` kept, else one created
        directly in the sharding (never whole on one device). On CPU it takes no memory until
        blocks are written (`memory.zeros`)."""
        if self.spare is not None:
            cache, self.spare = self.spare, None
            return cache
        return KVCache(*(memory.zeros(self._kv_shape, self._kv_dtype, self.cache.k)
                         for _ in range(2)))

    def keep(self, cache: KVCache, readers: list[jax.Array]) -> None:
        """Zero `cache` (this layout's pool, which the runner leaves) and keep it for the next
        `empty_cache`: `memory.clear` gives its pages back to the OS, so a kept pool costs
        neither time nor memory until blocks are written. Off CPU it is freed. Its
        buffers must be its own, as the runner's programs make them. `readers`: outputs of
        programs that may still be reading the pool (swap-outs the host tier dispatched);
        the pool is cleared only once they are done."""
        jax.block_until_ready((cache, [a for a in readers if not a.is_deleted()]))
        if all(memory.clear(array) for array in cache):
            # New arrays over the same buffers: the old ones may hold a cached NumPy copy of
            # what was there before.
            self.spare = KVCache(*(jax.make_array_from_single_device_arrays(
                a.shape, a.sharding, [s.data for s in a.addressable_shards]) for a in cache))
            return
        for array in cache:
            array.delete()

    def close(self) -> None:
        if self.spare is not None:
            for array in self.spare:
                array.delete()
            self.spare = None


class Runner:
    """Device state (weights, the KV block pool, penalty counts per slot) and the compiled
    step over a prefill and a decode layout of the same devices (one device: both pp=1,tp=1).
    """

    def __init__(self, cfg: ModelConfig, weights: dict | Path, buckets: Buckets,
                 num_slots: int, max_len: int, dtype, layouts: dict[str, Layout], devices,
                 num_blocks: int, attention: str = "auto", sampler: str = "device",
                 sampler_threads: int = 2, kernels: KernelChoice | None = None,
                 kv_cache_dtype: str = "auto", quant: Quantization | None = None):
        """`weights`: unpadded weights (name -> host or device array, as `param_decls`), or
        the path of an orbax checkpoint to restore straight into the prefill layout.
        `sampler`: "device" (the sampling program) or "host" (`host_sampler.py` on
        `sampler_threads` worker threads). `kernels`: which implementation runs each
        matmul and the attention, measured on this machine (None: XLA's dot, and the C++
        attention kernel where it builds). `kv_cache_dtype`: "auto" (the pool in `dtype`) or
        "int8" (`kernels/kv_int8.py`). `quant`: the weights quantized at load
        (`EngineConfig.quantization`; None: none)."""
        _check_runner_args(layouts, num_blocks)
        self.config, self.buckets = cfg, buckets
        self.num_slots, self.max_len, self.num_blocks = num_slots, max_len, num_blocks
        self.max_blocks = device_cache.blocks_for(max_len)
        self.kv_chunk = kv_chunk_tokens(max_len)
        self.kv_dtype = storage_dtype(dtype, devices[0].platform, kv_cache_dtype)
        self.quant = quant
        self._init_placements(dtype, layouts, devices, attention, kernels)
        self._init_device_state(weights, dtype, devices)
        self._init_sampling(sampler, sampler_threads)
        self._init_programs()

    def _init_placements(self, dtype, layouts: dict[str, Layout], devices, attention: str,
                         kernels: KernelChoice | None) -> None:
        """The step's matmul precision and attention, and each phase's `Placement`."""
        # f32 means f32 on every backend: GPUs multiply f32 in TF32 unless told otherwise.
        self.precision = "highest" if jnp.dtype(dtype) == jnp.float32 else None
        if devices[0].platform == "cpu":
            memory.keep_freed_memory()
        kv_dtype = self.kv_dtype
        self.attention = attention_impl(attention, devices, kernels and partial(
            kernels.attention, attention_cases(self.config), kv_dtype))
        self.layouts = dict(layouts)
        self.padding = sharding.padding_for(self.config, self.layouts.values())
        weight_kernels = kernels if jnp.dtype(dtype) == jnp.bfloat16 else None
        self.placements = {p: Placement(self.config, self.padding, self.layouts[p], devices,
                                        self.num_blocks, kv_dtype, weight_kernels, self.quant)
                           for p in PHASES}

    def _init_device_state(self, weights: dict | Path, dtype, devices) -> None:
        """The weights and an empty KV pool, in the prefill layout."""
        self.phase = "prefill"
        self.params = self._place_weights(weights, dtype)
        self.keep_weights = sizing.weight_copies(self.layouts, devices) > 1
        self._kept_weights: dict[str, dict] = {}  # phase -> its layout's weights, not in use
        self.cache = self.placements[self.phase].empty_cache()
        self._reading: list[jax.Array] = []  # `kv_extract` outputs maybe still being read

    def _init_sampling(self, sampler: str, sampler_threads: int) -> None:
        """The sampler (`set_sampler`), the penalty state and the sampling programs."""
        self.host_sampler: HostSampler | None = None
        self.sampler: str | None = None
        self.sampler_threads = sampler_threads
        self._unsampled: list[HostSampled] = []  # dispatched, not yet host-sampled
        self.set_sampler(sampler)
        self._logprob_parts = jax.jit(sampling.logprob_parts, static_argnames=("num",))
        self._sample = jax.jit(partial(_sample, out_rows=self.buckets.max_rows),
                               static_argnames=_STATIC,
                               donate_argnames=("prompt_mask", "out_counts"))
        self._set_penalties = jax.jit(_set_penalty_row,
                                      donate_argnames=("prompt_mask", "out_counts"))

    def _init_programs(self) -> None:
        """The step programs' cache, the pipelines' ticks and the compile counters; the
        current layout's swap programs compiled (`_warm_swaps`)."""
        self._no_prev: dict[str, jax.Array] = {}  # per phase: `prev` of a step with no feed
        self.ticks = Ticks(self.placements, self.config.hidden_size, self._run_tick,
                           self._results)
        self._feed: jax.Array | None = None  # the entering step's `prev` tokens
        self._programs: dict[tuple, object] = {}
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0
        self._swaps_warm: set[str] = set()
        self._warm_swaps()

    def set_sampler(self, sampler: str) -> None:
        """Sample on the device ("device") or on the host ("host"). Penalty state is not
        carried over: call it only while no slot is in use (each sequence's state is set
        when it enters a slot)."""
        if sampler not in ("device", "host"):
            raise ValueError(f"sampler must be 'device' or 'host', got {sampler!r}")
        if sampler == self.sampler:
            return
        self.sampler = sampler
        if self.host_sampler is not None:
            self.host_sampler.close()
        self.host_sampler = HostSampler(self.num_slots, self.sampler_threads) if (
            sampler == "host") else None
        rows = 0 if self.host_sampler else self.num_slots  # the host sampler keeps its own
        replicated = NamedSharding(self.placements[self.phase].mesh, P())
        shape = (rows, self.config.vocab_size)  # a copy per device: 0.5 GB of them on cpu-8
        self.prompt_mask = memory.zeros(shape, bool, replicated)
        self.out_counts = memory.zeros(shape, np.int32, replicated)

    @property
    def layout(self) -> Layout:
        """The layout weights and KV are in now."""
        return self.placements[self.phase].layout

    def set_phase(self, phase: str, live_blocks: list[int] | None = None) -> Moved | None:
        """Put weights and KV in `phase`'s layout; None when nothing moved (same phase, or
        both phases share one layout). `live_blocks`: the pool's blocks that hold data (the
        live sequences'); only those move, into the new layout's empty pool (`Placement.keep`
        keeps the pool a layout had, zeroed, where that is free). None moves the whole pool."""
        if phase == self.phase:
            return None
        if self.ticks.in_flight():
            raise RuntimeError(f"a layout switch needs an empty pipeline; "
                               f"{self.ticks.in_flight()} micro-batches are in flight (drain "
                               "them first)")
        left, old, self.phase = self.phase, self.placements[self.phase], phase
        place = self.placements[phase]
        params, weights_seconds = self._weights_in(place, phase, left)
        start = time.perf_counter()
        cache, blocks = self._move_kv(old, place, live_blocks)
        jax.block_until_ready(cache)
        kv_seconds = time.perf_counter() - start
        if params is self.params and cache is self.cache:
            return None
        self.params, self.cache = params, cache
        self._warm_swaps()
        return Moved(weights_seconds, kv_seconds, blocks)

    def _weights_in(self, place: Placement, phase: str, left: str) -> tuple[dict, float]:
        """The weights in `place`'s layout and the seconds it took to put them there: the
        copy kept from the last time `phase` ran (`keep_weights`), else a re-shard (in
        natural order: each layout packs its own shards). With `keep_weights` the weights of
        the layout left (`left`'s) are kept."""
        params = self._kept_weights.pop(phase, None)
        seconds = 0.0
        if params is None and sharding.placed({k: self.params[k] for k in place.params},
                                               place.params):
            params = self.params  # the same shards: packed alike too
        elif params is None:
            start = time.perf_counter()
            natural = self.placements[left].unpack(self.params)
            kept = self.params if self.keep_weights else None
            params = jax.block_until_ready(place.pack(sharding.reshard(natural, place.params),
                                                      keep=kept))
            seconds = time.perf_counter() - start
        if self.keep_weights and params is not self.params:
            self._kept_weights[left] = self.params
        return params, seconds

    def _move_kv(self, old: Placement, new: Placement, live_blocks: list[int] | None
                 ) -> tuple[KVCache, int]:
        """The pool in `new`'s layout, and how many blocks moved: all (live_blocks None), the
        live ones gathered in `old`'s layout, moved and scattered into an empty pool, or
        none when the layouts shard the pool alike."""
        if sharding.placed(self.cache, new.cache):
            return self.cache, 0
        if live_blocks is None:
            return sharding.reshard(self.cache, new.cache), self.num_blocks
        count = len(live_blocks)
        if count:  # padded to a power of two: one gather / scatter program per size
            width = 1 << (count - 1).bit_length()
            ids = np.full(width, OUT_OF_RANGE, np.int32)
            ids[:count] = live_blocks
            live = device_cache.read_blocks(self.cache, ids, length=width * BLOCK,
                                            block_axis=1)
            live = jax.block_until_ready(live)
        old.keep(self.cache, self._reading)
        self._reading = []
        cache = new.empty_cache()
        if count:
            staged = KVCache(*sharding.put(list(live), new.staging))
            cache = device_cache.write_blocks(cache, ids, staged, block_axis=1)
        return cache, count

    # ---- the step: micro-batches flowing through the stages ----------------------------------

    def step(self, inputs: StepInputs, slots: np.ndarray,
             sampling_inputs: SamplingInputs) -> StepOutput:
        """Run one ragged step and wait for its tokens (see `dispatch`)."""
        return self.dispatch(inputs, slots, sampling_inputs).fetch()

    def dispatch(self, inputs: StepInputs, slots: np.ndarray, sampling_inputs: SamplingInputs,
                 prev: Dispatched | None = None, score: prompt_scores.PromptScore | None = None
                 ) -> Dispatched | HostSampled | Pending:
        """Start one ragged step, a micro-batch entering the first stage (returns at once);
        sample a token for its first len(slots) rows (their penalty state is that of `slots`)
        when it leaves the last one. `sampling_inputs` has one entry per sampled row, padded
        to `buckets.sample_rows` (None: nothing sampled). `prev`: the step before, whose sampled
        tokens `inputs.feed` refers to (it may still be running; one stage only). On one
        stage the results are the step's own (`Dispatched`, or `HostSampled`); with more, a
        `Pending` filled when the micro-batch leaves (its `wait` drains the pipeline).
        `score`: its prompt positions to score (`prompt_scores.py`; `StepOutput.prompt`)."""
        mb = MicroBatch(inputs, np.asarray(slots), sampling_inputs, Pending(self.drain_one),
                        score=score)
        self._feed = prev.tokens if prev is not None and prev.tokens is not None else None
        # (a host-sampled step not yet sampled feeds nothing: the executor samples it first
        # when this step takes tokens from it)
        self.ticks.enter(self.phase, mb)
        self._feed = None
        return mb.pending.done if mb.pending.done is not None else mb.pending

    def drain_one(self) -> None:
        """One idle tick: every micro-batch in flight one stage nearer the exit (a device call
        the mirrored runner sends its followers too)."""
        self.ticks.drain()

    def logits(self, inputs: StepInputs, rows: int, prev: Dispatched | None = None
               ) -> jax.Array:
        """Run one step through every stage; logits [rows, V] f32 of the last token of rows
        0..rows-1 (the LM head runs on those rows only)."""
        return self._head_logits(self.hidden(inputs, prev), rows)

    def hidden(self, inputs: StepInputs, prev: Dispatched | None = None) -> jax.Array:
        """Run one step through every stage (the pipeline drained after it): the residual
        [max_rows, E] of each row's last token (KV written)."""
        out = self.dispatch(inputs, np.zeros(0, np.int32), None, prev)
        return (out.result() if isinstance(out, Pending) else out).done

    def logits_many(self, steps: list[tuple[StepInputs, int]]) -> list[jax.Array]:
        """`logits` of several steps flowing through the stages one after another (the
        pipeline drained after the last): each one's logits [rows, V]."""
        pending = [self.dispatch(inputs, np.zeros(0, np.int32), None) for inputs, _ in steps]
        hidden = [(p.result() if isinstance(p, Pending) else p).done for p in pending]
        return [self._head_logits(h, rows) for h, (_, rows) in zip(hidden, steps, strict=True)]

    def _head_logits(self, hidden: jax.Array, rows: int) -> jax.Array:
        """The LM head over the first `rows` rows of a step's `hidden` [max_rows, E]."""
        return self._once(("logits", self.phase, rows), self.placements[self.phase].logits,
                          self.params, hidden, rows=rows)

    def _run_tick(self, inputs: StepInputs, act: jax.Array, score: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
        """The current layout's tick program on a tick's stacked `inputs` and the carried
        activations `act` (donated), with the KV pool: (hidden of the rows leaving the last
        stage, then those of its prompt positions `score` (None: none), the activations for
        the next tick)."""
        max_kv = 0 if self.attention != "xla" else round_up(
            min(int(inputs.kv_len.max()), self.max_len), self.buckets.kv_len)
        key = (self.phase, inputs.num_tokens, inputs.num_rows, max_kv,
               0 if score is None else len(score))
        fed = self._feed if self._feed is not None else self._zeros()
        hidden, self.cache, act = self._once(key, self._program(max_kv), self.params,
                                             self.cache, act, inputs, fed, score)
        return hidden, act

    def lowered(self, inputs: StepInputs):
        """The tick program lowered for `inputs` entering an empty pipeline (at the runner's
        matmul precision), for inspection: its HLO text, its compiled memory analysis."""
        tick = step_inputs.stack([inputs] + [None] * (self.layout.pp - 1), inputs.num_tokens,
                                 inputs.num_rows)
        max_kv = 0 if self.attention != "xla" else self.max_len
        with jax.default_matmul_precision(self.precision):
            return self._program(max_kv).lower(
                self.params, self.cache, self.ticks.carried(self.phase, inputs.num_tokens), tick,
                self._zeros())

    def _results(self, hidden: jax.Array, mb: MicroBatch) -> Dispatched | HostSampled:
        """Sample the rows of micro-batch `mb`, which left the last stage with `hidden`, and
        score its prompt positions (`mb.score`)."""
        out = self._sampled(hidden, mb)
        if mb.score is not None:
            out.prompt = self._score_prompt(hidden, mb.score)
        return out

    def _sampled(self, hidden: jax.Array, mb: MicroBatch) -> Dispatched | HostSampled:
        n = len(mb.slots)
        if n == 0:  # only prompt chunks that do not end their prompt: nothing to sample
            return Dispatched(hidden, 0)
        sampling_inputs = mb.sampling_inputs
        rows = sampling_inputs.tensors.temperature.shape[0]
        logits = self._head_logits(hidden, rows)
        if self.host_sampler is not None:
            lp = None if sampling_inputs.num_logprobs is None else self._logprob_parts(
                logits, num=sampling_inputs.num_logprobs)
            out = HostSampled(logits, lp, mb.slots, sampling_inputs, self.host_sampler,
                              self._put_tokens)
            self._unsampled = [h for h in self._unsampled if not h.sampled] + [out]
            return out
        padded = np.full(rows, self.num_slots, np.int32)
        padded[:n] = mb.slots
        tokens, lp, self.prompt_mask, self.out_counts = self._sample(
            logits, self.prompt_mask, self.out_counts, padded, sampling_inputs.tensors,
            mode=sampling_inputs.mode, penalties=sampling_inputs.penalties,
            num_logprobs=sampling_inputs.num_logprobs)
        return Dispatched(tokens, n, tokens, lp)

    def _score_prompt(self, hidden: jax.Array, score: prompt_scores.PromptScore):
        """The LM head and log-softmax over the prompt positions `score` kept after the
        rows in `hidden` [max_rows + S, E]: (device parts, count) for `prompt_scores.to_host`."""
        width = len(score.index)
        kept = hidden[self.buckets.max_rows:]
        logits = self._once(("prompt_logits", self.phase, width),
                            self.placements[self.phase].logits, self.params, kept, rows=width)
        return prompt_scores.scores(logits, score.target, num=score.num), score.count

    def _put_tokens(self, tokens: np.ndarray) -> jax.Array:
        """Host-sampled tokens as a `prev` for the next step (padded to max_rows)."""
        padded = np.zeros(self.buckets.max_rows, np.int32)
        padded[:len(tokens)] = tokens
        return jax.device_put(padded, self._zeros().sharding)

    def _zeros(self) -> jax.Array:
        """`prev` tokens for a step that feeds none (one replicated array per phase)."""
        if self.phase not in self._no_prev:
            place = self.placements[self.phase]
            self._no_prev[self.phase] = jax.device_put(
                np.zeros(self.buckets.max_rows, np.int32), NamedSharding(place.mesh, P()))
        return self._no_prev[self.phase]

    def _program(self, max_kv: int):
        key = (self.phase, max_kv)
        if key not in self._programs:
            place = self.placements[self.phase]
            opts = pipeline.StageOptions(
                self.attention, max_kv, packed=place.packed, experts=place.experts,
                quant=self.quant, head_packed=place.head_path is not None,
                windows=sharding.layer_windows(self.config, self.padding),
                moe_layers=sharding.layer_experts(self.config, self.padding))
            self._programs[key] = pipeline.tick_program(
                self.config, place.layout, place.mesh, opts, out_rows=self.buckets.max_rows)
        return self._programs[key]

    def _once(self, key: tuple, fn, *args, **kwargs):
        """Call a compiled piece at the runner's matmul precision (part of jit's cache key, so
        every call sets it); the first call of each shape is timed as its compilation."""
        with jax.default_matmul_precision(self.precision):
            return self._timed_first(key, fn, *args, **kwargs)

    def _timed_first(self, key: tuple, fn, *args, **kwargs):
        if key in self.compiled:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.compiled.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out

    def control_stats(self) -> dict:
        """Counters of the control channel to other processes (none here: `MirroredRunner`
        has them)."""
        return {}

    def kernel_choices(self) -> dict:
        """What runs the step in the current layout: the attention ("kernel": the C++ one),
        and each matmul weight's implementation at the kernel choice's measured row counts
        ("xla": XLA's dot on natural order; else a bf16 kernel path)."""
        place = self.placements[self.phase]

        def by_rows(path, rows) -> dict[str, str]:
            return {str(m): path(m) if path else "xla" for m in rows}

        matmuls = {n: by_rows(place.packed.get(n), ROWS) for n in pipeline.MATMUL_PARAMS}
        matmuls["lm_head"] = by_rows(place.head_path, HEAD_ROWS)
        return {"attention": "kernel" if self.attention == "cpu" else self.attention,
                "matmul": matmuls}

    def close(self) -> None:
        """Free every device array (weights, KV pool, penalty state) and stop the host
        sampler's threads; the runner cannot step afterwards."""
        if self.host_sampler is not None:
            self.host_sampler.close()
            self.host_sampler = None
        self.ticks.close()
        state = (self.params, self._kept_weights, self.cache, self.prompt_mask,
                 self.out_counts, self._no_prev)
        for array in jax.tree.leaves(state):
            if not array.is_deleted():
                array.delete()
        for place in self.placements.values():
            place.close()
        self._unsampled, self._reading = [], []
        memory.release_freed_memory()

    # ---- per-slot state and KV moves ----------------------------------------------------------

    def restore_penalties(self, slot: int, prompt: list[int], output: list[int]) -> None:
        """Set `slot`'s penalty state for a sequence that moved there (prefilled, swapped in,
        or recomputed): the state is per slot and does not travel with the KV."""
        if self.host_sampler is not None:
            for pending in self._unsampled:  # sampled with their slots' state before this
                pending.sample()
            self._unsampled = []
            self.host_sampler.restore(slot, prompt, output)
            return
        vocab = self.prompt_mask.shape[1]
        mask = np.zeros(vocab, bool)
        mask[prompt] = True
        counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32)
        self.prompt_mask, self.out_counts = self._set_penalties(
            self.prompt_mask, self.out_counts, slot, mask, counts)

    def kv_extract(self, blocks: list[int], tokens: int) -> list[jax.Array]:
        """Positions 0..tokens-1 of the sequence in `blocks`, in chunks of `kv_chunk`
        positions: [K0, V0, K1, V1, ...], each [L', Hkv', kv_chunk, D] in the current
        layout's shards (layers over pp, heads over tp); the last chunk's tail is garbage.
        Fixed-size chunks: one extract program per layout whatever the length."""
        out = []
        for ids in self._chunks(blocks, tokens):
            out += device_cache.read_blocks(self.cache, ids, length=self.kv_chunk, block_axis=1)
        self._reading = [a for a in self._reading if not (a.is_deleted() or a.is_ready())] + out
        return out

    def kv_staging(self) -> list:
        """The current layout's shardings for `kv_extract`'s arrays (K, V of one chunk): a
        sequence swapped in arrives directly in the shards that will read it."""
        return self.placements[self.phase].staging

    def kv_insert(self, blocks: list[int], arrays: list[jax.Array]) -> None:
        """Write chunks from `kv_extract` (of any layout) into the sequence's `blocks`."""
        for i, ids in enumerate(self._chunks(blocks, len(arrays) // 2 * self.kv_chunk)):
            staged = KVCache(*jax.device_put(arrays[2 * i:2 * i + 2], self.kv_staging()))
            self.cache = device_cache.write_blocks(self.cache, ids, staged, block_axis=1)

    def _chunks(self, blocks: list[int], tokens: int) -> list[np.ndarray]:
        """`blocks` in `kv_chunk`-token pieces covering `tokens` positions, the last one
        padded with out-of-range ids (reads there are garbage, writes dropped)."""
        per = self.kv_chunk // BLOCK
        count = -(-tokens // self.kv_chunk)
        ids = np.full(count * per, OUT_OF_RANGE, np.int32)
        n = min(len(blocks), len(ids))
        ids[:n] = blocks[:n]
        return [ids[i * per:(i + 1) * per] for i in range(count)]

    def _warm_swaps(self) -> None:
        """Compile the current layout's chunk extract and insert (a chunk of out-of-range
        ids: nothing is written), timed as compilation, so no swap stops to compile."""
        if self.phase in self._swaps_warm:
            return
        start = time.perf_counter()
        ids = np.full(self.kv_chunk // BLOCK, OUT_OF_RANGE, np.int32)
        chunk = device_cache.read_blocks(self.cache, ids, length=self.kv_chunk, block_axis=1)
        self.cache = jax.block_until_ready(
            device_cache.write_blocks(self.cache, ids, KVCache(*chunk), block_axis=1))
        self._swaps_warm.add(self.phase)
        self.compile_seconds += time.perf_counter() - start

    def _place_weights(self, weights: dict | Path, dtype) -> dict:
        """Padded weights in the current layout: from host/device arrays (padded on the host),
        or restored from an orbax checkpoint straight into the layout's shardings."""
        place = self.placements[self.phase]
        decls = param_decls(self.config)
        if isinstance(weights, dict):  # one at a time: each host copy goes before the next
            placed = {}
            for name, decl in decls.items():
                placed[name] = self._put_weight(name, decl, weights[name], dtype)
                self._quantize(placed, name)
            return place.pack(self._quantize_head(placed))
        target = sharding.restore_target(self.config, self.padding, place.layout, place.mesh, dtype)
        cfg, values = orbax_dir.load_orbax(weights, target)
        if cfg != self.config:
            raise ValueError(f"orbax checkpoint {weights} holds {cfg}, expected {self.config}")
        placed = sharding.pad_on_device(self.config, values, self.padding, place.float_params)
        for name in decls:
            self._quantize(placed, name)
        return place.pack(self._quantize_head(placed))

    def _put_weight(self, name: str, decl, value, dtype):
        """Host weight `name` padded and placed in the current layout: in `dtype`, or as it
        is where it is kept in a GGUF file's blocks (a `GgufWeight`)."""
        place = self.placements[self.phase]
        if isinstance(value, GgufWeight):
            return jax.device_put(sharding.pad_blocks(name, decl, value, self.padding),
                                  place.params[name])
        return jax.device_put(sharding.pad_value(decl, value, self.padding).astype(dtype),
                              place.float_params[name])

    def _quantize(self, params: dict, name: str) -> None:
        """Replace weight `name` of `params` (placed, in the model's dtype) by its quantized
        form in the current layout, where `self.quant` quantizes it: the float copy goes
        as soon as the codes exist."""
        target = self.placements[self.phase].params.get(name)
        if isinstance(target, QuantizedWeight) and not isinstance(params[name], QuantizedWeight):
            decls = param_decls(self.config)
            fn = quantized.quantize_program(name, self.quant.axes(name, decls), self.quant.kind,
                                            target)
            params[name] = fn(params.pop(name))

    def _quantize_head(self, params: dict) -> dict:
        """`params` with a tied model's quantized LM head ("lm_head" [E, V], the embedding's
        transpose quantized) where the head is quantized: then the only copy, the float
        embedding goes (the lookup reads the head's rows, `decoder.embed`)."""
        target = self.placements[self.phase].params.get("lm_head")
        if isinstance(target, QuantizedWeight) and "lm_head" not in params:
            fn = quantized.quantize_program("lm_head", quantized.HEAD_AXES, self.quant.kind,
                                            target, transpose=True)
            params["lm_head"] = fn(params.pop("embed"))
        return params


def _check_runner_args(layouts: dict[str, Layout], num_blocks: int) -> None:
    """Refuse layouts with data parallelism (not supported yet) and an empty KV pool."""
    for phase, layout in layouts.items():
        if layout.dp > 1:
            raise ValueError(f"{phase} layout {layout}: dp > 1 is not supported yet; "
                             "use pp*tp*ep = the mesh's device count")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")


def kv_chunk_tokens(max_len: int) -> int:
    """Tokens per swap chunk: 1/16 of `max_len` in whole blocks (at least one block); the
    host tier rounds each sequence up to it."""
    return BLOCK * max(1, -(-max_len // (16 * BLOCK)))


def attention_impl(attention: str, devices, choose=None) -> str:
    """The step's attention for `EngineConfig.attention` on `devices`: "cpu" (the C++
    kernels), "pallas" (the Pallas kernel, GPU), "pallas-interpret" (it, interpreted: any
    backend, slow, for tests) or "xla". "auto": Pallas on GPU; on CPU, where the C++ kernels
    build, `choose()` ("kernel" or "xla": the kernel choice's measurement; None: the kernels),
    else XLA; "kernel": the C++ kernels or an error."""
    platform = devices[0].platform
    if attention in ("xla", "pallas-interpret"):
        return attention
    if attention == "pallas" or (attention == "auto" and platform == "gpu"):
        if platform != "gpu":
            raise ValueError(f"attention='pallas' needs a GPU (devices are {platform}); use "
                             "'pallas-interpret' to run the kernel interpreted")
        return "pallas"
    if platform != "cpu":
        if attention == "kernel":
            raise ValueError(f"attention='kernel' is the C++ CPU kernel; devices are "
                             f"{platform}")
        return "xla"
    if attention == "kernel" and not ragged_attention.available():
        raise RuntimeError("attention='kernel' but the ragged attention kernel cannot be built "
                           "here (see the warning above); use attention='auto' or 'xla'")
    if not ragged_attention.available():
        return "xla"
    return "cpu" if attention == "kernel" or choose is None or choose() == "kernel" else "xla"


def attention_cases(cfg: ModelConfig) -> list[AttentionCase]:
    """The steps the attention kernels is timed on: 64 decode rows after 512 tokens, and a
    256-token prompt chunk."""
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return [AttentionCase(*heads, rows=64, q_len=1, context=512),
            AttentionCase(*heads, rows=1, q_len=256, context=0)]


def _with_prompt(out: StepOutput, prompt) -> StepOutput:
    """`out` with its step's prompt scores on the host (prompt: (device parts, count))."""
    if prompt is not None and out.prompt is None:
        out.prompt = prompt_scores.to_host(*prompt)
    return out


def _to_host(tokens, lp, n: int) -> StepOutput:
    result = StepOutput(np.asarray(tokens)[:n])
    if lp is not None:
        tok_lp, top_ids, top_lp = (np.asarray(a)[:n] for a in lp)
        result.logprob, result.top_ids, result.top_logprobs = tok_lp, top_ids, top_lp
    return result
