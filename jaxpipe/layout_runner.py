"""The runner for multi-device layouts: prefill on one layout, decode on another.

Same interface as `Runner` (`prefill`, `decode`, `set_phase`, compile bookkeeping), different
strategy: each step is one whole-model program (`pipeline.py`) over a mesh, instead of one
program per layer on one device. The weights and the KV store are padded once (see
`sharding.py`) and live in the current phase's layout; `set_phase` moves both with
`sharding.reshard` when the phase's layout differs from the one they are in.

The KV store here is stacked, `[L', N, Hkv', S, D]` for K and for V, so that the `layers` axis
can be split over pipeline stages (each stage holds and writes its own layers' KV).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe import pipeline, sharding
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
    _reset_penalty_rows,
    _sample,
    _set_penalty_row,
    _use_kernel,
    pack_prompts,
)

PHASES = ("prefill", "decode")


class Placement:
    """One layout's mesh and the shardings of everything that moves between layouts."""

    def __init__(self, cfg: ModelConfig, plan: sharding.PaddingPlan, layout: Layout, devices,
                 num_slots: int, max_len: int):
        self.layout = layout
        self.mesh = sharding.make_mesh(layout, devices)
        self.params = sharding.param_shardings(cfg, plan, layout, self.mesh)
        kv = sharding.kv_sharding(cfg, plan, layout, self.mesh, num_slots, max_len)
        self.cache = KVCache(kv, kv)


class LayoutRunner(Runner):
    """Device state and compiled steps over a prefill and a decode layout of the same devices.

    Inherits `Runner`'s sampling and compile bookkeeping; the model steps are its own."""

    def __init__(self, cfg: ModelConfig, weights: dict | Path, buckets: Buckets, num_slots: int,
                 max_len: int, dtype, layouts: dict[str, Layout], devices,
                 attention: str = "auto", prefill_microbatches_per_stage: int = 2):
        """`weights`: unpadded weights (name -> host or device array, as `param_decls`), or
        the path of an orbax checkpoint to restore straight into the prefill layout."""
        for phase, layout in layouts.items():
            if layout.dp > 1:
                raise ValueError(f"{phase} layout {layout}: dp > 1 is not supported yet; "
                                 "use pp*tp = the mesh's device count")
        self.config, self.buckets = cfg, buckets
        self.use_kernel = _use_kernel(attention)
        self.num_slots, self.max_len = num_slots, max_len
        self.layouts = dict(layouts)
        self.prefill_microbatches_per_stage = prefill_microbatches_per_stage
        self.plan = sharding.plan_padding(cfg, self.layouts.values())
        self.placements = {p: Placement(cfg, self.plan, self.layouts[p], devices, num_slots,
                                        max_len) for p in PHASES}
        self.phase = "prefill"
        place = self.placements[self.phase]
        self.params = self._place_weights(weights, dtype)
        self.cache = _zeros_cache(sharding.kv_shape(cfg, self.plan, num_slots, max_len),
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
        logits = self.prefill_logits(tokens, lengths, slot_arr)
        if plan.penalties:
            self._reset_penalties(tokens, lengths, slot_arr, prompt_lens)
        return self._sample_host(logits, slot_arr, plan, len(prompts))

    def prefill_logits(self, tokens: np.ndarray, lengths: np.ndarray, slots: np.ndarray,
                       microbatches: int | None = None) -> jax.Array:
        """Last-token logits [b, V] of prompts tokens [b, T] (valid up to lengths [b]), their
        K/V written into slots [b]. Default micro-batches: up to 2 per stage (pp > 1)."""
        b, t = tokens.shape
        pp = self.layout.pp
        most = pp * self.prefill_microbatches_per_stage if pp > 1 else 1
        m = microbatches or pipeline.microbatches(b, most)
        fn = self._program("prefill", m)
        logits, self.cache = self._once((self.phase, "prefill", b, t, m), fn, self.params,
                                        self.cache, tokens, lengths, slots)
        return logits

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
               plan: SamplingPlan) -> StepOutput:
        """One token for slots 0..B-1; with pp > 1 the rows flow as pp micro-batches."""
        rows = len(tokens)
        longest = int(positions[active].max()) + 1 if active.any() else 1
        lengths = np.where(active, positions + 1, 0).astype(np.int32)
        logits = self.decode_logits(tokens, positions.astype(np.int32), lengths,
                                    round_up(longest, self.buckets.kv_len))
        return self._sample_host(logits, np.arange(rows, dtype=np.int32), plan, rows)

    def decode_logits(self, tokens: np.ndarray, positions: np.ndarray, lengths: np.ndarray,
                      kv_len: int) -> jax.Array:
        """Logits [B, V] of one decode step for slots 0..B-1 (lengths 0: idle rows), attending
        over the first kv_len cache positions."""
        rows = len(tokens)
        fn = self._program("decode", pipeline.microbatches(rows, self.layout.pp))
        logits, self.cache = self._once((self.phase, "decode", rows, kv_len), fn, self.params,
                                        self.cache, tokens, positions, lengths, kv_len=kv_len)
        return logits

    def kv_extract(self, slot: int, length: int) -> list[jax.Array]:
        """Positions 0..length-1 of `slot`: K and V, each [L', Hkv', length, D], in the current
        layout's shards (layers over pp, heads over tp)."""
        return list(device_cache.read_slot(self.cache, slot, length=length, slot_axis=1))

    def kv_staging(self, length: int) -> list:
        """The current layout's shardings for `kv_extract`'s arrays: a sequence swapped in
        lands directly in the shards that will read it."""
        place = self.placements[self.phase]
        spec = sharding.spec(("layers", "kv_heads", "seq", "head_dim"), place.layout)
        return [NamedSharding(place.mesh, spec)] * 2

    def kv_insert(self, slot: int, arrays: list[jax.Array]) -> None:
        """Write arrays from `kv_extract` (of any slot, any layout) into `slot`."""
        staged = KVCache(*jax.device_put(arrays, self.kv_staging(arrays[0].shape[2])))
        self.cache = device_cache.write_slot(self.cache, slot, staged, slot_axis=1)

    def decode_shapes(self) -> list[tuple[int, int]]:
        """(batch, KV length) shapes a decode step compiles for: the pipeline's attention
        reads a window of each KV-length bucket, with or without the kernel."""
        return [(b, n) for b in self.buckets.decode_batch for n in self.buckets.kv_len]

    @property
    def layout(self) -> Layout:
        """The layout weights and KV are in now."""
        return self.placements[self.phase].layout

    def _program(self, kind: str, microbatches: int):
        """The jitted step of `kind` on the current phase's layout (built once per key)."""
        key = (self.phase, kind, microbatches)
        if key not in self._programs:
            place = self.placements[self.phase]
            build = pipeline.prefill_program if kind == "prefill" else pipeline.decode_program
            options = {} if kind == "prefill" else {"kernel": self.use_kernel}
            self._programs[key] = build(self.config, place.layout, place.mesh,
                                        self.config.vocab_size, microbatches, **options)
        return self._programs[key]


def _zeros_cache(shape, dtype, shardings: KVCache) -> KVCache:
    """A zeroed KV store created directly in its sharding (never whole on one device)."""
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=shardings.k)
    return KVCache(make(), make())
