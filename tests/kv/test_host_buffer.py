"""The host KV tier: exact round trips and a prefetcher that runs beside the caller (its
capacity is the scheduler state's, tested in tests/scheduler)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels import paged
from jaxpipe.kv import device_cache
from jaxpipe.kv.host_buffer import HostKVBuffer, Prefetcher, host_memory_kind
from jaxpipe.runtime.buckets import pow2_buckets, round_up

CFG = ModelConfig(vocab_size=97, hidden_size=40, intermediate_size=56, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=8)
SLOTS, SEQ = 5, 32
BUCKETS = pow2_buckets(4, SEQ)
# Each slot's 2 blocks of 16 positions, scattered over a pool of 13 blocks.
TABLE = np.random.default_rng(1).permutation(13)[:SLOTS * 2].reshape(SLOTS, 2).astype(np.int32)


def dense(x) -> np.ndarray:
    """A block pool [NB, Hkv, 16, D] seen per slot: [SLOTS, Hkv, SEQ, D]."""
    return np.asarray(paged.gather(x, jnp.asarray(TABLE), SEQ))


def bucket(n: int) -> int:
    return round_up(n, BUCKETS)


def swap_out(host: HostKVBuffer, seq_id: str, caches, slot: int, tokens: int) -> None:
    """What the engine does: read the slot's (bucketed) positions, keep them on the host."""
    padded = bucket(tokens)
    arrays = jax.tree.leaves(device_cache.read_blocks(caches, TABLE[slot], length=padded))
    host.put(seq_id, arrays, tokens)


def insert(caches, slot: int, staged):
    values = jax.tree.unflatten(jax.tree.structure(caches), staged)
    return device_cache.write_blocks(caches, TABLE[slot], values)


def filled_caches(dtype=jnp.float32, seed=0, kv_cache_dtype="auto") -> list:
    """A pool of 13 blocks per layer [NB, Hkv, BLOCK, D] of random values, as stored (int8:
    rows [.., D + 2] of codes and a scale)."""
    rng = np.random.default_rng(seed)
    pool = jax.ShapeDtypeStruct((13, CFG.num_kv_heads, device_cache.BLOCK, CFG.head_dim),
                                paged.storage_dtype(dtype, "cpu", kv_cache_dtype))

    def filled():
        return paged.to_storage(jnp.asarray(rng.normal(size=pool.shape)), pool)

    return [device_cache.KVCache(filled(), filled()) for _ in range(CFG.num_layers)]


@pytest.mark.parametrize("dtype,kv", [(jnp.float32, "auto"), (jnp.bfloat16, "auto"),
                                      (jnp.bfloat16, "int8")])
def test_swap_out_then_in_to_another_slot_is_exact(dtype, kv):
    """int8: the codes and scales go to the host and back as they are (byte-exact)."""
    caches = filled_caches(dtype, kv_cache_dtype=kv)
    width = CFG.head_dim + 2 if kv == "int8" else CFG.head_dim
    assert caches[0].k.shape[-1] == width
    before = [(dense(c.k), dense(c.v)) for c in caches]
    host = HostKVBuffer()
    swap_out(host, "a", caches, slot=1, tokens=11)
    held = host.entries["a"].arrays[0]
    assert held.shape == (2, 16, width)  # 11 tokens held in a bucket of 16
    assert held.dtype == caches[0].k.dtype
    if host.memory_kind:
        assert host.entries["a"].arrays[0].sharding.memory_kind == host.memory_kind
    prefetch = Prefetcher(host)
    ticket = prefetch.request("a")
    [(got, seq_id, tokens, staged)] = prefetch.ready(block=True)
    prefetch.close()
    assert (got, seq_id, tokens, host.entries) == (ticket, "a", 11, {})
    caches = insert(caches, 3, staged)
    for (k0, v0), c in zip(before, caches, strict=True):
        np.testing.assert_array_equal(dense(c.k)[3, :, :11], k0[1, :, :11])
        np.testing.assert_array_equal(dense(c.v)[3, :, :11], v0[1, :, :11])
        np.testing.assert_array_equal(dense(c.k)[[0, 1, 2, 4]], k0[[0, 1, 2, 4]])


def test_the_prefetcher_delivers_while_the_caller_keeps_working():
    caches = filled_caches()
    host = HostKVBuffer()
    for i in range(4):
        swap_out(host, f"s{i}", caches, i, 20)
    prefetch = Prefetcher(host)
    gate = threading.Event()
    real_fetch = prefetch._fetch

    def fetch_after_gate(*args):
        gate.wait(5)  # deliveries wait for the caller's first "decode step"
        return real_fetch(*args)

    prefetch._fetch = fetch_after_gate
    for i in range(4):
        prefetch.request(f"s{i}")
    steps = []
    while prefetch.pending:
        steps.append(len(prefetch.ready()))  # one "decode step" each time round
        gate.set()
        jax.block_until_ready(jnp.ones(1000).sum())
    prefetch.close()
    assert steps[0] == 0 and sum(steps) == 4  # the caller ran before anything was delivered
    assert [e[1] for e in host.events].count("in") == 4


def test_host_memory_kind_on_cpu():
    assert host_memory_kind() in ("pinned_host", "unpinned_host")


def test_a_sequence_dropped_before_its_fetch_is_delivered_empty():
    host = HostKVBuffer()
    swap_out(host, "a", filled_caches(), 0, 8)
    host.drop("a")
    prefetch = Prefetcher(host)
    prefetch.request("a")
    [(_, seq_id, tokens, staged)] = prefetch.ready(block=True)
    prefetch.close()
    assert (seq_id, tokens, staged, host.entries) == ("a", 0, None, {})


def test_a_request_cancelled_before_its_turn_leaves_the_host_entry():
    """Cancelled while queued: the thread never pops the entry (a later request for the same
    id, reused, finds its own) and nothing is handed out or kept."""
    host = HostKVBuffer()
    swap_out(host, "a", filled_caches(), 0, 8)
    prefetch = Prefetcher(host)
    gate = threading.Event()
    real_fetch = prefetch._fetch
    prefetch._fetch = lambda *args: (gate.wait(5), real_fetch(*args))[1]
    prefetch.cancel(prefetch.request("a"))
    gate.set()
    prefetch.close()  # the thread has run the job when it joins
    assert prefetch.pending == 0 and prefetch.staged == 0 and prefetch.ready() == []
    assert "a" in host.entries
