"""The decoder of the Llama family and its relatives (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5,
Qwen3, and the mixtures of experts Qwen2/3-MoE and Mixtral) in Flax NNX: one layer, the
families' differences as config switches and optional parameters.

Layers are stacked along a leading "layers" axis so a pipeline layout can shard that axis and a
tensor-parallel layout can shard heads / mlp: switching layouts is a `device_put` of the same
pytree. Every parameter carries logical axis names (never a physical mesh axis).

The math lives in pure per-layer functions over plain arrays (`LayerParams`); the engine's step
(`pipeline.py`) runs them over a ragged token batch with a paged KV pool. `Decoder.forward` is
the plain whole-sequence forward pass (no cache), the reference the step is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels.attention_math import apply_rope, causal_attention, softcap
from jaxpipe.model import moe
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import QuantizedWeight

LAYER_PARAMS = ("attn_norm", "wq", "wkv", "wo", "mlp_norm", "w_gate_up", "w_down",
                "bq", "bkv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm",
                "router", "w_experts_gate_up", "w_experts_down", "shared_gate")


class ParamDecl(NamedTuple):
    """One parameter, declared once: everything else (init, shardings) derives from it."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" | "zeros" | "normal" (std 0.02) | "fan_in" (std 1/sqrt(fan_in))
    fan_in: int = 1


def param_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """The model's parameters: shape, logical axes and initializer of each.

    K and V projections share one weight (`wkv`, pair axis first) and so do gate and up
    (`w_gate_up`): fewer, larger matmuls, which is what the CPU backend needs at decode batch
    sizes. The pair axes are never sharded, so TP splits heads / mlp exactly as unfused.
    The families' optional parameters exist only when the config asks for them: q/k/v
    biases (`bq`, `bkv`, as the projections they add to), per-head q/k norms, the norms
    of the attention and MLP outputs (Gemma's sandwich), and the experts (`moe_decls`).
    The dense MLP (`w_gate_up`, `w_down`, `cfg.mlp_width` wide) is absent where that width
    is 0 (an MoE model without a shared expert or dense layers).

    A mixed dense/MoE model (`cfg.dense_layers`) keeps one uniform stack, so a pipeline
    still splits its layers evenly: every layer holds the experts, the router and the
    dense MLP, the MLP zero-padded to the wider of the dense layers' and the shared
    expert's widths, the experts (and router, shared gate) zero in a dense layer, and
    `mlp` runs only the layer's own path (`lax.cond`). Memory cost over a model of only
    the weights it uses: each dense layer's zero experts, X * 3 * E * F' + E * X
    parameters, and each layer's padding of its MLP, 3 * E * |F_dense - F_shared|;
    all-MoE and dense models pay nothing.
    """
    E, V = cfg.hidden_size, cfg.vocab_size
    # The order is the seeded random init's draw order (`init_random`, `numpy_random_values`):
    # moving a parameter changes the seeded weights of those after it.
    decls = {
        "embed": ParamDecl((V, E), ("vocab", "embed"), "normal"),
        **_attention_decls(cfg),
        **_mlp_decls(cfg),
        "final_norm": ParamDecl((E,), ("embed",), "ones"),
        **moe_decls(cfg),
        **_optional_decls(cfg),
    }
    if not cfg.tie_embeddings:
        decls["lm_head"] = ParamDecl((E, V), ("embed", "vocab"), "fan_in", E)
    return decls


def _attention_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """Every family's attention block: its input norm, the q projection, the fused k/v
    projection (pair axis first) and the output projection."""
    L, E, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "attn_norm": ParamDecl((L, E), ("layers", "embed"), "ones"),
        "wq": ParamDecl((L, E, H, D), ("layers", "embed", "heads", "head_dim"), "fan_in", E),
        "wkv": ParamDecl((L, E, 2, K, D), ("layers", "embed", "kv_pair", "kv_heads", "head_dim"),
                         "fan_in", E),
        "wo": ParamDecl((L, H, D, E), ("layers", "heads", "head_dim", "embed"), "fan_in", H * D),
    }


def _mlp_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """The MLP block's input norm, and the dense MLP (fused gate/up, down) where
    `cfg.mlp_width` is not 0."""
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.mlp_width
    decls = {"mlp_norm": ParamDecl((L, E), ("layers", "embed"), "ones")}
    if F:
        decls["w_gate_up"] = ParamDecl((L, E, 2, F), ("layers", "embed", "gate_up", "mlp"),
                                       "fan_in", E)
        decls["w_down"] = ParamDecl((L, F, E), ("layers", "mlp", "embed"), "fan_in", F)
    return decls


def _optional_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """The parameters only some families have, as the config asks: q/k/v biases, per-head
    q/k norms, and the norms of the attention and MLP outputs (Gemma's sandwich)."""
    L, E, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    decls = {}
    if cfg.qkv_bias:
        decls["bq"] = ParamDecl((L, H, D), ("layers", "heads", "head_dim"), "zeros")
        decls["bkv"] = ParamDecl((L, 2, K, D), ("layers", "kv_pair", "kv_heads", "head_dim"),
                                 "zeros")
    if cfg.qk_norm:
        decls["q_norm"] = ParamDecl((L, D), ("layers", "head_dim"), "ones")
        decls["k_norm"] = ParamDecl((L, D), ("layers", "head_dim"), "ones")
    if cfg.sandwich_norms:
        decls["post_attn_norm"] = ParamDecl((L, E), ("layers", "embed"), "ones")
        decls["post_mlp_norm"] = ParamDecl((L, E), ("layers", "embed"), "ones")
    return decls


def moe_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """The experts of an MoE model (none for a dense one): the router [L, E, X], every
    expert's gate/up [L, X, E, 2, F'] and down [L, X, F', E] stacked along a logical
    `experts` axis, and the shared expert's sigmoid gate [L, E] where the dense MLP is one."""
    if not cfg.is_moe:
        return {}
    L, E, X, F = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    decls = {
        "router": ParamDecl((L, E, X), ("layers", "embed", "router"), "fan_in", E),
        "w_experts_gate_up": ParamDecl((L, X, E, 2, F),
                                       ("layers", "experts", "embed", "gate_up", "moe_mlp"),
                                       "fan_in", E),
        "w_experts_down": ParamDecl((L, X, F, E), ("layers", "experts", "moe_mlp", "embed"),
                                    "fan_in", F),
    }
    if cfg.intermediate_size:
        decls["shared_gate"] = ParamDecl((L, E), ("layers", "embed"), "fan_in", E)
    return decls


def _init_value(decl: ParamDecl, key: jax.Array, dtype) -> jax.Array:
    if decl.init in ("ones", "zeros"):
        return (jnp.ones if decl.init == "ones" else jnp.zeros)(decl.shape, dtype)
    std = 0.02 if decl.init == "normal" else 1.0 / math.sqrt(decl.fan_in)
    return (std * jax.random.normal(key, decl.shape, jnp.float32)).astype(dtype)


class LayerParams(NamedTuple):
    """One decoder layer's weights (a slice of the stacked parameters); the optional ones are
    None where the config has none."""

    attn_norm: jax.Array  # [E]
    wq: jax.Array  # [E, H, D]
    wkv: jax.Array  # [E, 2, Hkv, D]
    wo: jax.Array  # [H, D, E]
    mlp_norm: jax.Array  # [E]
    w_gate_up: jax.Array | None  # [E, 2, F]; None: no dense MLP (MoE, no shared expert)
    w_down: jax.Array | None  # [F, E]
    bq: jax.Array | None = None  # [H, D]
    bkv: jax.Array | None = None  # [2, Hkv, D]
    q_norm: jax.Array | None = None  # [D]
    k_norm: jax.Array | None = None  # [D]
    post_attn_norm: jax.Array | None = None  # [E]
    post_mlp_norm: jax.Array | None = None  # [E]
    router: jax.Array | None = None  # [E, X]
    w_experts_gate_up: jax.Array | None = None  # [X, E, 2, F']
    w_experts_down: jax.Array | None = None  # [X, F', E]
    shared_gate: jax.Array | None = None  # [E]


class ExpertShard(NamedTuple):
    """A device's share of the stacked experts (inside `shard_map`, under expert parallelism):
    shard `index` of the `experts` axis, whose partial outputs `reduce` sums over the shards.
    Every device holds every token, so no token moves: each runs its own experts only."""

    index: jax.Array  # i32 scalar: this device holds experts [index * X', (index + 1) * X')
    reduce: Callable  # [T, E] partial sums -> [T, E] total (a psum)


class HeadParams(NamedTuple):
    """What turns tokens into the residual stream and back into logits."""

    embed: jax.Array  # [V, E]; a tied quantized model: its QuantizedWeight LM head [E, V]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None  # [E, V], None when tied to `embed`


class Decoder(nnx.Module):
    """The decoder. Parameters are attributes named as in `param_decls`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 values: dict[str, jax.Array] | None = None):
        """Random init from `rngs` (seeded) or take `values` (name -> array) from a loader."""
        self.config = cfg
        if values is not None:
            check_values(cfg, values)
        for name, decl in param_decls(cfg).items():
            value = (_init_value(decl, rngs.params(), dtype) if values is None
                     else jnp.asarray(values[name], dtype))
            setattr(self, name, nnx.Param(value, sharding_names=decl.axes, eager_sharding=False))

    def layer(self, index: int) -> LayerParams:
        return LayerParams(*(getattr(self, n)[index] if hasattr(self, n) else None
                             for n in LAYER_PARAMS))

    def head(self) -> HeadParams:
        lm_head = None if self.config.tie_embeddings else self.lm_head[...]
        return HeadParams(self.embed[...], self.final_norm[...], lm_head)

    def forward(self, tokens):
        """Logits [b, T, V] of whole sequences tokens [b, T] (causal, no cache, no padding)."""
        cfg, head = self.config, self.head()
        x = embed(head, tokens, cfg.embed_scale)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        for i in range(cfg.num_layers):
            local = i in cfg.sliding_layers

            def attention(q, kv, local=local):
                q, k, v = rotate(cfg, q, kv, positions, local)
                return causal_attention(q, k, v, window=cfg.sliding_window if local else 0,
                                        softcap=cfg.attn_softcap or 0.0,
                                        scale=cfg.attn_scale), None

            with jax.named_scope(f"layer{i}"):
                x, _ = layer(cfg, self.layer(i), x, attention,
                             moe_layer=i not in cfg.dense_layers)
        b, t, e = x.shape
        return logits(cfg, head, x.reshape(b * t, e)).reshape(b, t, -1)


# ---- per-layer functions (pure, over arrays) ---------------------------------------------------


def embed(head: HeadParams, tokens, scale: float = 1.0, rows=None):
    """tokens [...] i32 -> residual stream [..., E] f32, times `scale` (rounded to the
    embedding's dtype, as HF's Gemma does). A quantized `head.embed` is a tied LM head [E,
    V] (`model/quantized.py`): its dequantized rows, read by `rows(weight, tokens)` (None:
    `QuantizedWeight.rows`, natural order), times `scale` in f32; GGUF blocks (`GgufWeight`):
    only the gathered rows are decoded."""
    if isinstance(head.embed, QuantizedWeight):
        x = (rows or QuantizedWeight.rows)(head.embed, tokens)
        return x if scale == 1.0 else x * jnp.float32(scale)
    if isinstance(head.embed, GgufWeight):
        x = head.embed.lookup(tokens)
        return x if scale == 1.0 else x * jnp.float32(scale)
    x = jnp.take(head.embed, tokens, axis=0).astype(jnp.float32)
    return x if scale == 1.0 else x * jnp.asarray(scale, head.embed.dtype).astype(jnp.float32)


def xla_dot(x, w):
    """x [M, K] @ w [K, N] -> [M, N] f32, x cast to w's dtype, accumulated in f32; a
    quantized w (`QuantizedWeight`): x quantized per row, its kind's dot (`model/quantized.py`);
    GGUF blocks (`GgufWeight`): XLA's reference of the format (`model/gguf_quantized.py`)."""
    if isinstance(w, (QuantizedWeight, GgufWeight)):
        return w.dot(x)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _matmul(x, w, n: int = 1, dot=None):
    """Contract the last `n` axes of x with the first `n` axes of w, as one 2-D matmul
    (`dot`, default `xla_dot`: the caller may pass a kernel with the same contract).

    Activations are cast to the weight dtype and accumulate in f32: with bf16 weights this is
    the native bf16 path on CPU (`preferred_element_type=f32`; a plain bf16 dot is slower than
    f32); the residual stream stays f32. A 2-D dot, not a multi-axis einsum: XLA's CPU backend
    runs the latter ~2x slower (85 vs 160-210 GFLOP/s for the decode layer shapes, measured
    here)."""
    k = math.prod(w.shape[:n])
    lead, out = x.shape[: x.ndim - n], w.shape[n:]
    y = (dot or xla_dot)(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*lead, *out)


def layer(cfg: ModelConfig, p: LayerParams, x, attention, reduce=None, dot=None, gated=None,
          shard: ExpertShard | None = None, experts=None, moe_layer=True):
    """One decoder layer, the one composition every caller runs (the whole-sequence forward
    here, a pipeline stage's ragged step in `runtime/pipeline.py`): x [..., E] -> (x, what
    `attention` wrote). `attention(q, kv)` takes the projections before RoPE (q [..., H, D],
    kv [..., 2, Hkv, D], `projections`) and returns (attn [..., H, D], anything it wrote: a
    step's paged KV; None here); it rotates (`rotate`), stores and attends as its caller's
    kernels do. `reduce`, `dot`, `gated`, `shard`, `experts`, `moe_layer`: see
    `attn_out_mlp`."""
    q, kv = projections(cfg, p, x, dot)
    attn, written = attention(q, kv)
    return attn_out_mlp(cfg, p, x, attn, reduce, dot, gated, shard, experts, moe_layer), written


def rotate(cfg: ModelConfig, q, kv, positions, local=False):
    """Projections q [..., H, D], kv [..., 2, Hkv, D] at positions [...] -> roped q, roped k
    and v [..., Hkv, D]. `local`: see `rope_angles`."""
    cos, sin = rope_tables(cfg, positions, local)  # [..., 1, D]
    return apply_rope(q, cos, sin), apply_rope(kv[..., 0, :, :], cos, sin), kv[..., 1, :, :]


def projections(cfg: ModelConfig, p: LayerParams, x, dot=None):
    """x [..., E] -> q [..., H, D] and kv [..., 2, Hkv, D] (f32) before RoPE: biases added
    and q, k normalised per head where the layer has them. `dot`: see `_matmul`."""
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
    q, kv = _matmul(h, p.wq, dot=dot), _matmul(h, p.wkv, dot=dot)
    if p.bq is not None:
        q, kv = q + p.bq.astype(jnp.float32), kv + p.bkv.astype(jnp.float32)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        kv = jnp.stack([rms_norm(kv[..., 0, :, :], p.k_norm, cfg.rms_norm_eps),
                        kv[..., 1, :, :]], axis=-3)
    return q, kv


def attn_out_mlp(cfg: ModelConfig, p: LayerParams, x, attn, reduce=None, dot=None,
                 gated=None, shard: ExpertShard | None = None, experts=None, moe_layer=True):
    """Residual updates after attention: x [..., E], attn [..., H, D] -> x [..., E].

    `reduce` sums the partial products of the two row-split matmuls (`wo`, `w_down`) across
    tensor-parallel shards (a `psum` inside `shard_map`); None on one shard. `dot`, `gated`:
    see `_matmul` and `gated_mlp`; `shard`, `experts`, `moe_layer`: see `mlp`."""
    reduce = reduce or (lambda y: y)

    def residual(x, y, norm):  # Gemma's sandwich: the output normalised before its add
        return x + (y if norm is None else rms_norm(y, norm, cfg.rms_norm_eps))

    x = residual(x, reduce(_matmul(attn, p.wo, 2, dot)), p.post_attn_norm)
    h = rms_norm(x, p.mlp_norm, cfg.rms_norm_eps)
    out = mlp(cfg, p, h, dot, gated, shard, experts, moe_layer)
    return residual(x, reduce(out), p.post_mlp_norm)


def mlp(cfg: ModelConfig, p: LayerParams, h, dot=None, gated=None,
        shard: ExpertShard | None = None, experts=None, moe_layer=True):
    """The MLP of normalised h [..., E] -> [..., E] f32 (a partial sum under tensor
    parallelism, as the row-split `w_down`'s): the dense gated MLP, or the experts plus,
    where the layer has one, the shared expert (the dense MLP) times sigmoid(h . shared_gate).
    `dot`, `gated`: see `_matmul` and `gated_mlp` (the dense MLP's); `shard`: this device's
    experts under expert parallelism (None: it holds them all); `experts`: the experts'
    path (`moe.experts_mlp`'s `path`; None: the platform's default); `moe_layer`:
    whether an MoE model's layer runs its experts or its dense MLP (`cfg.dense_layers`): a
    bool, or a traced one (a stacked layer's), where `lax.cond` runs only the layer's own
    path."""
    def dense(h):
        return dense_mlp(cfg, p, h, dot, gated)

    def experts_path(h):
        return _moe_mlp(cfg, p, h, dot, gated, shard, experts)

    if p.router is None or moe_layer is False:
        return dense(h)
    if moe_layer is True:
        return experts_path(h)
    return jax.lax.cond(moe_layer, experts_path, dense, h)


def dense_mlp(cfg: ModelConfig, p: LayerParams, h, dot=None, gated=None):
    """The dense gated MLP (or shared expert) of h [..., E] -> [..., E] f32."""
    act = gated_mlp(h, p.w_gate_up, dot, gated, cfg.mlp_act)  # [..., F]
    return _matmul(act, p.w_down, dot=dot)


def _moe_mlp(cfg: ModelConfig, p: LayerParams, h, dot, gated, shard, experts):
    """The experts of h [..., E] -> [..., E] f32, plus the shared expert where the layer has
    one (see `mlp`)."""
    e = h.shape[-1]
    flat = h.reshape(-1, e)  # [T, E]
    with jax.named_scope("experts"):
        weights, chosen = moe.route(flat, p.router, cfg.num_experts_per_tok,
                                    cfg.norm_topk_prob)
        if shard is not None:
            weights, chosen = local_experts(weights, chosen, shard.index,
                                            p.w_experts_gate_up.shape[0])
        out = moe.experts_mlp(flat, weights, chosen, p.w_experts_gate_up, p.w_experts_down,
                              experts)
        if shard is not None:
            out = shard.reduce(out)
    if p.shared_gate is not None:
        share = jax.nn.sigmoid(flat @ p.shared_gate.astype(jnp.float32))  # [T]
        out = out + share[:, None] * dense_mlp(cfg, p, h, dot, gated).reshape(-1, e)
    return out.reshape(h.shape)


def local_experts(weights, experts, index, count: int):
    """The routing as shard `index` of `count` experts each sees it: weights / experts [T, k]
    -> the same with ids local to the shard, and for every choice of another shard's expert
    the id `count` (out of range: every path skips it, `moe.experts_mlp`) and a weight
    0. Shapes stay [T, k]; the grouped path multiplies only the shard's own pairs, the
    ragged one still runs all T*k rows (memory split, not its FLOPs), the dense one runs the
    shard's experts on every token."""
    local = experts - index * count
    mine = (local >= 0) & (local < count)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, count)


def gated_mlp(h, w, dot=None, gated=None, act: str = "silu"):
    """act(h @ gate) * (h @ up): h [..., E], w [E, 2, F] (gate, up) -> [..., F] f32; act
    "silu" or "gelu_tanh". `gated(h2, w2)` ([M, E] and w as [E, 2F] -> [M, F]) may compute
    it in one kernel (silu only); None: `_matmul` with `dot`, then the activation."""
    if gated is not None and act == "silu":
        e = w.shape[0]
        return gated(h.reshape(-1, e), w.reshape(e, -1)).reshape(*h.shape[:-1], -1)
    gate_up = _matmul(h, w, dot=dot)  # [..., 2, F]
    fn = jax.nn.silu if act == "silu" else partial(jax.nn.gelu, approximate=True)
    return fn(gate_up[..., 0, :]) * gate_up[..., 1, :]


def logits(cfg: ModelConfig, head: HeadParams, x):
    """x [b, E] f32 -> logits [b, V] f32."""
    h = rms_norm(x, head.final_norm, cfg.rms_norm_eps)
    if head.lm_head is None and isinstance(head.embed, GgufWeight):  # tied, in its blocks
        out = head.embed.dot(h)
    elif head.lm_head is None:  # tied: contract with the embedding's E axis, [V, E] as stored
        out = jax.lax.dot_general(h.astype(head.embed.dtype), head.embed,
                                  (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        out = _matmul(h, head.lm_head)
    return softcap(out, cfg.final_softcap)


def rms_norm(x, weight, eps: float):
    """x [..., E] f32, weight [E] -> [..., E] f32."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [R/2] of the R = rotary_dim (default head_dim) rotated dimensions,
    scaled as the config's `rope_scaling` says (HF's definitions of each type)."""
    d = cfg.rotary_dim or cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = cfg.rope_scaling
    if s is None or s.rope_type == "dynamic":  # dynamic: base frequencies up to max positions
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    if s.rope_type == "longrope":  # short factors: the engine stops at the original length
        return inv / jnp.asarray(s.short_factor, jnp.float32)
    if s.rope_type == "yarn":
        return _yarn_inv_freq(cfg, inv)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    out = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_mid, mid, out)


def _yarn_inv_freq(cfg: ModelConfig, inv: jax.Array) -> jax.Array:
    """YaRN: interpolated (/ factor) below the correction range's low dimension,
    extrapolated (as is) above its high one, a linear ramp between."""
    s, d = cfg.rope_scaling, cfg.rotary_dim or cfg.head_dim

    def correction_dim(rotations: float) -> float:
        return (d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(cfg.rope_theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv / s.factor * (1 - extrapolation) + inv * extrapolation


def rope_angles(cfg: ModelConfig, positions, local=False):
    """positions [...] i32 -> cos, sin [..., D/2] f32 of each position's D/2 angles (times
    YaRN's attention factor, as HF scales them). `local` (a bool, or a traced one: a layer
    index's): a sliding-window layer's, with `rope_local_theta` where the config has one."""
    out = _rope_angles(cfg, positions)
    if cfg.rope_local_theta is None or local is False:
        return out
    plain = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
    local_out = _rope_angles(plain, positions)
    return tuple(jnp.where(local, a, b) for a, b in zip(local_out, out, strict=True))


def _rope_angles(cfg: ModelConfig, positions):
    angles = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)  # [..., R/2]
    s = cfg.rope_scaling
    scaled = s is not None and s.rope_type in ("yarn", "longrope")
    scale = s.attention_factor if scaled else 1.0
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rope_tables(cfg: ModelConfig, positions, local=False):
    """positions [...] i32 -> cos, sin [..., 1, D] (broadcast over heads), f32."""
    cos, sin = rope_angles(cfg, positions, local)
    return (jnp.concatenate([cos, cos], axis=-1)[..., None, :],
            jnp.concatenate([sin, sin], axis=-1)[..., None, :])


def check_values(cfg: ModelConfig, values: dict, held: frozenset[str] = frozenset()) -> None:
    """Raise unless `values` (name -> array) fit the architecture: every parameter there but
    those `held` elsewhere (GGUF blocks), each of its shape."""
    decls = param_decls(cfg)
    if set(values) != set(decls) - held:
        raise ValueError(f"weights do not match the architecture: missing "
                         f"{sorted(set(decls) - held - set(values))}, unexpected "
                         f"{sorted(set(values) - (set(decls) - held))}")
    for name, value in values.items():
        if tuple(np.shape(value)) != decls[name].shape:
            raise ValueError(f"weight {name!r} has shape {tuple(np.shape(value))}, the "
                             f"architecture needs {decls[name].shape}")


def checked_values(cfg: ModelConfig, values: dict, dtype,
                   held: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """A loader's `values`, checked (`check_values`), as host arrays of `dtype` (those
    already of it as they are)."""
    check_values(cfg, values, held)
    return {name: np.asarray(value, dtype) for name, value in values.items()}


def init_random(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> Decoder:
    """Seeded random weights, for tests and benchmarks of architecture-only presets."""
    return Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed))


def numpy_random_values(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random f32 weights by parameter name, drawn on the host with NumPy (eager
    jax.random compiles once per shape, slow for tests that build many small models)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, d in param_decls(cfg).items():
        scale = {"normal": 0.02, "zeros": 0.1}.get(d.init, d.fan_in ** -0.5)
        base = 1.0 if d.init == "ones" else 0.0
        out[name] = (base + scale * rng.standard_normal(d.shape)).astype(np.float32)
    return out
