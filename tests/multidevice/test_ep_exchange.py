"""The two expert-parallel exchanges of `jaxpipe_bench/ep_exchange.py` (the engine's psum of
replicated tokens, and an all-to-all exchange of token-split rows) against a float64 NumPy
MoE layer, at tiny prime-sized shapes on ep=2, 4 and 8 (f32 weights)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpipe_bench import ep_exchange

# X=8 experts, top-3, E=11, F=7: prime sizes, so a swapped axis fails loudly
X, K, E, F = 8, 3, 11, 7


def reference_moe(h, router, gate_up, down, k: int) -> np.ndarray:
    """sum over each token's top-k experts (softmax over all X, renormalised over the k) of
    weight * silu(h @ gate) * (h @ up) @ down, in float64."""
    h, router, gate_up, down = (np.asarray(a, np.float64) for a in (h, router, gate_up, down))
    logits = h @ router  # [T, X]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :k]  # [T, k]
    weights = np.take_along_axis(probs, top, -1)
    weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            x = top[t, j]
            g, u = h[t] @ gate_up[x, :, 0], h[t] @ gate_up[x, :, 1]  # [F]
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g))) * u) @ down[x]
    return out


@pytest.mark.parametrize("ep, tokens", [(2, 6), (4, 12), (8, 16)])
def test_psum_and_all_to_all_equal_the_float64_layer(ep, tokens):
    mesh = ep_exchange.ep_mesh(ep)
    args = ep_exchange.layer_inputs(tokens, X, E, F, seed=ep, dtype=np.float32)
    want = reference_moe(*args, K)
    engine = np.asarray(ep_exchange.psum_layer(mesh, K)(*args))
    got, dropped = ep_exchange.a2a_layer(mesh, K)(*args)
    np.testing.assert_allclose(engine, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert int(dropped) == 0


def test_a_small_capacity_drops_pairs_and_counts_them():
    """One row per (source, destination) buffer: 16 tokens x 3 experts over ep=4 cannot fit
    (each device sends 12 pairs into 4 slots); dropped pairs add nothing."""
    mesh = ep_exchange.ep_mesh(4)
    args = ep_exchange.layer_inputs(16, X, E, F, seed=1, dtype=np.float32)
    got, dropped = ep_exchange.a2a_layer(mesh, K, capacity=1)(*args)
    assert int(dropped) >= 16 * K - 4 * 4
    assert not np.allclose(np.asarray(got), reference_moe(*args, K), atol=1e-3)


def test_ep_beyond_the_devices_fails_naming_it():
    with pytest.raises(ValueError, match="ep=9 needs 1..8 devices"):
        ep_exchange.ep_mesh(9)
