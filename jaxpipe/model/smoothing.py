"""SmoothQuant-style smoothing (Xiao et al. 2023) of a float model before W8A8
(`quantization="int8"`): why int8 loses perplexity and what moves the loss into the weights.

Dynamic W8A8 gives each token's activations one scale (`kernels/int8.py`): a channel that is
always 50x the others (SmolLM2's residual stream has such channels, and its down projection's
input reaches 450 where the median channel is 7) takes the grid, and the other channels keep
a few codes each. Measured on SmolLM2-135M (3,000 tokens of the perplexity text, f32 model
18.79): W8A8 everywhere 19.84, weights alone 18.92, activations alone 19.59; by weight, W8A8
on wkv, w_gate_up or w_down alone costs 1.5-1.7% each, wq, wo and the LM head under 0.4%.

The fix keeps the W8A8 contract: for a matmul x @ W, pick a factor s[k] per input channel
and compute (x / s) @ (s W), the same product in exact arithmetic. With s[k] =
max|x[:, k]|^alpha / max|W[k, :]|^(1 - alpha) the activations' outlier channels shrink and
the weights' rows grow to meet them; both then quantize with small error. alpha = 0.5,
SmoothQuant's default. The best alpha depends on the text it is judged on, so treat the
choice as settled by no text: W8A8 perplexity of the calibration text is lowest at 0.6
(20.94 unsmoothed, 20.46 at 0.5, 20.21 at 0.6, 20.38 at 0.8; f32 20.16), of the perplexity
text's first 3,000 tokens at 0.65 (19.06 at 0.5, 18.89 at 0.65), of the whole perplexity
text at 0.5 (the engine: 16.70 at 0.5, 16.75 at 0.6; bf16 16.38). The
division is folded into what makes x, so the model's float weights change and nothing at run
time does:

- wq and wkv's input is attn_norm's output: attn_norm[k] / s[k], wq and wkv rows * s[k];
- w_gate_up's input is mlp_norm's output: mlp_norm[k] / s[k], w_gate_up rows * s[k];
- w_down's input is silu(gate) * up (or gelu): the up half's column f / s[f], w_down row
  f * s[f].

Every family's norms multiply by their stored weight (Gemma's `1 + w` is added at load), so
the folds are exact there. An MoE model's mlp_norm feeds the router and the experts too: its
MLP inputs are left as they are (a log line says so) and only its attention is smoothed. wo's
input (attention output; its V columns would take the division, one factor per (kv head,
head dim) under GQA) costs 0.1% measured and is left alone.

max|x| per channel comes from the float model run over a short calibration text shipped here
(`data/calibration.txt`, written for the purpose: narrative, dialogue, technical prose, code,
a recipe, a list), not the perplexity text the quality is measured on.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels.attention_math import causal_attention
from jaxpipe.model import decoder

log = logging.getLogger(__name__)

ALPHA = 0.5  # the share of the outliers moved into the weights (see the module docstring)
CALIBRATION_TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
# the matmuls whose inputs are measured: input site -> the weight it feeds first
SITES = {"attn": "wkv", "mlp": "w_gate_up", "down": "w_down"}


class _Tagged:
    """A weight that says its name to the calibration's `dot` (only inside a trace)."""

    def __init__(self, w, name: str):
        self.w, self.name = w, name

    @property
    def shape(self):
        return self.w.shape

    def reshape(self, *shape):
        return _Tagged(self.w.reshape(*shape), self.name)


def smooth_model(cfg: ModelConfig, weights: dict, tokenizer, alpha: float = ALPHA) -> dict:
    """`weights` (name -> [L, ...] arrays) smoothed for W8A8, calibrated on the shipped text;
    unchanged (with a log line saying why) where there is no tokenizer to read it with."""
    if tokenizer is None:
        log.info("int8 smoothing skipped: the model has no tokenizer for the calibration text")
        return weights
    start = time.perf_counter()
    ids = tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)
    out = smooth(cfg, weights, calibrate(cfg, weights, ids), alpha)
    log.info("int8 smoothing: calibrated on %d tokens, alpha %.2f, in %.1f s", len(ids), alpha,
             time.perf_counter() - start)
    return out


def calibrate(cfg: ModelConfig, weights: dict, token_ids) -> dict[str, np.ndarray]:
    """max |x| per input channel at each smoothed site, over `token_ids` run through the float
    model: {"attn": [L, E], "mlp": [L, E], "down": [L, F]} f32 (only the sites the model
    has)."""
    head = decoder.HeadParams(weights["embed"], weights["final_norm"], None)
    x = decoder.embed(head, jnp.asarray(token_ids, jnp.int32)[None], cfg.embed_scale)
    seen: dict[str, list] = {}
    for i in range(cfg.num_layers):
        p = decoder.LayerParams(*(jnp.asarray(weights[n][i]) if n in weights else None
                                  for n in decoder.LAYER_PARAMS))
        x, amax = _layer_amax(cfg, p, x, i in cfg.sliding_layers, i not in cfg.dense_layers)
        for site, name in SITES.items():
            if name in amax:
                seen.setdefault(site, []).append(np.asarray(amax[name]))
    return {site: np.stack(v) for site, v in seen.items()}


@partial(jax.jit, static_argnums=(0, 3, 4))
def _layer_amax(cfg: ModelConfig, p: decoder.LayerParams, x, local: bool, moe_layer: bool):
    """One float layer over x [1, T, E] f32 -> (its output, {weight name: max |input| per
    channel} for the tagged weights), attending as `Decoder.forward` does."""
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    amax = {}

    def dot(x2, w):  # [M, K] @ [K, N]
        if isinstance(w, _Tagged):
            amax[w.name] = jnp.max(jnp.abs(x2), axis=0)
            w = w.w
        return decoder.xla_dot(x2, w.astype(jnp.float32))

    def attention(q, kv):
        q, k, v = decoder.rotate(cfg, q, kv, positions, local)
        return causal_attention(q, k, v, window=cfg.sliding_window if local else 0,
                                softcap=cfg.attn_softcap or 0.0, scale=cfg.attn_scale), None

    names = ("wkv",) if cfg.is_moe else SITES.values()  # see `smooth`
    tagged = p._replace(**{n: _Tagged(getattr(p, n), n) for n in names
                           if getattr(p, n) is not None})
    out, _ = decoder.layer(cfg, tagged, x, attention, dot=dot, moe_layer=moe_layer)
    return out, amax


def smooth(cfg: ModelConfig, weights: dict, amax: dict[str, np.ndarray],
           alpha: float = ALPHA) -> dict:
    """`weights` with the smoothing factors of `amax` (`calibrate`) folded in (f32 copies of
    the weights it changes; the others as given). The float model's function is unchanged."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
    out = dict(weights)
    f32 = {n: np.array(weights[n], np.float32) for n in
           ("attn_norm", "wq", "wkv", "mlp_norm", "w_gate_up", "w_down") if n in weights}
    L = cfg.num_layers
    s = factors(amax["attn"], _row_max(f32["wq"], f32["wkv"]), alpha)  # [L, E]
    f32["attn_norm"] /= s
    f32["wq"] *= s.reshape(L, -1, 1, 1)
    f32["wkv"] *= s.reshape(L, -1, 1, 1, 1)
    if cfg.is_moe:
        log.info("int8 smoothing: attention inputs only; the MoE MLP's input norm also feeds "
                 "its router and experts, so its MLP inputs are not smoothed")
    elif "w_gate_up" in f32:
        _smooth_mlp(f32, amax, alpha)
    out.update(f32)
    return out


def _smooth_mlp(f32: dict, amax: dict[str, np.ndarray], alpha: float) -> None:
    """Fold the MLP's factors into `f32` in place: mlp_norm into w_gate_up, then the up half
    of w_gate_up [L, E, 2, F] into w_down [L, F, E]."""
    L = f32["mlp_norm"].shape[0]
    s = factors(amax["mlp"], _row_max(f32["w_gate_up"]), alpha)  # [L, E]
    f32["mlp_norm"] /= s
    f32["w_gate_up"] *= s.reshape(L, -1, 1, 1)
    s = factors(amax["down"], _row_max(f32["w_down"]), alpha)  # [L, F]
    f32["w_gate_up"][:, :, 1, :] /= s[:, None, :]
    f32["w_down"] *= s[:, :, None]


def _row_max(*ws: np.ndarray) -> np.ndarray:
    """max |w[l, k, ...]| over everything after the input channel k, of all `ws`: [L, K]."""
    return np.max([np.abs(w.reshape(*w.shape[:2], -1)).max(axis=-1) for w in ws], axis=0)


def factors(x_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s = x_max^alpha / w_max^(1 - alpha) per channel; 1 where either side is 0 (a channel
    the calibration never lit, or a zero row: nothing to balance)."""
    ok = (x_max > 0) & (w_max > 0)
    s = np.where(ok, np.power(np.where(ok, x_max, 1.0), alpha)
                 / np.power(np.where(ok, w_max, 1.0), 1.0 - alpha), 1.0)
    return s.astype(np.float32)
