"""The runner owns every device array and compiled function; it decides nothing.

A step is dispatched one layer at a time, each piece a small jitted program compiled once per
static shape (see `buckets.py`):
  prefill: embed [b, T] -> per layer: attention + MLP, K/V written into the rows' KV blocks
           -> logits
  decode:  embed [B] -> per layer: qkv + K/V write, attention, out + MLP -> logits -> sample
The KV store is a block pool addressed through the runner's block table (one row per slot;
`kv/device_cache.py`); each step sends the table rows of its batch. Decode attention is the
C++ kernel of `kernels/decode_attention.py` where it builds (CPU): each row reads only its own
positions, block by block, so one program per batch bucket serves every KV length. The XLA
fallback (other backends, no compiler) gathers each group of `attn_block` rows' blocks up to
*that group's* KV-length bucket and skips empty groups. Per layer, because compiling a one-layer
program costs ~1/30 of a whole-model one. Dispatch costs ~0.1 ms per program, small next to a
step (~100s of ms). Each layer's KV buffer and the penalty state are donated (updated in place).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe import sampling
from jaxpipe.buckets import Buckets, round_up
from jaxpipe.kernels import decode_attention as attention_kernel
from jaxpipe.kv import device_cache
from jaxpipe.model import llama
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


def _attend_into(out, q, cache, positions, table, *, start: int, kv_len: int, rows: int):
    """Attention for rows start..start+rows-1 (table [B, MB]), written into out [B, H, D]
    (donated)."""
    qb = jax.lax.dynamic_slice_in_dim(q, start, rows)  # [R, H, D]
    pb = jax.lax.dynamic_slice_in_dim(positions, start, rows)  # [R]
    tb = jax.lax.dynamic_slice_in_dim(table, start, rows)  # [R, MB]
    attn = llama.attend_rows(qb, cache, pb, tb, kv_len)
    return jax.lax.dynamic_update_slice_in_dim(out, attn, start, 0)


def _decode_layer(cfg, p, x, positions, lengths, table, cache):
    """One layer of a decode step with the attention kernel: x [B, E] -> x [B, E]; the
    layer's cache (donated) gets each row's new K/V at `positions` in its blocks (table
    [B, MB]), then rows attend over their first `lengths` positions (0 for idle rows)."""
    q, cache = llama.decode_qkv(cfg, p, x, positions, table, cache)
    attn = attention_kernel.decode_attention(q, cache.k, cache.v, lengths, table)
    return llama.attn_out_mlp(cfg, p, x, attn), cache


def _prefill_logits(cfg, head, x, lengths):
    return llama.logits(cfg, head, llama.last_positions(x, lengths))


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


def _set_penalty_row(prompt_mask, out_counts, slot, mask_row, count_row):
    """One slot's penalty state: which tokens its prompt has, how often each was output."""
    return prompt_mask.at[slot].set(mask_row), out_counts.at[slot].set(count_row)


def _reset_penalty_rows(prompt_mask, out_counts, tokens, lengths, prompt_lens, slots):
    """The penalty state of sequences just prefilled: tokens [b, T] hold each one's prompt
    (the first `prompt_lens`) and, after a recompute, its outputs so far (up to `lengths`)."""
    vocab = prompt_mask.shape[1]
    position = jnp.arange(tokens.shape[1])[None, :]  # [1, T]
    in_prompt = position < prompt_lens[:, None]
    in_output = (position < lengths[:, None]) & ~in_prompt
    prompt_ids = jnp.where(in_prompt, tokens, vocab)  # padding -> out of range -> dropped
    output_ids = jnp.where(in_output, tokens, vocab)
    prompt_mask = prompt_mask.at[slots].set(False, mode="drop")
    prompt_mask = prompt_mask.at[slots[:, None], prompt_ids].set(True, mode="drop")
    out_counts = out_counts.at[slots].set(0, mode="drop")
    return prompt_mask, out_counts.at[slots[:, None], output_ids].add(1, mode="drop")


class Runner:
    """Device state (weights, the KV block pool and its block table, penalty counts) and the
    compiled pieces of a step.

    A slot is a batch row: sequence state kept per row (penalty counts, the block-table row).
    The KV itself is in blocks of the pool (`kv/device_cache.py`). Until someone assigns
    blocks with `set_blocks`, slot s owns blocks s*MB..s*MB+MB-1 (the dense layout)."""

    def __init__(self, model: Llama, buckets: Buckets, num_slots: int, max_len: int, dtype,
                 attention: str = "auto", attn_block: int = 32, num_blocks: int | None = None):
        """`num_blocks`: the pool's size (default: num_slots * MB, MB = blocks of max_len)."""
        cfg = self.config = model.config
        self.use_kernel = _use_kernel(attention)
        self.buckets = buckets
        self.num_slots, self.max_len = num_slots, max_len
        self.attn_block = attn_block
        self.head = model.head()
        self.layers = [model.layer(i) for i in range(cfg.num_layers)]
        self.table, self.num_blocks = _block_table(num_slots, max_len, num_blocks)
        self.cache = list(device_cache.allocate(cfg, self.num_blocks, dtype))
        vocab = cfg.vocab_size
        self.prompt_mask = jnp.zeros((num_slots, vocab), bool)  # [N, V]
        self.out_counts = jnp.zeros((num_slots, vocab), jnp.int32)  # [N, V]
        self._embed = jax.jit(llama.embed)
        self._prefill_layer = jax.jit(partial(llama.prefill_layer, cfg), donate_argnames="cache")
        self._prefill_logits = jax.jit(partial(_prefill_logits, cfg))
        self._decode_layer = jax.jit(partial(_decode_layer, cfg), donate_argnames="cache")
        self._decode_qkv = jax.jit(partial(llama.decode_qkv, cfg), donate_argnames="cache")
        self._attend = jax.jit(_attend_into, static_argnames=("start", "kv_len", "rows"),
                               donate_argnames="out")
        self._out_mlp = jax.jit(partial(llama.attn_out_mlp, cfg))
        self._logits = jax.jit(partial(llama.logits, cfg))
        self._sample = jax.jit(_sample, static_argnames=_STATIC,
                               donate_argnames=("prompt_mask", "out_counts"))
        self._reset = jax.jit(_reset_penalty_rows, donate_argnames=("prompt_mask", "out_counts"))
        self._set_penalties = jax.jit(_set_penalty_row,
                                      donate_argnames=("prompt_mask", "out_counts"))
        self.compiled: set[tuple] = set()
        self.compile_seconds = 0.0
        self.decode_steps = 1  # steps per decode call the engine should ask for
        self.layouts: dict = {}  # phase -> Layout; one device has none, both phases run here

    def set_phase(self, phase: str) -> float | None:
        """One device has one layout: nothing ever moves (see `LayoutRunner.set_phase`)."""
        return None

    def prefill(self, prompts: list[list[int]], slots: list[int], plan: SamplingPlan,
                shape: tuple[int, int], prompt_lens: list[int] | None = None) -> StepOutput:
        """Run `prompts` (written into `slots`) padded to `shape` = (batch, length) bucket.
        `prompt_lens`: where each prompt ends, when it is followed by outputs to recompute."""
        b, t = shape
        tokens, lengths, slot_arr = pack_prompts(prompts, slots, shape, self.num_slots)
        key = ("prefill", b, t)
        x = self._embed(self.head, tokens)
        table = jnp.asarray(self.table_rows(slot_arr))
        for i, p in enumerate(self.layers):
            x, self.cache[i] = self._once(key, self._prefill_layer, p, x, self.cache[i], table)
        logits = self._once(key + ("logits",), self._prefill_logits, self.head, x, lengths)
        if plan.penalties:
            self._reset_penalties(tokens, lengths, slot_arr, prompt_lens)
        return self._sample_host(logits, slot_arr, plan, len(prompts))

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray,
               plan: SamplingPlan, steps: int = 1) -> StepOutput:
        """One token for slots 0..B-1 (B = len(tokens), a bucket). Rows where `active` is
        False are padding: their outputs are garbage and are ignored by the caller.
        `steps` must be 1 (`decode_steps`): one device has no pipeline to keep full."""
        if steps != 1:
            raise ValueError(f"the single-device runner decodes one step per call "
                             f"(decode_steps = 1), got steps={steps}")
        x = self._embed(self.head, tokens)
        # Idle rows get no blocks: they write no KV. On the device once per step, not once
        # per layer call (30 transfers each).
        table = jnp.asarray(self.table_rows(np.where(active, np.arange(len(tokens)),
                                                     self.num_slots)))
        if self.use_kernel:
            lengths = jnp.asarray(np.where(active, positions + 1, 0).astype(np.int32))
            positions = jnp.asarray(positions)
            for i, p in enumerate(self.layers):
                x, self.cache[i] = self._once(("decode", len(tokens)), self._decode_layer, p, x,
                                              positions, lengths, table, self.cache[i])
        else:
            x = self._decode_layers_xla(x, positions, active, table)
        logits = self._once(("logits", len(tokens)), self._logits, self.head, x)
        return self._sample_host(logits, np.arange(len(tokens), dtype=np.int32), plan,
                                 len(tokens))

    def _reset_penalties(self, tokens, lengths, slots, prompt_lens: list[int] | None) -> None:
        ends = lengths.copy()
        if prompt_lens is not None:
            ends[: len(prompt_lens)] = prompt_lens
        self.prompt_mask, self.out_counts = self._reset(
            self.prompt_mask, self.out_counts, tokens, lengths, ends, slots)

    def restore_penalties(self, slot: int, prompt: list[int], output: list[int]) -> None:
        """Rebuild `slot`'s penalty state for a sequence that moved there (swapped in, or
        prefilled again with its outputs after a recompute): the state is per slot and does
        not travel with the KV."""
        vocab = self.prompt_mask.shape[1]
        mask = np.zeros(vocab, bool)
        mask[prompt] = True
        counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32)
        self.prompt_mask, self.out_counts = self._set_penalties(
            self.prompt_mask, self.out_counts, slot, mask, counts)

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        """Give `slot`'s sequence these pool blocks, in position order (the rest of its
        table row: none)."""
        if len(blocks) > self.table.shape[1]:
            raise ValueError(f"{len(blocks)} blocks for slot {slot}, at most "
                             f"{self.table.shape[1]} fit max_len {self.max_len}")
        # A new table, never the old one changed in place: arrays given to a dispatched step
        # (or views of them) may still be read after this returns (zero-copy on CPU).
        table = self.table.copy()
        table[slot] = device_cache.OUT_OF_RANGE
        table[slot, :len(blocks)] = blocks
        self.table = table

    def table_rows(self, slots: np.ndarray) -> np.ndarray:
        """Block-table rows of `slots` [b] (an out-of-range slot: a row of no blocks)."""
        none = np.full((1, self.table.shape[1]), device_cache.OUT_OF_RANGE, np.int32)
        return np.concatenate([self.table, none])[np.minimum(slots, self.num_slots)]

    def kv_extract(self, slot: int, length: int) -> list[jax.Array]:
        """Positions 0..length-1 of `slot`: per layer K, V, each [Hkv, length, D]."""
        return jax.tree.leaves(device_cache.read_blocks(self.cache, self.table[slot],
                                                        length=length))

    def kv_staging(self, length: int) -> list | None:
        """Where `kv_extract`'s arrays go to be inserted (None: this runner's one device)."""
        return None

    def kv_insert(self, slot: int, arrays: list[jax.Array]) -> None:
        """Write arrays from `kv_extract` (of any slot) into `slot`."""
        values = jax.tree.unflatten(jax.tree.structure(self.cache), arrays)
        self.cache = device_cache.write_blocks(self.cache, self.table[slot], values)

    def decode_shapes(self) -> list[tuple[int, int | None]]:
        """(batch, KV length) shapes a decode step compiles for; KV length None with the
        kernel, which serves every length with one program."""
        kv = [None] if self.use_kernel else list(self.buckets.kv_len)
        return [(b, n) for b in self.buckets.decode_batch for n in kv]

    def _decode_layers_xla(self, x, positions, active, table):
        blocks = self.attention_blocks(positions, active)
        for i, p in enumerate(self.layers):
            q, self.cache[i] = self._once(("qkv", len(positions)), self._decode_qkv, p, x,
                                          positions, table, self.cache[i])
            attn = jnp.zeros_like(q)
            for start, rows, kv_len in blocks:
                attn = self._once(("attend", start, rows, kv_len), self._attend, attn, q,
                                  self.cache[i], positions, table, start=start, kv_len=kv_len,
                                  rows=rows)
            x = self._once(("out_mlp", len(positions)), self._out_mlp, p, x, attn)
        return x

    def attention_blocks(self, positions: np.ndarray, active: np.ndarray):
        """(start, rows, kv_len) of each block of rows holding a running sequence; kv_len is
        the bucket of the block's own longest sequence."""
        rows = min(self.attn_block, len(positions))
        blocks = []
        for start in range(0, len(positions), rows):
            live = active[start:start + rows]
            if live.any():
                longest = int(positions[start:start + rows][live].max())
                blocks.append((start, rows, round_up(longest + 1, self.buckets.kv_len)))
        return blocks

    def _sample_host(self, logits, rows, plan: SamplingPlan, n: int) -> StepOutput:
        tokens, lp, self.prompt_mask, self.out_counts = self._sample(
            logits, self.prompt_mask, self.out_counts, rows, plan.tensors, mode=plan.mode,
            penalties=plan.penalties, num_logprobs=plan.num_logprobs)
        return _to_host(tokens, lp, n)

    def _once(self, key: tuple, fn, *args, **kwargs):
        """Call a compiled piece; the first call of each shape is timed as its compilation."""
        if key in self.compiled:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.compiled.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out


def pack_prompts(prompts: list[list[int]], slots: list[int], shape: tuple[int, int],
                 num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host inputs of a prefill padded to `shape` = (b, T): tokens [b, T], lengths [b] and
    slots [b]; padding rows get slot `num_slots` (out of range: their KV writes are dropped)."""
    b, t = shape
    tokens = np.zeros((b, t), np.int32)
    lengths = np.ones(b, np.int32)
    slot_arr = np.full(b, num_slots, np.int32)
    for i, (ids, slot) in enumerate(zip(prompts, slots, strict=True)):
        tokens[i, : len(ids)], lengths[i], slot_arr[i] = ids, len(ids), slot
    return tokens, lengths, slot_arr


def _block_table(num_slots: int, max_len: int, num_blocks: int | None
                 ) -> tuple[np.ndarray, int]:
    """The starting block table and pool size: the dense layout when `num_blocks` is None,
    else rows of no blocks (a KV manager assigns them)."""
    dense = device_cache.identity_table(num_slots, max_len)
    if num_blocks is None:
        return dense, dense.size
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return np.full_like(dense, device_cache.OUT_OF_RANGE), num_blocks


def _use_kernel(attention: str) -> bool:
    """"auto": the kernel where it builds; "kernel": it or an error; "xla": never."""
    if attention == "xla":
        return False
    if attention == "kernel" and not attention_kernel.available():
        raise RuntimeError("attention='kernel' but the decode attention kernel cannot be built "
                           "here (see the warning above); use attention='auto' or 'xla'")
    return attention_kernel.available()


def _to_host(tokens, lp, n: int) -> StepOutput:
    result = StepOutput(np.asarray(tokens)[:n])
    if lp is not None:
        tok_lp, top_ids, top_lp = (np.asarray(a)[:n] for a in lp)
        result.logprob, result.top_ids, result.top_logprobs = tok_lp, top_ids, top_lp
    return result
