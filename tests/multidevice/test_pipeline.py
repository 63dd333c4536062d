"""The SPMD pipeline against the single-device model, on a tiny model with prime-sized
dimensions (so every layout pads: identity layers, replicated KV heads, zero query heads, mlp
and vocab columns): prefill logits, the KV each stage writes, and decode steps after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from jaxpipe import pipeline, sharding
from jaxpipe.kv import device_cache
from jaxpipe.layout import Layout
from jaxpipe.model.llama import Llama

SLOTS, MAX_LEN = 8, 64
LENGTHS = np.array([16, 9, 3, 12, 1, 16, 7, 10], np.int32)
# The layouts' KV is paged: each row's 4 blocks of 16 scattered over a pool of 37 (the
# single-device reference keeps contiguous blocks).
POOL = 37
TABLE = np.random.default_rng(4).permutation(POOL)[:SLOTS * 4].reshape(SLOTS, 4).astype(np.int32)
IDENTITY = device_cache.identity_table(SLOTS, MAX_LEN)


def dense(pool, table) -> np.ndarray:
    """One layer's block pool [NB, Hkv, 16, D] seen per table row: [N, Hkv, MAX_LEN, D]."""
    return np.asarray(device_cache.gather(jnp.asarray(pool), jnp.asarray(table), MAX_LEN))
# (layout, micro-batches): deep pipelines with few and many micro-batches, hybrids, pure TP and
# the one-device plain forward.
CASES = [("pp=8", 1), ("pp=8", 8), ("pp=4,tp=2", 2), ("pp=2,tp=4", 4), ("tp=8", 1),
         ("pp=1,tp=1", 1)]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, TINY.vocab_size, (len(LENGTHS), 16)).astype(np.int32)
    return tokens * (np.arange(16)[None, :] < LENGTHS[:, None])


@pytest.fixture(scope="module")
def reference(tiny_values, prompts):
    """Single-device logits: prefill, then three greedy decode steps."""
    model = Llama(TINY, values=tiny_values)
    cache = device_cache.allocate(TINY, IDENTITY.size, jnp.float32)
    logits, cache = model.prefill(jnp.asarray(prompts), LENGTHS, IDENTITY, cache)
    prefill_k = [dense(c.k, IDENTITY) for c in cache]  # per layer [N, Hkv, S, D]
    steps, positions = [np.asarray(logits)], LENGTHS.copy()
    for _ in range(3):
        tokens = np.asarray(jnp.argmax(steps[-1], -1), np.int32)
        logits, cache = model.decode(jnp.asarray(tokens), positions, IDENTITY, cache, MAX_LEN)
        steps.append(np.asarray(logits))
        positions = positions + 1
    return steps, prefill_k


def place(values, layout: Layout):
    plan = sharding.plan_padding(TINY, [layout])
    mesh = sharding.make_mesh(layout)
    params = jax.device_put(sharding.pad_values(TINY, values, plan),
                            sharding.param_shardings(TINY, plan, layout, mesh))
    kv = sharding.kv_sharding(TINY, plan, layout, mesh, POOL)
    shape = sharding.kv_shape(TINY, plan, POOL)
    cache = device_cache.KVCache(*(jax.device_put(np.zeros(shape, np.float32), kv)
                                   for _ in range(2)))
    return plan, mesh, params, cache


@pytest.mark.parametrize("layout_text, microbatches", CASES)
def test_prefill_and_decode_match_one_device(tiny_values, prompts, reference, layout_text,
                                             microbatches):
    layout = Layout.parse(layout_text)
    plan, mesh, params, cache = place(tiny_values, layout)
    prefill = pipeline.prefill_program(TINY, layout, mesh, TINY.vocab_size, microbatches)
    logits, cache = prefill(params, cache, prompts, LENGTHS, TABLE)
    steps, ref_k = reference
    assert logits.shape == steps[0].shape
    assert np.abs(np.asarray(logits) - steps[0]).max() <= 1e-4

    # Every stage wrote its own layers' K (each KV-head replica a copy of its source head);
    # identity layers wrote zeros.
    k = np.asarray(cache.k)  # [L', NB, Hkv', 16, D]
    for j, src in enumerate(plan.index["layers"]):
        want = ref_k[src] if src >= 0 else np.zeros_like(ref_k[0])
        got = dense(k[j], TABLE)  # [N, Hkv', S, D]
        for rep, head in enumerate(plan.index["kv_heads"]):
            assert np.abs(got[:, rep] - want[:, head]).max() <= 1e-4, (j, rep)

    decode = pipeline.decode_program(TINY, layout, mesh, TINY.vocab_size,
                                     pipeline.microbatches(SLOTS, layout.pp))
    positions = LENGTHS.copy()
    for step in steps[1:]:
        tokens = np.asarray(jnp.argmax(jnp.asarray(logits), -1), np.int32)
        logits, cache = decode(params, cache, tokens, positions, positions + 1, TABLE,
                               kv_len=MAX_LEN)
        assert np.abs(np.asarray(logits) - step).max() <= 1e-4
        positions = positions + 1


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "kernel"])
def test_attend_decode_zeroes_idle_rows(kernel):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 4, 2, 16, 8)), jnp.float32)  # [L, NB, Hkv, 16, D]
    table = jnp.array([[2, 0], [1, 3], [3, 1]], jnp.int32)
    out = pipeline.attend_decode(q, kv, kv, jnp.array([20, 0, 1], jnp.int32), table, 1, 32,
                                 kernel)
    assert np.all(np.asarray(out[1]) == 0) and np.isfinite(np.asarray(out)).all()
    # One valid key: attention returns that key's value for every query head of its group
    # (row 2's position 0: layer 1, block 3, offset 0).
    np.testing.assert_allclose(out[2].reshape(2, 2, 8), np.broadcast_to(
        kv[1, 3, :, 0][:, None], (2, 2, 8)), rtol=1e-6)


def test_microbatches_divide_the_rows():
    assert pipeline.microbatches(16, 8) == 8
    assert pipeline.microbatches(12, 8) == 6
    assert pipeline.microbatches(1, 8) == 1
    assert pipeline.microbatches(7, 4) == 1
