"""The SPMD pipeline: GPipe over the `pp` mesh axis, tensor parallelism over `tp` inside it.

A step is one `jax.shard_map` over the whole mesh, manual over every axis, so every collective
is spelled out: each device holds its stage's layers (`layers` split over pp) and its share of
heads / mlp columns (split over tp). M micro-batches pass through pp stages in M + pp - 1
ticks; after each tick the activations move one stage on with `lax.ppermute`. A stage with no
micro-batch in a tick (pipeline fill and drain: the bubble) computes on garbage and writes its
KV to an out-of-range slot, which the scatter drops. Each stage writes only its own layers' KV.
With pp = 1 and M = 1 this is the plain forward (one tick).

Prefill and decode differ only in the stage function; embedding and logits run outside the
pipeline, partitioned by XLA from the weights' shardings (vocab split over tp).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe import sharding
from jaxpipe.config import ModelConfig
from jaxpipe.kernels import decode_attention as attention_kernel
from jaxpipe.kv.device_cache import KVCache, from_storage, to_storage
from jaxpipe.layout import Layout
from jaxpipe.model import llama
from jaxpipe.model.llama import LAYER_PARAMS, HeadParams, LayerParams, param_decls


def attend_decode(q, k, v, lengths, kernel: bool = False):
    """Decode attention, called inside `shard_map` (every array is this device's shard: its
    heads and its rows), so the C++ kernel (a custom call XLA cannot partition) works here.

    q [B, H, D] f32; k, v [B, Hkv, S, D] in the cache's storage dtype (uint16 for bf16);
    lengths [B] i32: keys 0..length-1 are attended, 0 marks an idle row (output zeros).
    Returns [B, H, D] f32. H is a multiple of Hkv (GQA). `kernel`: use the C++ kernel."""
    if kernel:
        return attention_kernel.decode_attention(q, k, v, lengths)
    out = llama.decode_attention(q, from_storage(k), from_storage(v), lengths - 1)
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


def prefill_stage(cfg: ModelConfig, layers: LayerParams, x, slots, cache: KVCache, reduce):
    """This stage's layers over whole prompts x [b, T, E]; K/V of positions 0..T-1 go into
    `slots` [b] (out-of-range slots are dropped). cache: [Ls, N, Hkv, S, D] each."""
    t = x.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]

    def layer(carry, inputs):
        x, k, v = carry
        p, j = inputs
        q, kn, vn = llama.qkv(cfg, p, x, positions)  # [b, T, H|Hkv, D]
        k = k.at[j, slots, :, :t].set(to_storage(kn.transpose(0, 2, 1, 3), k), mode="drop")
        v = v.at[j, slots, :, :t].set(to_storage(vn.transpose(0, 2, 1, 3), v), mode="drop")
        x = llama.attn_out_mlp(cfg, p, x, llama.causal_attention(q, kn, vn), reduce)
        return (x, k, v), None

    # A rolled loop: unrolling made prefill slower here (0.88 -> 1.71 s, 16 x 64 tokens, one
    # device, bf16) and compiles 5x longer.
    (x, k, v), _ = lax.scan(layer, (x, *cache), (layers, jnp.arange(layers.wq.shape[0])))
    return x, KVCache(k, v)


def decode_stage(cfg: ModelConfig, layers: LayerParams, x, positions, lengths, start, rows,
                 cache: KVCache, kv_len: int, reduce, kernel: bool = False):
    """This stage's layers for one token of rows start..start+b-1: x [b, E], positions [b],
    lengths [b] (0: idle row). K/V are written at `rows` [b] (out of range: dropped) and
    attention reads the first kv_len positions of rows start.."""
    b = x.shape[0]
    _, _, hkv, _, d = cache.k.shape

    def layer(carry, inputs):
        x, k, v = carry
        p, j = inputs
        q, kn, vn = llama.qkv(cfg, p, x, positions)  # [b, H|Hkv, D]
        k = k.at[j, rows, :, positions].set(to_storage(kn, k), mode="drop")
        v = v.at[j, rows, :, positions].set(to_storage(vn, v), mode="drop")
        window = (1, b, hkv, kv_len, d)
        kr = lax.dynamic_slice(k, (j, start, 0, 0, 0), window)[0]  # [b, Hkv, kv_len, D]
        vr = lax.dynamic_slice(v, (j, start, 0, 0, 0), window)[0]
        x = llama.attn_out_mlp(cfg, p, x, attend_decode(q, kr, vr, lengths, kernel), reduce)
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


def _staged(cfg: ModelConfig, layout: Layout, mesh, body):
    layer_specs, cache_specs = _specs(cfg, layout)
    reduce = partial(lax.psum, axis_name="tp") if layout.tp > 1 else None
    return jax.shard_map(partial(body, reduce), mesh=mesh, check_vma=False,
                         in_specs=(layer_specs, P(), P(), P(), cache_specs),
                         out_specs=(P(), cache_specs))


def prefill_program(cfg: ModelConfig, layout: Layout, mesh, vocab: int, microbatches: int):
    """jit(params, cache, tokens [b, T], lengths [b], slots [b]) -> (logits [b, vocab], cache).

    The b prompts flow as `microbatches` micro-batches; `vocab` cuts off padded logits."""
    def body(reduce, layers, xs, slots, lengths, cache):
        n = cache.k.shape[1]

        def stage_fn(x, m, valid, cache):
            return prefill_stage(cfg, layers, x, jnp.where(valid, slots[m], n), cache, reduce)

        return gpipe(stage_fn, xs, cache, num_stages=layout.pp,
                     readout=lambda y, m: llama.last_positions(y, lengths[m]))

    staged = _staged(cfg, layout, mesh, body)

    def prefill(params, cache, tokens, lengths, slots):
        layers, head = _split(params)
        b, t = tokens.shape
        mb = (microbatches, b // microbatches)
        xs = llama.embed(head, tokens).reshape(*mb, t, -1)  # [M, b/M, T, E]
        last, cache = staged(layers, xs, slots.reshape(mb), lengths.reshape(mb), cache)
        return llama.logits(cfg, head, last.reshape(b, -1))[:, :vocab], cache

    return jax.jit(prefill, donate_argnames="cache")


def decode_program(cfg: ModelConfig, layout: Layout, mesh, vocab: int, microbatches: int,
                   kernel: bool = False):
    """jit(params, cache, tokens [B], positions [B], lengths [B], kv_len=static)
    -> (logits [B, vocab], cache). Rows are slots 0..B-1, split into `microbatches`
    contiguous micro-batches that flow through the stages. `kernel`: C++ decode attention."""
    def body(kv_len, reduce, layers, xs, positions, lengths, cache):
        n, b = cache.k.shape[1], xs.shape[1]

        def stage_fn(x, m, valid, cache):
            rows = jnp.where(valid, m * b + jnp.arange(b), n)
            return decode_stage(cfg, layers, x, positions[m], lengths[m], m * b, rows, cache,
                                kv_len, reduce, kernel)

        return gpipe(stage_fn, xs, cache, num_stages=layout.pp, readout=lambda y, m: y)

    def decode(params, cache, tokens, positions, lengths, kv_len):
        layers, head = _split(params)
        mb = (microbatches, tokens.shape[0] // microbatches)
        staged = _staged(cfg, layout, mesh, partial(body, kv_len))
        xs = llama.embed(head, tokens).reshape(*mb, -1)  # [M, B/M, E]
        out, cache = staged(layers, xs, positions.reshape(mb), lengths.reshape(mb), cache)
        return llama.logits(cfg, head, out.reshape(tokens.shape[0], -1))[:, :vocab], cache

    return jax.jit(decode, static_argnames="kv_len", donate_argnames="cache")


def microbatches(rows: int, most: int) -> int:
    """The largest number of equal micro-batches of `rows` rows that is at most `most`."""
    return max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)
