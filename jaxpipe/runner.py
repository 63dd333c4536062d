"""The runner owns every device array and compiled function; it decides nothing.

Two jitted steps, each compiled once per static shape (see `buckets.py`):
  prefill: prompts [b, T] -> KV written into their slots, first token sampled
  decode:  one token for slots 0..B-1 over the first `kv_len` cached positions
The KV cache and the penalty state are donated through both, so they are updated in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpipe import sampling
from jaxpipe.buckets import Buckets, round_up
from jaxpipe.kv import device_cache
from jaxpipe.model.llama import Llama
from jaxpipe.sampling import SamplingTensors

_STATIC = ("mode", "penalties", "num_logprobs")


@dataclass
class StepOutput:
    """Host-side results of one step, one row per sequence given (padding rows removed)."""

    tokens: np.ndarray  # [n] i32
    logprob: np.ndarray | None = None  # [n] f32: logprob of each sampled token
    top_ids: np.ndarray | None = None  # [n, num] i32
    top_logprobs: np.ndarray | None = None  # [n, num] f32


@dataclass(frozen=True)
class SamplingPlan:
    """Host-built sampling inputs of one step plus its static switches."""

    tensors: SamplingTensors
    mode: str
    penalties: bool
    num_logprobs: int | None  # None: no logprobs this step


def _prefill_logits(graphdef, params, cache, tokens, lengths, slots):
    return nnx.merge(graphdef, params).prefill(tokens, lengths, slots, cache)


def _decode_logits(graphdef, params, cache, tokens, positions, *, kv_len):
    return nnx.merge(graphdef, params).decode(tokens, positions, cache, kv_len)


def _sample(logits, prompt_mask, out_counts, rows, tensors, *, mode, penalties, num_logprobs):
    """Tokens for logits [n, V] of cache rows `rows` [n]; updates the penalty counts.

    Kept out of the model's jitted step so that sampling variants do not multiply the
    model's compilations (one model program per shape, a few small sampler programs)."""
    pm = jnp.take(prompt_mask, rows, axis=0, mode="clip") if penalties else None
    oc = jnp.take(out_counts, rows, axis=0, mode="clip") if penalties else None
    tokens = sampling.sample(logits, tensors, pm, oc, mode=mode, penalties=penalties)
    if penalties:
        out_counts = out_counts.at[rows, tokens].add(1, mode="drop")
    lp = None if num_logprobs is None else sampling.compute_logprobs(logits, tokens, num_logprobs)
    return tokens, lp, prompt_mask, out_counts


def _reset_penalty_rows(prompt_mask, out_counts, tokens, lengths, slots):
    """A new request's penalty state: its prompt's tokens, no output yet."""
    vocab = prompt_mask.shape[1]
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]  # [b, T]
    ids = jnp.where(valid, tokens, vocab)  # padding -> out of range -> dropped
    prompt_mask = prompt_mask.at[slots].set(False, mode="drop")
    prompt_mask = prompt_mask.at[slots[:, None], ids].set(True, mode="drop")
    return prompt_mask, out_counts.at[slots].set(0, mode="drop")


class Runner:
    """Device state (weights, KV slots, penalty counts) and the compiled steps."""

    def __init__(self, model: Llama, buckets: Buckets, num_slots: int, max_len: int, dtype):
        self.config = model.config
        self.buckets = buckets
        self.num_slots, self.max_len = num_slots, max_len
        self.graphdef, self.params = nnx.split(model)
        self.cache = device_cache.allocate(self.config, num_slots, max_len, dtype)
        vocab = self.config.vocab_size
        self.prompt_mask = jnp.zeros((num_slots, vocab), bool)  # [N, V]
        self.out_counts = jnp.zeros((num_slots, vocab), jnp.int32)  # [N, V]
        self._prefill = jax.jit(partial(_prefill_logits, self.graphdef), donate_argnames="cache")
        self._decode = jax.jit(partial(_decode_logits, self.graphdef),
                               static_argnames="kv_len", donate_argnames="cache")
        self._sample = jax.jit(_sample, static_argnames=_STATIC,
                               donate_argnames=("prompt_mask", "out_counts"))
        self._reset = jax.jit(_reset_penalty_rows, donate_argnames=("prompt_mask", "out_counts"))
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0

    def prefill(self, prompts: list[list[int]], slots: list[int], plan: SamplingPlan,
                shape: tuple[int, int]) -> StepOutput:
        """Run `prompts` (written into `slots`) padded to `shape` = (batch, length) bucket."""
        b, t = shape
        tokens = np.zeros((b, t), np.int32)
        lengths = np.ones(b, np.int32)
        slot_arr = np.full(b, self.num_slots, np.int32)  # padding rows: out of range, dropped
        for i, (ids, slot) in enumerate(zip(prompts, slots, strict=True)):
            tokens[i, : len(ids)], lengths[i], slot_arr[i] = ids, len(ids), slot
        logits, self.cache = self._timed(("prefill", b, t), self._prefill, self.params,
                                         self.cache, tokens, lengths, slot_arr)
        if plan.penalties:
            self.prompt_mask, self.out_counts = self._reset(
                self.prompt_mask, self.out_counts, tokens, lengths, slot_arr)
        return self._sample_host(logits, slot_arr, plan, len(prompts))

    def decode(self, tokens: np.ndarray, positions: np.ndarray, plan: SamplingPlan,
               kv_len: int) -> StepOutput:
        """One token for slots 0..B-1 (B = len(tokens), a bucket); rows past the active ones
        are padding whose outputs are ignored."""
        logits, self.cache = self._timed(
            ("decode", len(tokens), kv_len), partial(self._decode, kv_len=kv_len), self.params,
            self.cache, tokens, positions)
        return self._sample_host(logits, np.arange(len(tokens), dtype=np.int32), plan,
                                 len(tokens))

    def _sample_host(self, logits, rows, plan: SamplingPlan, n: int) -> StepOutput:
        tokens, lp, self.prompt_mask, self.out_counts = self._sample(
            logits, self.prompt_mask, self.out_counts, rows, plan.tensors, mode=plan.mode,
            penalties=plan.penalties, num_logprobs=plan.num_logprobs)
        return _to_host(tokens, lp, n)

    def _timed(self, key: tuple, fn, *args):
        """Call a model step; the first call of each shape is timed as its compilation."""
        if key in self.compiled:
            return fn(*args)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.compiled.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out

    def kv_len_bucket(self, longest_position: int) -> int:
        """Cached positions a decode step must read: bucket of (largest position + 1)."""
        return round_up(longest_position + 1, self.buckets.kv_len)


def _to_host(tokens, lp, n: int) -> StepOutput:
    result = StepOutput(np.asarray(tokens)[:n])
    if lp is not None:
        tok_lp, top_ids, top_lp = (np.asarray(a)[:n] for a in lp)
        result.logprob, result.top_ids, result.top_logprobs = tok_lp, top_ids, top_lp
    return result
