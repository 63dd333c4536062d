"""The SPMD pipeline: GPipe over the `pp` mesh axis, tensor parallelism over `tp` inside it.

A step is one `jax.shard_map` over the whole mesh, manual over every axis, so every collective
is spelled out: each device holds its stage's layers (`layers` split over pp) and its share of
heads / mlp columns (split over tp). M micro-batches pass through pp stages in M + pp - 1
ticks; after each tick the activations move one stage on with `lax.ppermute`. A stage with no
micro-batch in a tick (pipeline fill and drain: the bubble) computes on garbage and writes its
KV to an out-of-range block, which the scatter drops. Each stage writes only its own layers' KV.
With pp = 1 and M = 1 this is the plain forward (one tick).

Prefill and decode differ only in the stage function; embedding and logits run outside the
pipeline, partitioned by XLA from the weights' shardings (vocab split over tp). The KV store
is a stacked block pool `[layers, blocks, kv_heads, BLOCK, head_dim]` addressed through block
tables (`kv/device_cache.py`); a row with no block at a position writes nothing there.

Multi-step decode (`multistep_decode_program`) closes the per-step bubble: the last stage turns
each micro-batch's output into its next token (logits, sampling, embedding: `shard_head.py`)
inside the same `shard_map`, and the ring carries that token's embedding back to stage 0, which
starts the micro-batch's next step in the very next tick. K steps of M = pp micro-batches take
K*M + pp - 1 ticks instead of K*(M + pp - 1) (`interleave`); once the pipeline is full every
stage works on a real micro-batch in every tick.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe import shard_head, sharding
from jaxpipe.config import ModelConfig
from jaxpipe.kernels import decode_attention as attention_kernel
from jaxpipe.kv.device_cache import (
    OUT_OF_RANGE,
    KVCache,
    from_storage,
    gather,
    locate,
    locate_span,
    to_storage,
)
from jaxpipe.layout import Layout
from jaxpipe.model import llama
from jaxpipe.model.llama import LAYER_PARAMS, HeadParams, LayerParams, param_decls


def attend_decode(q, k, v, lengths, table, layer, kv_len: int, kernel: bool = False):
    """Decode attention, called inside `shard_map` (every array is this device's shard: its
    heads, its layers), so the C++ kernel (a custom call XLA cannot partition) works here.

    q [B, H, D] f32; k, v [Ls, NB, Hkv, BLOCK, D] block pools in the cache's storage dtype
    (uint16 for bf16), read at layer `layer` (traced); table [B, MB]; lengths [B] i32: keys
    0..length-1 (<= kv_len) are attended, 0 marks an idle row (output zeros). Returns
    [B, H, D] f32. H is a multiple of Hkv (GQA). `kernel`: the C++ kernel, which reads the
    pool in place; else each row's first kv_len positions are gathered."""
    if kernel:
        return attention_kernel.decode_attention(q, k, v, lengths, table, layer)
    kr, vr = gather(k[layer], table, kv_len), gather(v[layer], table, kv_len)
    out = llama.decode_attention(q, from_storage(kr), from_storage(vr), lengths - 1)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)


def gpipe(stage_fn, xs, state, *, num_stages: int, readout):
    """Run micro-batches xs [M, ...] through the stages (call inside `shard_map`).

    stage_fn(x, m, valid, state) -> (y, state): this device's layers on micro-batch m; `valid`
        is False in bubble ticks (the stage must then leave `state` unchanged in effect).
    readout(y, m) -> r: what the last stage keeps of micro-batch m.
    Returns (r of every micro-batch [M, ...], the same on every device; final state)."""
    stage = lax.axis_index("pp")
    m_count = xs.shape[0]
    shift = [(i, (i + 1) % num_stages) for i in range(num_stages)]
    r = jax.eval_shape(readout, xs[0], 0)
    outs = jnp.zeros((m_count, *r.shape), r.dtype)

    def tick(t, carry):
        act, outs, state = carry
        m = t - stage
        valid = (m >= 0) & (m < m_count)
        m = jnp.clip(m, 0, m_count - 1)
        x = jnp.where(stage == 0, xs[m], act)
        y, state = stage_fn(x, m, valid, state)
        keep = valid & (stage == num_stages - 1)
        outs = outs.at[m].set(jnp.where(keep, readout(y, m), outs[m]))
        act = lax.ppermute(y, "pp", shift) if num_stages > 1 else y
        return act, outs, state

    carry = (jnp.zeros_like(xs[0]), outs, state)
    _, outs, state = lax.fori_loop(0, m_count + num_stages - 1, tick, carry)
    # Only the last stage recorded anything: the sum over stages is a broadcast of its results.
    return (lax.psum(outs, "pp") if num_stages > 1 else outs), state


def interleave(stage_fn, head_fn, xs, state, head_state, outs, *, num_stages: int, steps):
    """Run `steps` decode steps of micro-batches xs [M, ...] (M <= num_stages) through the
    stages, each step's output turned into the micro-batch's next input (call inside
    `shard_map`).

    Stage s works in tick t on micro-batch (t - s) mod P of step (t - s) div P, P =
    num_stages: the last stage finishes (m, k) in the tick before stage 0 starts (m, k + 1),
    and the ring's last hop (last stage -> stage 0) carries the new input. With M = P every
    stage is busy in every tick but the pp - 1 of fill and drain: (K - 1) * P + M + P - 1
    ticks for K steps (`interleaved_ticks`); M < P leaves gaps.

    stage_fn(x, m, k, valid, state) -> (y, state): this device's layers on micro-batch m at
        step k; `valid` is False in idle ticks (state must then be unchanged in effect).
    head_fn(y, m, k, live, head_state) -> (x_next, record, head_state): the last stage's
        output -> the next step's input. Called on every device every tick (it may hold
        collectives); `live` is True only on the last stage in a valid tick.
    outs: zero buffers [max_steps, M, ...] of the records; `steps` may be traced (<= max_steps).
    Returns (outs, the same on every device; state; head_state; busy [] i32: this device's
    number of valid ticks)."""
    stage = lax.axis_index("pp")
    m_count, period = xs.shape[0], num_stages
    if m_count > period:
        raise ValueError(f"interleave: {m_count} micro-batches > {period} stages")
    max_steps = jax.tree.leaves(outs)[0].shape[0]
    last = stage == num_stages - 1
    shift = [(i, (i + 1) % num_stages) for i in range(num_stages)]

    def tick(t, carry):
        act, outs, state, head_state, busy = carry
        f = t - stage
        m, k = f % period, f // period
        valid = (f >= 0) & (m < m_count) & (k < steps)
        m, k = jnp.minimum(m, m_count - 1), jnp.clip(k, 0, max_steps - 1)
        x = jnp.where((stage == 0) & (k == 0), xs[m], act)
        y, state = stage_fn(x, m, k, valid, state)
        live = valid & last
        x_next, record, head_state = head_fn(y, m, k, live, head_state)
        outs = jax.tree.map(lambda o, r: o.at[k, m].set(jnp.where(live, r, o[k, m])),
                            outs, record)
        act = jnp.where(last, x_next, y)
        act = lax.ppermute(act, "pp", shift) if num_stages > 1 else act
        return act, outs, state, head_state, busy + valid.astype(jnp.int32)

    ticks = (steps - 1) * period + m_count + num_stages - 1
    carry = (jnp.zeros_like(xs[0]), outs, state, head_state, jnp.int32(0))
    _, outs, state, head_state, busy = lax.fori_loop(0, ticks, tick, carry)
    # Only the last stage recorded anything: the sum over stages is a broadcast of its records.
    if num_stages > 1:
        outs = jax.tree.map(partial(lax.psum, axis_name="pp"), outs)
    return outs, state, head_state, busy


def interleaved_ticks(steps: int, microbatches: int, num_stages: int) -> int:
    """Ticks `interleave` takes for `steps` steps (GPipe per step: steps * (M + pp - 1))."""
    return (steps - 1) * num_stages + microbatches + num_stages - 1


def prefill_stage(cfg: ModelConfig, layers: LayerParams, x, table, cache: KVCache, reduce):
    """This stage's layers over whole prompts x [b, T, E]; K/V of positions 0..T-1 go into
    the blocks of table [b, MB] (out-of-range blocks are dropped). cache: [Ls, NB, Hkv,
    BLOCK, D] each."""
    t = x.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
    blocks, offsets = locate_span(table, t)  # [b, T], [T]

    def layer(carry, inputs):
        x, k, v = carry
        p, j = inputs
        q, kn, vn = llama.qkv(cfg, p, x, positions)  # [b, T, H|Hkv, D]
        k = k.at[j, blocks, :, offsets].set(to_storage(kn, k), mode="drop")
        v = v.at[j, blocks, :, offsets].set(to_storage(vn, v), mode="drop")
        x = llama.attn_out_mlp(cfg, p, x, llama.causal_attention(q, kn, vn), reduce)
        return (x, k, v), None

    # A rolled loop: unrolling made prefill slower here (0.88 -> 1.71 s, 16 x 64 tokens, one
    # device, bf16) and compiles 5x longer.
    (x, k, v), _ = lax.scan(layer, (x, *cache), (layers, jnp.arange(layers.wq.shape[0])))
    return x, KVCache(k, v)


def decode_stage(cfg: ModelConfig, layers: LayerParams, x, positions, lengths, table, writes,
                 cache: KVCache, kv_len: int, reduce, kernel: bool = False):
    """This stage's layers for one token of the rows of table [b, MB]: x [b, E], positions
    [b], lengths [b] (0: idle row; attention reads each row's first `lengths` <= kv_len
    positions). K/V are written at `positions` through `writes` [b, MB], the table with the
    rows that must write nothing (idle, bubble) out of range."""
    blocks, offsets = locate(writes, positions)

    def layer(carry, inputs):
        x, k, v = carry
        p, j = inputs
        q, kn, vn = llama.qkv(cfg, p, x, positions)  # [b, H|Hkv, D]
        k = k.at[j, blocks, :, offsets].set(to_storage(kn, k), mode="drop")
        v = v.at[j, blocks, :, offsets].set(to_storage(vn, v), mode="drop")
        attn = attend_decode(q, k, v, lengths, table, j, kv_len, kernel)
        x = llama.attn_out_mlp(cfg, p, x, attn, reduce)
        return (x, k, v), None

    # Unrolled: XLA CPU runs the rolled decode loop 2-4x slower (SmolLM2 bf16, 16 rows,
    # tp=8: 0.65 -> 0.15 s a step; one device: 0.39 -> 0.25 s) for ~2x the compile time.
    (x, k, v), _ = lax.scan(layer, (x, *cache), (layers, jnp.arange(layers.wq.shape[0])),
                            unroll=True)
    return x, KVCache(k, v)


def _specs(cfg: ModelConfig, layout: Layout):
    decls = param_decls(cfg)
    layer_specs = LayerParams(*(sharding.spec(decls[n].axes, layout) for n in LAYER_PARAMS))
    kv = sharding.spec(sharding.KV_AXES, layout)
    return layer_specs, KVCache(kv, kv)


def _split(params: dict) -> tuple[LayerParams, HeadParams]:
    head = HeadParams(params["embed"], params["final_norm"], params.get("lm_head"))
    return LayerParams(*(params[n] for n in LAYER_PARAMS)), head


def _staged(cfg: ModelConfig, layout: Layout, mesh, body, num_inputs: int):
    """shard_map of body(reduce, layers, *inputs (replicated), cache) over the mesh."""
    layer_specs, cache_specs = _specs(cfg, layout)
    reduce = partial(lax.psum, axis_name="tp") if layout.tp > 1 else None
    return jax.shard_map(partial(body, reduce), mesh=mesh, check_vma=False,
                         in_specs=(layer_specs, *[P()] * num_inputs, cache_specs),
                         out_specs=(P(), cache_specs))


def prefill_program(cfg: ModelConfig, layout: Layout, mesh, vocab: int, microbatches: int):
    """jit(params, cache, tokens [b, T], lengths [b], table [b, MB]) -> (logits [b, vocab],
    cache).

    The b prompts flow as `microbatches` micro-batches; `vocab` cuts off padded logits."""
    def body(reduce, layers, xs, table, lengths, cache):
        def stage_fn(x, m, valid, cache):
            return prefill_stage(cfg, layers, x, jnp.where(valid, table[m], OUT_OF_RANGE),
                                 cache, reduce)

        return gpipe(stage_fn, xs, cache, num_stages=layout.pp,
                     readout=lambda y, m: llama.last_positions(y, lengths[m]))

    staged = _staged(cfg, layout, mesh, body, 3)

    def prefill(params, cache, tokens, lengths, table):
        layers, head = _split(params)
        b, t = tokens.shape
        mb = (microbatches, b // microbatches)
        xs = llama.embed(head, tokens).reshape(*mb, t, -1)  # [M, b/M, T, E]
        last, cache = staged(layers, xs, table.reshape(*mb, -1), lengths.reshape(mb), cache)
        return llama.logits(cfg, head, last.reshape(b, -1))[:, :vocab], cache

    return jax.jit(prefill, donate_argnames="cache")


def decode_program(cfg: ModelConfig, layout: Layout, mesh, vocab: int, microbatches: int,
                   kernel: bool = False):
    """jit(params, cache, tokens [B], positions [B], lengths [B], table [B, MB],
    kv_len=static) -> (logits [B, vocab], cache). The rows (of `table`; idle rows: lengths 0,
    they write no KV) are split into `microbatches` contiguous micro-batches that flow
    through the stages. `kernel`: C++ decode attention."""
    def body(kv_len, reduce, layers, xs, positions, lengths, table, cache):
        def stage_fn(x, m, valid, cache):
            writes = jnp.where((valid & (lengths[m] > 0))[:, None], table[m], OUT_OF_RANGE)
            return decode_stage(cfg, layers, x, positions[m], lengths[m], table[m], writes,
                                cache, kv_len, reduce, kernel)

        return gpipe(stage_fn, xs, cache, num_stages=layout.pp, readout=lambda y, m: y)

    def decode(params, cache, tokens, positions, lengths, table, kv_len):
        layers, head = _split(params)
        mb = (microbatches, tokens.shape[0] // microbatches)
        staged = _staged(cfg, layout, mesh, partial(body, kv_len), 4)
        xs = llama.embed(head, tokens).reshape(*mb, -1)  # [M, B/M, E]
        out, cache = staged(layers, xs, positions.reshape(mb), lengths.reshape(mb),
                            table.reshape(*mb, -1), cache)
        return llama.logits(cfg, head, out.reshape(tokens.shape[0], -1))[:, :vocab], cache

    return jax.jit(decode, static_argnames="kv_len", donate_argnames="cache")


class DecodeSteps(NamedTuple):
    """What a multi-step decode returns. Steps past the call's `steps` hold zeros."""

    tokens: jax.Array  # [S, B] i32, S = max_steps
    logprob: jax.Array  # [S, B] f32: logprob of each token (zeros when logprobs are off)
    top_ids: jax.Array  # [S, B, NL] i32 (NL = shard_head.top_logprobs(vocab))
    top_logprobs: jax.Array  # [S, B, NL] f32
    busy: jax.Array  # [pp] i32: ticks in which each stage worked on a real micro-batch


def multistep_decode_program(cfg: ModelConfig, layout: Layout, mesh, vocab: int,
                             microbatches: int, max_steps: int, kernel: bool = False):
    """jit(params, cache, prompt_mask [N, V], out_counts [N, V], tokens [B], positions [B],
    lengths [B], table [B, MB], steps [] i32, tensors: SamplingTensors [B],
    switch: SamplerSwitch, kv_len=static) -> (DecodeSteps, cache, out_counts).

    `steps` (1..max_steps) decode steps for slots 0..B-1 (their KV in the blocks of `table`)
    in one program, as `microbatches`
    (<= pp) contiguous micro-batches kept in flight (`interleave`). Step k of a row is at
    position positions + k and attends over min(that + 1, kv_len) keys; idle rows (lengths
    0) attend over none and write no KV. KV writes past the cache's end are dropped (such a
    row's tokens are garbage from there on, other rows are unaffected). Sampling equals
    `steps` calls of `runner._sample`: each row's RNG step is tensors.step + k and the
    penalty counts grow with every token; `banned` holds for the whole call. out_counts
    (donated) gets the sampled tokens when penalties are on."""
    def decode(params, cache, prompt_mask, out_counts, tokens, positions, lengths, table, steps,
               tensors, switch, kv_len):
        layers, head = _split(params)
        b = tokens.shape[0]
        split = partial(_split_rows, microbatches)
        staged = _multistep_staged(cfg, layout, mesh, vocab, max_steps, kv_len, kernel)
        xs = split(llama.embed(head, tokens))  # [M, B/M, E]
        penalty_rows = (split(prompt_mask[:b]), split(out_counts[:b]))  # [M, B/M, V] each
        outs, busy, cache = staged(layers, head, xs, split(positions), split(lengths),
                                   split(table), steps, jax.tree.map(split, tensors), switch,
                                   *penalty_rows, cache)
        outs = jax.tree.map(lambda o: o.reshape(max_steps, b, *o.shape[3:]), outs)
        out_counts = _add_counts(out_counts, outs.tokens, steps, switch.penalties)
        return DecodeSteps(*outs, busy), cache, out_counts

    return jax.jit(decode, static_argnames="kv_len", donate_argnames=("cache", "out_counts"))


def _split_rows(m: int, a):
    """[B, ...] -> [M, B/M, ...]: contiguous micro-batches."""
    return a.reshape(m, a.shape[0] // m, *a.shape[1:])


def _add_counts(counts, tokens, steps, on=True):
    """counts [N >= b, V] i32 plus one for each token of tokens [S, b] (rows 0..b-1) in
    steps 0..steps-1, when `on`: the penalty counts after those steps."""
    s, b = tokens.shape
    add = ((jnp.arange(s) < steps)[:, None] & on).astype(jnp.int32)  # [S, 1]
    return counts.at[jnp.arange(b)[None, :], tokens].add(jnp.broadcast_to(add, (s, b)),
                                                           mode="drop")


def _multistep_staged(cfg: ModelConfig, layout: Layout, mesh, vocab: int, max_steps: int,
                      kv_len: int, kernel: bool):
    """The shard_map of `multistep_decode_program` for one kv_len."""
    layer_specs, cache_specs = _specs(cfg, layout)
    decls = param_decls(cfg)
    head_specs = HeadParams(*(sharding.spec(decls[n].axes, layout) if n in decls else None
                              for n in ("embed", "final_norm", "lm_head")))
    reduce = partial(lax.psum, axis_name="tp") if layout.tp > 1 else None

    def body(layers, head, xs, positions, lengths, table, steps, tensors, switch, prompt_mask,
             out_counts, cache):
        stage_fn = _decode_stage_fn(cfg, layers, positions, lengths, table, kv_len, reduce,
                                    kernel)
        head_fn = _sample_head_fn(cfg, layout, vocab, head, tensors, switch, prompt_mask,
                                  out_counts)
        b = xs.shape[1]
        outs = jax.tree.map(lambda a: jnp.zeros((max_steps, *xs.shape[:2], *a.shape[1:]),
                                                a.dtype), shard_head.idle(b, vocab))
        history = jnp.zeros((max_steps, *xs.shape[:2]), jnp.int32)  # [S, M, b] tokens
        outs, cache, _, busy = interleave(stage_fn, head_fn, xs, cache, history, outs,
                                          num_stages=layout.pp, steps=steps)
        return outs, busy[None], cache

    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(layer_specs, head_specs, *[P()] * 9, cache_specs),
                         out_specs=(P(), P("pp"), cache_specs))


def _decode_stage_fn(cfg: ModelConfig, layers: LayerParams, positions, lengths, table,
                     kv_len: int, reduce, kernel: bool):
    """`interleave`'s stage_fn: this stage's layers on micro-batch m at step k. positions,
    lengths [M, b], table [M, b, MB] at the call's start; the cache is the state."""
    def stage_fn(x, m, k, valid, cache):
        # Idle rows (lengths 0) write no KV: their blocks are left exactly as they were.
        writes = jnp.where((valid & (lengths[m] > 0))[:, None], table[m], OUT_OF_RANGE)
        pos = positions[m] + k
        keys = jnp.where(lengths[m] > 0, jnp.minimum(pos + 1, kv_len), 0)
        return decode_stage(cfg, layers, x, pos, keys, table[m], writes, cache, kv_len,
                            reduce, kernel)

    return stage_fn


def _sample_head_fn(cfg: ModelConfig, layout: Layout, vocab: int, head: HeadParams, tensors,
                    switch, prompt_mask, out_counts):
    """`interleave`'s head_fn: logits, sampling (RNG step tensors.step + k) and embedding of
    micro-batch m's next token. tensors, prompt_mask, out_counts: [M, b, ...] at the call's
    start; the state is the tokens sampled so far [S, M, b] (for the penalty counts)."""
    def head_fn(y, m, k, live, history):
        t = jax.tree.map(lambda a: a[m], tensors)

        def penalty_state():  # the counts as the one-step path has them at step k
            return prompt_mask[m], _add_counts(out_counts[m], history[:, m], k)

        x_next, sampled = shard_head.next_token(
            cfg, head, y, live, t._replace(step=t.step + k), penalty_state, switch,
            tp=layout.tp, vocab=vocab)
        tokens = jnp.where(live, sampled.tokens, history[k, m])
        return x_next, sampled, history.at[k, m].set(tokens)

    return head_fn


def microbatches(rows: int, most: int) -> int:
    """The largest number of equal micro-batches of `rows` rows that is at most `most`."""
    return max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)
