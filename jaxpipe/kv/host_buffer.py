"""The host KV tier: KV caches of sequences that are not in a device slot.

Finished prefills park their KV here until the engine switches to decode (Seesaw's tiered KV
buffering); preempted sequences park here until a slot frees. One small object owned by the
engine, with explicit operations:

  swap_out(seq, caches, slot, length)  device slot -> host, asynchronous (JAX dispatches the
                                       copies and returns; the next prefill overlaps them)
  Prefetcher.request(seq)              host -> device on a background thread, into staging
                                       buffers in the *decode* layout's shardings
  insert(caches, slot, staged)         staged KV -> a free device slot (a small donated update)

Per sequence and layer the host keeps `[kv_heads, tokens, head_dim]` for K and V (HND: each
(sequence, head) contiguous, and a TP shard of heads is a contiguous block), in the
`pinned_host` memory kind where the backend has it. KV is written in the shardings of the
layout that produced it (prefill) and read back in the shardings of the layout that consumes
it (decode): the re-shard happens on the way through the host. Lengths are rounded up to a
bucket so that the extract/insert programs compile once per bucket; capacity is counted in
those bucketed tokens, which is what the host memory really holds.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import jax

from jaxpipe.kv.device_cache import KVCache

HOST_KINDS = ("pinned_host", "unpinned_host")


@dataclass
class HostEntry:
    """One sequence's KV on the host: per layer (k, v), each [Hkv, T, D], T = bucketed."""

    tokens: int  # real KV positions
    padded: int  # bucketed positions held (what capacity counts)
    layers: list[tuple[jax.Array, jax.Array]] = field(default_factory=list)


@partial(jax.jit, static_argnames="length")
def _extract(cache: KVCache, slot, *, length: int):
    """cache [N, Hkv, S, D] -> (k, v) [Hkv, length, D] of slot `slot`."""
    k = jax.lax.dynamic_slice_in_dim(cache.k[slot], 0, length, axis=1)
    v = jax.lax.dynamic_slice_in_dim(cache.v[slot], 0, length, axis=1)
    return k, v


@partial(jax.jit, donate_argnames="cache")
def _insert(cache: KVCache, slot, k, v):
    """Write (k, v) [Hkv, T, D] into positions 0..T-1 of `slot` (cache donated)."""
    return KVCache(jax.lax.dynamic_update_slice(cache.k, k[None], (slot, 0, 0, 0)),
                   jax.lax.dynamic_update_slice(cache.v, v[None], (slot, 0, 0, 0)))


class HostKVBuffer:
    """Capacity-bounded host store of sequences' KV, keyed by request id."""

    def __init__(self, capacity_tokens: int, bucket, memory_kind: str | None = None):
        """`bucket(n)` rounds a length up to its stored size (<= the cache's seq length)."""
        if capacity_tokens < 0:
            raise ValueError(f"host KV capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self.bucket = bucket
        self.memory_kind = memory_kind or host_memory_kind()
        self.entries: dict[str, HostEntry] = {}
        self.used = 0  # bucketed tokens held
        self.events: list[tuple[float, str, str]] = []  # (time, "out"|"in"|"drop", id)
        self.bytes_out = self.bytes_in = 0
        self._lock = threading.Lock()

    def fits(self, tokens: int) -> bool:
        return self.used + self.bucket(tokens) <= self.capacity

    def swap_out(self, seq_id: str, caches, slot: int, tokens: int) -> None:
        """Copy positions 0..tokens-1 of `slot` from every layer's cache to the host."""
        padded = self.bucket(tokens)
        if seq_id in self.entries:
            raise KeyError(f"{seq_id} is already in the host KV tier")
        if self.used + padded > self.capacity:
            raise MemoryError(f"host KV tier full: {self.used} + {padded} > {self.capacity} "
                              f"tokens")
        entry = HostEntry(tokens, padded)
        for cache in caches:
            k, v = _extract(cache, slot, length=padded)
            entry.layers.append((self._to_host(k), self._to_host(v)))
            self.bytes_out += k.nbytes + v.nbytes
        with self._lock:
            self.entries[seq_id] = entry
            self.used += padded
            self.events.append((time.perf_counter(), "out", seq_id))

    def pop(self, seq_id: str) -> HostEntry:
        """Remove and return a sequence's entry (its host memory is freed with it)."""
        with self._lock:
            entry = self.entries.pop(seq_id)
            self.used -= entry.padded
            return entry

    def drop(self, seq_id: str) -> None:
        if seq_id in self.entries:
            self.pop(seq_id)
            self.events.append((time.perf_counter(), "drop", seq_id))

    def _to_host(self, x: jax.Array) -> jax.Array:
        if self.memory_kind is None:
            return x
        return jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind))


def host_memory_kind() -> str | None:
    """The first host memory kind the default device offers (None: keep KV where it is)."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


def insert(caches: list, slot: int, staged: list[tuple[jax.Array, jax.Array]]) -> None:
    """Write a staged sequence's per-layer (k, v) into `slot` of `caches` (a list, in place)."""
    for i, (k, v) in enumerate(staged):
        caches[i] = _insert(caches[i], slot, k, v)


class Prefetcher:
    """A thread that moves requested sequences host -> device while decode runs.

    `request(id, shardings)` queues a sequence; the thread pops its host entry, device_puts each
    layer's (k, v) to `shardings[layer]` (the decode layout) and waits for the copy, then the
    sequence shows up in `ready()`. The caller inserts ready sequences into free slots between
    decode steps (device buffers are only ever mutated by the caller's thread)."""

    def __init__(self, host: HostKVBuffer):
        self.host = host
        self._todo: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self.pending = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="jaxpipe-prefetch", daemon=True)
        self._thread.start()

    def request(self, seq_id: str, shardings: list | None = None) -> None:
        self.pending += 1
        self._todo.put((seq_id, shardings))

    def ready(self, block: bool = False) -> list[tuple[str, int, list]]:
        """(id, tokens, per-layer staged (k, v)) of every sequence delivered so far."""
        out = []
        if block and self.pending:
            out.append(self._ready.get())
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        for item in out:
            if isinstance(item, BaseException):
                raise item
        return out

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while (job := self._todo.get()) is not None:
            try:
                self._ready.put(self._fetch(*job))
            except BaseException as e:  # surfaced to the caller by ready()
                self._ready.put(e)

    def _fetch(self, seq_id: str, shardings):
        start = time.perf_counter()
        entry = self.host.pop(seq_id)
        staged = []
        for i, (k, v) in enumerate(entry.layers):
            dst = shardings[i] if shardings else k.sharding.with_memory_kind("device")
            staged.append((jax.device_put(k, dst), jax.device_put(v, dst)))
            self.host.bytes_in += k.nbytes + v.nbytes
        jax.block_until_ready(staged)
        self.seconds += time.perf_counter() - start
        self.host.events.append((time.perf_counter(), "in", seq_id))
        return seq_id, entry.tokens, staged
