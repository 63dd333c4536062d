"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) in Flax NNX.

Layers are stacked along a leading "layers" axis so a pipeline layout can shard that axis and a
tensor-parallel layout can shard heads / mlp: switching layouts is a `device_put` of the same
pytree. Every parameter carries logical axis names (never a physical mesh axis).

The model is pure: the KV cache goes in and comes out. Two entry points:
  prefill(tokens [b, T], lengths [b], slots [b], cache) -> (last-token logits [b, V], cache)
  decode(tokens [B], positions [B], cache, kv_len)       -> (logits [B, V], cache)
Decode runs on cache slots 0..B-1 and attends over the first `kv_len` positions (a static bucket).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpipe.config import ModelConfig
from jaxpipe.kv.device_cache import KVCache, from_storage, to_storage


class ParamDecl(NamedTuple):
    """One parameter, declared once: everything else (init, shardings) derives from it."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" | "normal" (std 0.02) | "fan_in" (std 1/sqrt(fan_in))
    fan_in: int = 1


def param_decls(cfg: ModelConfig) -> dict[str, ParamDecl]:
    """The model's parameters: shape, logical axes and initializer of each."""
    L, E, H, K, D, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    decls = {
        "embed": ParamDecl((V, E), ("vocab", "embed"), "normal"),
        "attn_norm": ParamDecl((L, E), ("layers", "embed"), "ones"),
        "wq": ParamDecl((L, E, H, D), ("layers", "embed", "heads", "head_dim"), "fan_in", E),
        "wk": ParamDecl((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "fan_in", E),
        "wv": ParamDecl((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "fan_in", E),
        "wo": ParamDecl((L, H, D, E), ("layers", "heads", "head_dim", "embed"), "fan_in", H * D),
        "mlp_norm": ParamDecl((L, E), ("layers", "embed"), "ones"),
        "w_gate": ParamDecl((L, E, F), ("layers", "embed", "mlp"), "fan_in", E),
        "w_up": ParamDecl((L, E, F), ("layers", "embed", "mlp"), "fan_in", E),
        "w_down": ParamDecl((L, F, E), ("layers", "mlp", "embed"), "fan_in", F),
        "final_norm": ParamDecl((E,), ("embed",), "ones"),
    }
    if not cfg.tie_embeddings:
        decls["lm_head"] = ParamDecl((E, V), ("embed", "vocab"), "fan_in", E)
    return decls


def _init_value(decl: ParamDecl, key: jax.Array, dtype) -> jax.Array:
    if decl.init == "ones":
        return jnp.ones(decl.shape, dtype)
    std = 0.02 if decl.init == "normal" else 1.0 / math.sqrt(decl.fan_in)
    return (std * jax.random.normal(key, decl.shape, jnp.float32)).astype(dtype)


class Llama(nnx.Module):
    """The decoder. Parameters are attributes named as in `param_decls`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 values: dict[str, jax.Array] | None = None):
        """Random init from `rngs` (seeded) or take `values` (name -> array) from a loader."""
        self.config = cfg
        decls = param_decls(cfg)
        if values is not None and set(values) != set(decls):
            raise ValueError(f"weights do not match the architecture: missing "
                             f"{sorted(set(decls) - set(values))}, unexpected "
                             f"{sorted(set(values) - set(decls))}")
        for name, decl in decls.items():
            if values is not None:
                value = jnp.asarray(values[name], dtype)
                if value.shape != decl.shape:
                    raise ValueError(f"weight {name!r} has shape {value.shape}, the "
                                     f"architecture needs {decl.shape}")
            else:
                value = _init_value(decl, rngs.params(), dtype)
            setattr(self, name, nnx.Param(value, sharding_names=decl.axes, eager_sharding=False))

    def prefill(self, tokens, lengths, slots, cache: KVCache):
        """Run whole prompts, write their KV into `slots`, return last-token logits.

        tokens [b, T] i32 (right-padded), lengths [b] i32, slots [b] i32 -> logits [b, V] f32.
        """
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = self.embed[...][tokens].astype(jnp.float32)  # [b, T, E]
        k_all, v_all = cache
        for layer in range(self.config.num_layers):
            with jax.named_scope(f"layer{layer}"):
                x, k, v = self._prefill_layer(layer, x, positions)
                # Cache is HND: [b, T, Hkv, D] -> [b, Hkv, T, D] at slots, positions 0..T-1.
                # Rows whose slot is out of range (batch padding) are dropped.
                k_all = k_all.at[layer, slots, :, :t].set(
                    to_storage(k.transpose(0, 2, 1, 3), k_all), mode="drop")
                v_all = v_all.at[layer, slots, :, :t].set(
                    to_storage(v.transpose(0, 2, 1, 3), v_all), mode="drop")
        last = x[jnp.arange(b), lengths - 1]  # [b, E]
        return self._logits(last), KVCache(k_all, v_all)

    def decode(self, tokens, positions, cache: KVCache, kv_len: int):
        """One token for each of slots 0..B-1. tokens, positions [B] i32 -> logits [B, V] f32."""
        x = self.embed[...][tokens].astype(jnp.float32)  # [B, E]
        k_all, v_all = cache
        rows = jnp.arange(tokens.shape[0])
        for layer in range(self.config.num_layers):
            with jax.named_scope(f"layer{layer}"):
                h = rms_norm(x, self.attn_norm[layer], self.config.rms_norm_eps)
                q, k, v = self._qkv(layer, h[:, None], positions[:, None])  # [B, 1, H|Hkv, D]
                k_all = k_all.at[layer, rows, :, positions].set(to_storage(k[:, 0], k_all))
                v_all = v_all.at[layer, rows, :, positions].set(to_storage(v[:, 0], v_all))
                kc = from_storage(k_all[layer, : tokens.shape[0], :, :kv_len])  # [B, Hkv, S, D]
                vc = from_storage(v_all[layer, : tokens.shape[0], :, :kv_len])
                attn = decode_attention(q[:, 0], kc, vc, positions)  # [B, H, D]
                x = x + self._proj(attn, self.wo[layer], "bhd,hde->be")
                x = x + self._mlp(layer, x)
        return self._logits(x), KVCache(k_all, v_all)

    def _prefill_layer(self, layer: int, x, positions):
        h = rms_norm(x, self.attn_norm[layer], self.config.rms_norm_eps)
        q, k, v = self._qkv(layer, h, positions)  # [b, T, H|Hkv, D]
        attn = causal_attention(q, k, v)  # [b, T, H, D]
        x = x + self._proj(attn, self.wo[layer], "bthd,hde->bte")
        return x + self._mlp(layer, x), k, v

    def _qkv(self, layer: int, h, positions):
        """h [..., T, E] -> roped q [..., T, H, D], roped k and v [..., T, Hkv, D]."""
        q = self._proj(h, self.wq[layer], "...te,ehd->...thd")
        k = self._proj(h, self.wk[layer], "...te,ehd->...thd")
        v = self._proj(h, self.wv[layer], "...te,ehd->...thd")
        cos, sin = rope_tables(self.config, positions)  # [..., T, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, layer: int, x):
        h = rms_norm(x, self.mlp_norm[layer], self.config.rms_norm_eps)
        gate = self._proj(h, self.w_gate[layer], "...e,ef->...f")
        up = self._proj(h, self.w_up[layer], "...e,ef->...f")
        return self._proj(jax.nn.silu(gate) * up, self.w_down[layer], "...f,fe->...e")

    def _logits(self, x):
        """x [b, E] f32 -> logits [b, V] f32."""
        h = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        if self.config.tie_embeddings:
            return self._proj(h, self.embed[...], "be,ve->bv")
        return self._proj(h, self.lm_head[...], "be,ev->bv")

    @staticmethod
    def _proj(x, w, spec: str):
        # Cast activations to the weight dtype and accumulate in f32: with bf16 weights this is
        # the native bf16 path on CPU (DESIGN.md); the residual stream stays f32.
        return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def rms_norm(x, weight, eps: float):
    """x [..., E] f32, weight [E] -> [..., E] f32."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [D/2], with Llama-3 scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    out = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_mid, mid, out)


def rope_tables(cfg: ModelConfig, positions):
    """positions [...] i32 -> cos, sin [..., 1, D] (broadcast over heads), f32."""
    angles = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)  # [..., D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (HF convention). x [..., H, D] f32."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def causal_attention(q, k, v):
    """Prompt self-attention. q [b, T, H, D], k/v [b, T, Hkv, D] -> [b, T, H, D] f32."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(d)  # [b, Hkv, G, T, T]
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def decode_attention(q, k, v, positions):
    """One query per sequence over its cached keys.

    q [B, H, D] f32; k/v [B, Hkv, S, D] (cache dtype); positions [B]: keys 0..pos are valid.
    """
    bsz, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q = q.reshape(bsz, hkv, h // hkv, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", q.astype(k.dtype), k,
                        preferred_element_type=jnp.float32) / math.sqrt(d)  # [B, Hkv, G, S]
    valid = jnp.arange(s)[None, :] <= positions[:, None]  # [B, S]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(bsz, h, d)


def init_random(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> Llama:
    """Seeded random weights, for tests and benchmarks of architecture-only presets."""
    return Llama(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed))
