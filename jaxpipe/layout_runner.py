"""The runner for multi-device layouts: prefill on one layout, decode on another.

Same interface as `Runner` (`prefill`, `decode`, `set_phase`, compile bookkeeping), different
strategy: each step is one whole-model program (`pipeline.py`) over a mesh, instead of one
program per layer on one device. The weights and the KV store are padded once (see
`sharding.py`) and live in the current phase's layout; `set_phase` moves both with
`sharding.reshard` when the phase's layout differs from the one they are in.

The KV block pool here is stacked, `[L', NB, Hkv', BLOCK, D]` for K and for V, so that the
`layers` axis can be split over pipeline stages (each stage holds and writes its own layers'
KV); the block table is `Runner`'s, sent with each step.

On a pipelined decode layout (pp > 1) a decode call runs up to `decode_steps` steps in one
program with the micro-batches kept in flight from step to step, sampling included, so that
the stages stay busy (`pipeline.multistep_decode_program`); the engine reads `decode_steps`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, shard_head, sharding
from jaxpipe.buckets import Buckets, round_up
from jaxpipe.config import ModelConfig
from jaxpipe.kv import device_cache
from jaxpipe.kv.device_cache import KVCache, storage_dtype
from jaxpipe.layout import Layout
from jaxpipe.model import loading
from jaxpipe.runner import (
    _STATIC,
    Runner,
    SamplingPlan,
    StepOutput,
    _block_table,
    _reset_penalty_rows,
    _sample,
    _set_penalty_row,
    _use_kernel,
    pack_prompts,
)

PHASES = ("prefill", "decode")
DEFAULT_DECODE_STEPS = 4  # decode steps per call on a pipelined decode layout


class Placement:
    """One layout's mesh and the shardings of everything that moves between layouts."""

    def __init__(self, cfg: ModelConfig, plan: sharding.PaddingPlan, layout: Layout, devices,
                 num_blocks: int):
        self.layout = layout
        self.mesh = sharding.make_mesh(layout, devices)
        self.params = sharding.param_shardings(cfg, plan, layout, self.mesh)
        kv = sharding.kv_sharding(cfg, plan, layout, self.mesh, num_blocks)
        self.cache = KVCache(kv, kv)


class LayoutRunner(Runner):
    """Device state and compiled steps over a prefill and a decode layout of the same devices.

    Inherits `Runner`'s sampling and compile bookkeeping; the model steps are its own."""

    def __init__(self, cfg: ModelConfig, weights: dict | Path, buckets: Buckets, num_slots: int,
                 max_len: int, dtype, layouts: dict[str, Layout], devices,
                 attention: str = "auto", prefill_microbatches_per_stage: int = 2,
                 decode_steps_per_call: int | None = None, num_blocks: int | None = None):
        """`weights`: unpadded weights (name -> host or device array, as `param_decls`), or
        the path of an orbax checkpoint to restore straight into the prefill layout.
        `decode_steps_per_call`: the `decode_steps` the engine asks for (default 1 when the
        decode layout has pp = 1, else DEFAULT_DECODE_STEPS). `num_blocks`: as `Runner`."""
        for phase, layout in layouts.items():
            if layout.dp > 1:
                raise ValueError(f"{phase} layout {layout}: dp > 1 is not supported yet; "
                                 "use pp*tp = the mesh's device count")
        self.decode_steps = _decode_steps(decode_steps_per_call, layouts["decode"])
        self.config, self.buckets = cfg, buckets
        self.use_kernel = _use_kernel(attention)
        self.num_slots, self.max_len = num_slots, max_len
        self.table, self.num_blocks = _block_table(num_slots, max_len, num_blocks)
        self.layouts = dict(layouts)
        self.prefill_microbatches_per_stage = prefill_microbatches_per_stage
        self.plan = sharding.plan_padding(cfg, self.layouts.values())
        self.placements = {p: Placement(cfg, self.plan, self.layouts[p], devices,
                                        self.num_blocks) for p in PHASES}
        self.phase = "prefill"
        place = self.placements[self.phase]
        self.params = self._place_weights(weights, dtype)
        self.cache = _zeros_cache(sharding.kv_shape(cfg, self.plan, self.num_blocks),
                                  storage_dtype(dtype), place.cache)
        replicated = NamedSharding(place.mesh, P())
        self.prompt_mask = jax.device_put(np.zeros((num_slots, cfg.vocab_size), bool),
                                          replicated)  # [N, V]
        self.out_counts = jax.device_put(np.zeros((num_slots, cfg.vocab_size), np.int32),
                                         replicated)  # [N, V]
        self._sample = jax.jit(_sample, static_argnames=_STATIC,
                               donate_argnames=("prompt_mask", "out_counts"))
        self._reset = jax.jit(_reset_penalty_rows, donate_argnames=("prompt_mask", "out_counts"))
        self._set_penalties = jax.jit(_set_penalty_row,
                                      donate_argnames=("prompt_mask", "out_counts"))
        self._programs: dict[tuple, object] = {}
        self.decode_busy: jax.Array | None = None  # [pp] i32, see decode_multistep
        self.decode_ticks = 0
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0

    def _place_weights(self, weights: dict | Path, dtype) -> dict:
        """Padded weights in the current layout: from host/device arrays (padded on the host),
        or restored from an orbax checkpoint straight into the layout's shardings."""
        place = self.placements[self.phase]
        if isinstance(weights, dict):
            padded = sharding.pad_values(self.config, {k: np.asarray(v)
                                                       for k, v in weights.items()}, self.plan)
            return jax.device_put({k: v.astype(dtype) for k, v in padded.items()}, place.params)
        target = sharding.restore_target(self.config, self.plan, place.layout, place.mesh, dtype)
        cfg, values = loading.load_orbax(weights, target)
        if cfg != self.config:
            raise ValueError(f"orbax checkpoint {weights} holds {cfg}, expected {self.config}")
        return sharding.pad_on_device(self.config, values, self.plan, place.params)

    def set_phase(self, phase: str) -> float | None:
        """Put weights and KV in `phase`'s layout. Returns the seconds spent moving them, or
        None when nothing moved (same phase, or both phases share one layout)."""
        if phase == self.phase:
            return None
        self.phase = phase
        place = self.placements[phase]
        state = (self.params, self.cache)
        moved, seconds = sharding.timed_reshard(state, (place.params, place.cache))
        self.params, self.cache = moved
        return None if moved is state else seconds

    def prefill(self, prompts: list[list[int]], slots: list[int], plan: SamplingPlan,
                shape: tuple[int, int], prompt_lens: list[int] | None = None) -> StepOutput:
        """Run `prompts` (written into `slots`) padded to `shape`, pipelined over pp
        (`prompt_lens`: as `Runner.prefill`)."""
        tokens, lengths, slot_arr = pack_prompts(prompts, slots, shape, self.num_slots)
        logits = self.prefill_logits(tokens, lengths, self.table_rows(slot_arr))
        if plan.penalties:
            self._reset_penalties(tokens, lengths, slot_arr, prompt_lens)
        return self._sample_host(logits, slot_arr, plan, len(prompts))

    def prefill_logits(self, tokens: np.ndarray, lengths: np.ndarray, table: np.ndarray,
                       microbatches: int | None = None) -> jax.Array:
        """Last-token logits [b, V] of prompts tokens [b, T] (valid up to lengths [b]), their
        K/V written into the blocks of table [b, MB] (`table_rows`). Default micro-batches:
        up to 2 per stage (pp > 1)."""
        b, t = tokens.shape
        pp = self.layout.pp
        most = pp * self.prefill_microbatches_per_stage if pp > 1 else 1
        m = microbatches or pipeline.microbatches(b, most)
        fn = self._program("prefill", m)
        logits, self.cache = self._once((self.phase, "prefill", b, t, m), fn, self.params,
                                        self.cache, tokens, lengths, table)
        return logits

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
               plan: SamplingPlan, steps: int = 1) -> StepOutput:
        """`steps` tokens for slots 0..B-1 (B = len(tokens)): row i continues from tokens[i]
        at positions[i]; rows where `active` is False are padding (garbage out).

        steps == 1: tokens [B] (logprob [B], top_ids / top_logprobs [B, num]), as `Runner`.
        steps > 1: a steps axis after the row axis: tokens [B, steps], logprob [B, steps],
        top_ids / top_logprobs [B, steps, num]; token j of row i was sampled with RNG step
        plan.tensors.step[i] + j and `plan`'s banned ids. A row that passes the cache's end
        (max_len) within the call gets garbage from there on; other rows are unaffected.

        With pp > 1 (or steps > 1) the rows flow as pp micro-batches kept in flight over all
        steps, sampled inside the program (`pipeline.multistep_decode_program`); with pp = 1
        and steps = 1 it is the one-step program and the separate sampler."""
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        rows = len(tokens)
        positions = positions.astype(np.int32)
        lengths = np.where(active, positions + 1, 0).astype(np.int32)
        longest = int(lengths.max()) if active.any() else 1
        kv_len = round_up(min(longest + steps - 1, self.max_len), self.buckets.kv_len)
        table = self.table_rows(np.arange(rows))
        if steps == 1 and self.layout.pp == 1:
            logits = self.decode_logits(tokens, positions, lengths, kv_len, table)
            return self._sample_host(logits, np.arange(rows, dtype=np.int32), plan, rows)
        out = self.decode_multistep(tokens, positions, lengths, steps, plan, kv_len, table)
        return _steps_to_host(out, plan.num_logprobs, rows, steps)

    def decode_multistep(self, tokens: np.ndarray, positions: np.ndarray,
                            lengths: np.ndarray, steps: int, plan: SamplingPlan,
                            kv_len: int, table: np.ndarray) -> pipeline.DecodeSteps:
        """`steps` decode steps of slots 0..B-1 as one program (device results, leading axis
        max(steps, decode_steps)); lengths [B] = positions + 1, 0 for idle rows (they write
        no KV); table [B, MB] their blocks (`table_rows`). Records the
        ticks in which each stage worked on a real micro-batch in `decode_busy` (left on the
        device) and the program's ticks in `decode_ticks`."""
        rows, pp = len(tokens), self.layout.pp
        m = pipeline.microbatches(rows, pp)
        max_steps = max(steps, self.decode_steps)
        fn = self._program("decode_steps", m, max_steps)
        switch = shard_head.sampler_switch(plan.mode, plan.penalties, plan.num_logprobs)
        key = (self.phase, "decode_steps", rows, kv_len, max_steps, plan.tensors.banned.shape)
        out, self.cache, self.out_counts = self._once(
            key, fn, self.params, self.cache, self.prompt_mask, self.out_counts, tokens,
            positions, lengths, table, np.int32(steps), plan.tensors, switch, kv_len=kv_len)
        self.decode_busy = out.busy
        self.decode_ticks = pipeline.interleaved_ticks(steps, m, pp)
        return out

    def decode_logits(self, tokens: np.ndarray, positions: np.ndarray, lengths: np.ndarray,
                      kv_len: int, table: np.ndarray) -> jax.Array:
        """Logits [B, V] of one decode step for the rows of table [B, MB] (lengths 0: idle
        rows, which write no KV), attending over their first kv_len positions."""
        rows = len(tokens)
        fn = self._program("decode", pipeline.microbatches(rows, self.layout.pp))
        logits, self.cache = self._once((self.phase, "decode", rows, kv_len), fn, self.params,
                                        self.cache, tokens, positions, lengths, table,
                                        kv_len=kv_len)
        return logits

    def kv_extract(self, slot: int, length: int) -> list[jax.Array]:
        """Positions 0..length-1 of `slot`: K and V, each [L', Hkv', length, D], in the current
        layout's shards (layers over pp, heads over tp)."""
        return list(device_cache.read_blocks(self.cache, self.table[slot], length=length,
                                             block_axis=1))

    def kv_staging(self, length: int) -> list:
        """The current layout's shardings for `kv_extract`'s arrays: a sequence swapped in
        lands directly in the shards that will read it."""
        place = self.placements[self.phase]
        spec = sharding.spec(("layers", "kv_heads", "seq", "head_dim"), place.layout)
        return [NamedSharding(place.mesh, spec)] * 2

    def kv_insert(self, slot: int, arrays: list[jax.Array]) -> None:
        """Write arrays from `kv_extract` (of any slot, any layout) into `slot`."""
        staged = KVCache(*jax.device_put(arrays, self.kv_staging(arrays[0].shape[2])))
        self.cache = device_cache.write_blocks(self.cache, self.table[slot], staged,
                                               block_axis=1)

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(batch, KV length) shapes a decode step compiles for: the pipeline's attention
        reads a window of each KV-length bucket, with or without the kernel. One program per
        shape serves every steps <= decode_steps (steps is not static), so a warm-up call
        `decode(..., steps=1)` with rows at position kv - 1 compiles what the hot loop runs."""
        return [(b, n) for b in self.buckets.decode_batch for n in self.buckets.kv_len]

    @property
    def layout(self) -> Layout:
        """The layout weights and KV are in now."""
        return self.placements[self.phase].layout

    def _program(self, kind: str, *args):
        """The jitted step of `kind` ("prefill", "decode", "decode_steps") on the current
        phase's layout for `args` (micro-batches[, max steps]); built once per key."""
        key = (self.phase, kind, *args)
        if key not in self._programs:
            place = self.placements[self.phase]
            build = {"prefill": pipeline.prefill_program, "decode": pipeline.decode_program,
                     "decode_steps": pipeline.multistep_decode_program}[kind]
            options = {} if kind == "prefill" else {"kernel": self.use_kernel}
            self._programs[key] = build(self.config, place.layout, place.mesh,
                                        self.config.vocab_size, *args, **options)
        return self._programs[key]


def _decode_steps(requested: int | None, decode: Layout) -> int:
    """Decode steps per call: as requested, else 1 without a pipeline, DEFAULT_DECODE_STEPS
    with one (the pipeline is full for all but pp - 1 of steps * pp + pp - 1 ticks)."""
    if requested is None:
        return 1 if decode.pp == 1 else DEFAULT_DECODE_STEPS
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"decode_steps_per_call must be an integer >= 1 or None, "
                         f"got {requested!r}")
    return requested


def _steps_to_host(out: pipeline.DecodeSteps, num_logprobs: int | None, rows: int,
                   steps: int) -> StepOutput:
    """Device results [S, B, ...] -> StepOutput rows first: [B, steps, ...], or [B, ...]
    when steps == 1 (the one-step contract)."""
    def host(a, num=None):
        a = np.asarray(a[:steps, :rows] if num is None else a[:steps, :rows, :num])
        return a[0] if steps == 1 else np.moveaxis(a, 0, 1)

    result = StepOutput(host(out.tokens))
    if num_logprobs is not None:
        result.logprob = host(out.logprob)
        result.top_ids = host(out.top_ids, num_logprobs)
        result.top_logprobs = host(out.top_logprobs, num_logprobs)
    return result


def _zeros_cache(shape, dtype, shardings: KVCache) -> KVCache:
    """A zeroed KV store created directly in its sharding (never whole on one device)."""
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=shardings.k)
    return KVCache(make(), make())
