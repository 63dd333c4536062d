"""The mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): a router picks each token's
top-k experts, each expert is a gated MLP, their outputs are summed weighted by the router's
probabilities. Every token reaches all k of its experts (nothing is dropped), and no shape
depends on the routing.

Two dispatches, the same numbers (`experts_mlp`):
  - "ragged" (sorted segments): the T*k (token, expert) pairs sorted by expert, so each
    expert's tokens are one contiguous segment, and `jax.lax.ragged_dot` multiplies each
    segment by its expert's weights (group sizes are data, shapes static: [T*k, ...]). On
    GPU and TPU XLA lowers ragged_dot to a grouped matmul: k/X of the dense FLOPs.
  - "dense": every expert on every token, weighted by the zero-padded gates [T, X]. On CPU
    JAX lowers ragged_dot to a dense batched dot over X masked copies of the T*k rows (k
    times this path's FLOPs), and this path measured faster at every size tried: X=8, k=2,
    E=256, F=512, dense / ragged time 0.40 at T=8 and 0.44 at T=512 in f32, 0.48 and 0.45
    in bf16 (medians of 7 back-to-back rounds on a contended 2-core CPU).
`DISPATCH` picks by platform: dense on CPU, ragged elsewhere (not measured there yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(h, w_router, k: int, normalize: bool):
    """Router: h [T, E] f32, w_router [E, X] -> (weights [T, k] f32, experts [T, k] i32).

    A softmax over all X experts' logits, the k most probable (exact ties: the lower expert
    index first; HF's torch.topk breaks them in an order of its own), renormalised to sum
    to 1 with `normalize` (Qwen's norm_topk_prob; Mixtral's softmax over its top-k logits
    is the same numbers)."""
    logits = jnp.dot(h.astype(w_router.dtype), w_router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


DISPATCH = {"cpu": "dense"}  # platform -> dispatch; others: "ragged"


def dispatch_for(platform: str) -> str:
    """The experts' dispatch on a platform ("cpu", "gpu", "tpu")."""
    return DISPATCH.get(platform, "ragged")


def experts_mlp(h, weights, experts, w_gate_up, w_down, dispatch: str | None = None):
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]), each expert silu(h @ gate) * (h @ up)
    @ down. h [T, E] f32, weights / experts [T, k], w_gate_up [X, E, 2, F], w_down [X, F, E]
    -> [T, E] f32 (accumulated in f32; activations cast to the weights' dtype). `dispatch`:
    "ragged" or "dense" (see the module's docstring); None: JAX's default backend's."""
    dispatch = dispatch or dispatch_for(jax.default_backend())
    if dispatch not in ("ragged", "dense"):
        raise ValueError(f"MoE dispatch {dispatch!r} is not one of 'ragged', 'dense'")
    fn = _ragged if dispatch == "ragged" else _dense
    return fn(h, weights, experts, w_gate_up, w_down)


def _dense(h, weights, experts, w_gate_up, w_down):
    """Every expert on every token; the products weighted by gates [T, X] (zero where an
    expert is not one of a token's k)."""
    t, x = h.shape[0], w_gate_up.shape[0]
    gates = jnp.zeros((t, x), jnp.float32).at[jnp.arange(t)[:, None], experts].add(weights)
    gate_up = jnp.einsum("td,xdgf->txgf", h.astype(w_gate_up.dtype), w_gate_up,
                         preferred_element_type=jnp.float32)  # [T, X, 2, F]
    act = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :] * gates[..., None]  # [T, X, F]
    # Gated first, so the sum over experts is the down projection's own contraction. (XLA's
    # CPU backend has no bf16 x bf16 -> f32 batched dot "txf,xfd->txd" inside the step's scan.)
    return jnp.einsum("txf,xfd->td", act.astype(w_down.dtype), w_down,
                      preferred_element_type=jnp.float32)


def _ragged(h, weights, experts, w_gate_up, w_down):
    """The pairs sorted by expert (stable: a token's pairs keep their order) make X segments;
    `ragged_dot` runs each through its expert; the products go back to their (token, slot)
    places and are summed over the k slots."""
    t, k = experts.shape
    x, d = w_gate_up.shape[0], w_gate_up.shape[1]
    flat = experts.reshape(-1)  # [T*k], pair i is token i // k's slot i % k
    order = jnp.argsort(flat, stable=True)  # [T*k] pairs in expert order
    sizes = jnp.zeros((x,), jnp.int32).at[flat].add(1)  # [X] tokens per expert
    rows = h[order // k].astype(w_gate_up.dtype)  # [T*k, E]
    gate_up = jax.lax.ragged_dot(rows, w_gate_up.reshape(x, d, -1), sizes,
                                 preferred_element_type=jnp.float32)  # [T*k, 2F]
    f = gate_up.shape[-1] // 2
    act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]  # [T*k, F]
    out = jax.lax.ragged_dot(act.astype(w_down.dtype), w_down, sizes,
                             preferred_element_type=jnp.float32)  # [T*k, E]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # [T, k, E]
    return jnp.einsum("tk,tkd->td", weights, unsorted)
