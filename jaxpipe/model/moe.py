"""The mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): a router picks each token's
top-k experts, each expert is a gated MLP, their outputs are summed weighted by the router's
probabilities. Every token reaches all k of its experts (nothing is dropped), and no shape
depends on the routing.

Three paths, the same numbers (`experts_mlp`):
  - "ragged" (sorted segments): the T*k (token, expert) pairs sorted by expert, so each
    expert's tokens are one contiguous segment, and `jax.lax.ragged_dot` multiplies each
    segment by its expert's weights (group sizes are data, shapes static: [T*k, ...]). On
    GPU and TPU XLA lowers ragged_dot to a grouped matmul: k/X of the dense FLOPs. On CPU
    JAX lowers it to a dense batched dot over X masked copies of the T*k rows: k times the
    dense path's FLOPs.
  - "dense": every expert on every token, weighted by the zero-padded gates [T, X]: X/k
    times the useful FLOPs, and every expert's weights read.
  - "grouped" (CPU, bf16 weights, E and F even): the same sorted segments through the C++
    grouped kernel (`kernels/matmul.py: grouped_matmul`): each expert's rows times its own
    weight only (k/X of the dense FLOPs; an expert no token chose is not read), the gate
    fused into the first product, on the bf16 matmul kernel's path code.
`EXPERTS_PATH` picks by platform when the caller names none: ragged off CPU (not measured there
yet); "measured" on CPU, which is dense when called directly, while the engine's step
passes a chooser (`runtime/kernel_choice.experts_path`, called at trace time): grouped or
dense, whichever timed faster on these expert shapes at the nearest token count at or above
the step's (once per machine, cached), dense where the grouped kernel cannot run. Medians of
15 interleaved rounds (3 for E=1024) on the 2-core AMD EPYC (avx2 + FMA only, no avx512),
shared with other work (load ~14, so rough), bf16 weights, `scripts/bench_moe_kernel.py`,
dense / ragged / grouped ms:
    X=8, k=2, E=256, F=512:   T=8: 3.7 / 5.8 / 1.3;  T=64: 48 / 73 / 9.8;  T=512: 338 / 550 / 70
    X=64, k=8, E=256, F=512:  T=8: 272 / 555 / 33;   T=64: 638 / - / 97;   T=512: 3504 / - / 390
    X=64, k=8, E=1024, F=768: T=8: 2825 / 4827 / 277; T=64: 3172 / - / 475
(- : not run, k times dense's FLOPs): grouped 2.8-10x faster than dense, ragged 1.5-2x
slower than dense, on this CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpipe.kernels import matmul
from jaxpipe.model.quantized import KINDS, QuantizedWeight

# The code dtypes of quantized experts (`model/quantized.py`): only the dense path reads them.
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)


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


EXPERTS_PATH = {"cpu": "measured"}  # platform -> how its experts run; others: "ragged"
EXPERTS_PATHS = ("ragged", "dense", "grouped")


def experts_path_for(platform: str) -> str:
    """The experts' path on a platform ("cpu", "gpu", "tpu") when none is named;
    "measured": the step's chooser decides (`runtime/kernel_choice.experts_path`)."""
    return EXPERTS_PATH.get(platform, "ragged")


def experts_mlp(h, weights, experts, w_gate_up, w_down, path: str | None = None):
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]), each expert silu(h @ gate) * (h @ up)
    @ down. h [T, E] f32, weights / experts [T, k], w_gate_up [X, E, 2, F], w_down [X, F, E]
    -> [T, E] f32 (accumulated in f32; activations cast to the weights' dtype). A choice of
    an expert id >= X (another shard's expert, `decoder.local_experts`) is skipped: it
    adds nothing and, in the sorted paths, sorts past every real segment. `path`:
    one of EXPERTS_PATHS, or a chooser `(tokens, k, w_gate_up, w_down) -> one of them` called
    at trace time; None: JAX's default backend's. The weights may be one layer of the
    stacked layers' (`kernels/matmul.StackedWeight`, the step's): the grouped kernel reads
    them in place, the other paths slice them out."""
    path = path or experts_path_for(jax.default_backend())
    if w_gate_up.dtype in QUANTIZED_DTYPES:  # quantized experts: only the dense path reads them
        path = "dense"
    elif callable(path):
        path = path(h.shape[0], experts.shape[1], w_gate_up, w_down)
    if path == "measured":  # no chooser given: the one every shape runs
        path = "dense"
    if path not in EXPERTS_PATHS:
        raise ValueError(f"MoE path {path!r} is not one of "
                         f"{', '.join(map(repr, EXPERTS_PATHS))} or a chooser")
    if path == "grouped" and not grouped_fits(w_gate_up, w_down):
        raise ValueError(f"MoE path 'grouped' needs the bf16 kernel, bf16 weights and an "
                         f"even E and F; got w_gate_up {w_gate_up.shape} {w_gate_up.dtype}")
    if path != "grouped":
        w_gate_up, w_down = _value(w_gate_up), _value(w_down)
    fn = {"ragged": _ragged, "dense": _dense, "grouped": _grouped}[path]
    return fn(h, weights, experts, w_gate_up, w_down)


def _value(w):
    """An array as itself; a layer of a stack (`StackedWeight`) as its slice (a copy)."""

    return w.value() if isinstance(w, matmul.StackedWeight) else w


def _in_place(w):
    """(w, None) for an array [G, K, N]; (the stack [L, G, K, N], the layer) for a
    `StackedWeight`: `grouped_matmul`'s w and layer, so that no slice is copied."""

    return (w.stacked(), w.layer) if isinstance(w, matmul.StackedWeight) else (w, None)


def grouped_fits(w_gate_up, w_down) -> bool:
    """Whether the grouped kernel runs these weights: bf16, E and F even (the kernel pairs
    rows of K), and the kernel built here."""

    e, f = w_gate_up.shape[1], w_down.shape[1]
    return (w_gate_up.dtype == w_down.dtype == jnp.bfloat16 and e % 2 == 0 and f % 2 == 0
            and jax.default_backend() == "cpu" and matmul.available())


def _gates(weights, experts, x: int):
    """Each token's weight for each of the x experts [T, X] (zero where an expert is not
    one of its k; ids >= X dropped)."""
    t = weights.shape[0]
    return jnp.zeros((t, x), jnp.float32).at[jnp.arange(t)[:, None], experts].add(
        weights, mode="drop")


def _dense(h, weights, experts, w_gate_up, w_down):
    """Every expert on every token; the products weighted by gates [T, X] (zero where an
    expert is not one of a token's k)."""
    if isinstance(w_gate_up, QuantizedWeight):
        return _dense_quantized(h, weights, experts, w_gate_up, w_down)
    gates = _gates(weights, experts, w_gate_up.shape[0])
    gate_up = jnp.einsum("td,xdgf->txgf", h.astype(w_gate_up.dtype), w_gate_up,
                         preferred_element_type=jnp.float32)  # [T, X, 2, F]
    act = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :] * gates[..., None]  # [T, X, F]
    # Gated first, so the sum over experts is the down projection's own contraction. (XLA's
    # CPU backend has no bf16 x bf16 -> f32 batched dot "txf,xfd->txd" inside the step's scan.)
    return jnp.einsum("txf,xfd->td", act.astype(w_down.dtype), w_down,
                      preferred_element_type=jnp.float32)


def _dense_quantized(h, weights, experts, w_gate_up: QuantizedWeight,
                     w_down: QuantizedWeight):
    """`_dense` on quantized experts (`quantization="int8"` / "fp8"), through XLA's dot of
    the kind's codes: h [T, E] quantized per token for the gate/up products, each (token,
    expert) row of the gated activations [T, X, F] per row for the down products (a row of
    an expert the token did not choose is zeros: codes 0). No grouped int8 kernel yet."""
    kind = KINDS[w_gate_up.kind]
    x, e = w_gate_up.shape[0], w_gate_up.shape[1]
    gates = _gates(weights, experts, x)
    hq, hs = kind.quantize_rows(h)  # [T, E], [T]
    acc = kind.accumulate(hq, w_gate_up.codes.reshape(x, e, -1), (((1,), (1,)), ((), ())))
    gate_up = acc.astype(jnp.float32) * w_gate_up.scale.reshape(x, -1) * hs[:, None, None]
    f = gate_up.shape[-1] // 2  # [T, X, 2F]: gate then up
    act = jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:] * gates[..., None]  # [T, X, F]
    aq, as_ = kind.quantize_rows(act)  # [T, X, F], [T, X]
    acc = kind.accumulate(aq, w_down.codes, (((2,), (1,)), ((1,), (0,))))  # [X, T, E]
    out = acc.astype(jnp.float32) * w_down.scale[:, None, :] * as_.T[..., None]
    return jnp.sum(out, axis=0)


def _grouped(h, weights, experts, w_gate_up, w_down):
    """The pairs sorted by expert, as `_ragged`'s, through the C++ grouped kernel
    (`kernels/matmul.py: grouped_matmul`): each expert's rows times its own weight only, the
    gate fused into the first product (pairs of ids >= X, sorted last past every
    segment, are not multiplied: the kernel gives zeros); then back to their places and
    summed over the k slots. Call inside `shard_map` on a sharded layout (a custom call)."""

    t, k = experts.shape
    x, d = w_gate_up.shape[0], w_gate_up.shape[1]
    flat = experts.reshape(-1)  # [T*k], pair i is token i // k's slot i % k
    order = jnp.argsort(flat, stable=True)  # [T*k] pairs in expert order
    sizes = jnp.zeros((x,), jnp.int32).at[flat].add(1, mode="drop")  # [X]; ids >= X: none
    gate_up, layer = _in_place(w_gate_up.reshape(x, d, -1))  # [(L,) X, E, 2F]
    act = matmul.grouped_matmul(h[order // k], gate_up, sizes, layer,
                                gated=True)  # [T*k, F]; the kernel rounds rows to bf16
    down, layer = _in_place(w_down)  # [(L,) X, F, E]
    out = matmul.grouped_matmul(act, down, sizes, layer)  # [T*k, E]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # [T, k, E]
    return jnp.einsum("tk,tkd->td", weights, unsorted)


def _ragged(h, weights, experts, w_gate_up, w_down):
    """The pairs sorted by expert (stable: a token's pairs keep their order) make X segments;
    `ragged_dot` runs each through its expert; the products go back to their (token, slot)
    places and are summed over the k slots."""
    t, k = experts.shape
    x, d = w_gate_up.shape[0], w_gate_up.shape[1]
    flat = experts.reshape(-1)  # [T*k], pair i is token i // k's slot i % k
    order = jnp.argsort(flat, stable=True)  # [T*k] pairs in expert order
    sizes = jnp.zeros((x,), jnp.int32).at[flat].add(1, mode="drop")  # [X]; ids >= X: none
    rows = h[order // k].astype(w_gate_up.dtype)  # [T*k, E]
    gate_up = jax.lax.ragged_dot(rows, w_gate_up.reshape(x, d, -1), sizes,
                                 preferred_element_type=jnp.float32)  # [T*k, 2F]
    f = gate_up.shape[-1] // 2
    act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]  # [T*k, F]
    out = jax.lax.ragged_dot(act.astype(w_down.dtype), w_down, sizes,
                             preferred_element_type=jnp.float32)  # [T*k, E]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # [T, k, E]
    return jnp.einsum("tk,tkd->td", weights, unsorted)
