"""The host KV tier: KV caches of sequences that are not in a device slot.

Finished prefills park their KV here until the engine switches to decode (Seesaw's tiered KV
buffering); preempted sequences park here until a slot frees. One small object owned by the
engine, with explicit operations:

  put(id, arrays, tokens)           one sequence's KV, just read out of its device blocks by
                                    the runner (`Runner.kv_extract`), copied to host memory
                                    asynchronously (JAX dispatches the copies and returns; the
                                    next prefill overlaps them)
  Prefetcher.request(id, shardings) host -> device on a background thread, straight into the
                                    shardings of the layout that will read it (decode)
  Runner.kv_insert(blocks, staged)  staged KV -> the device KV blocks the sequence was given
                                    (a small donated update; `KVManager` calls it)

Per sequence the host keeps K and V in fixed-size chunks of positions (`Runner.kv_chunk`),
`[K0, V0, K1, V1, ...]`, each `[layer, kv_head, token, head_dim]` (HND: each (sequence, head)
contiguous, and a TP shard of heads is a contiguous block), in the `pinned_host` memory kind
where the backend has it. KV is written in the shardings of the layout that produced it
(prefill) and read back in the shardings of the layout that consumes it (decode): the re-shard
happens on the way through the host. Lengths are rounded up to whole chunks, so the copy
programs compile once per layout. This buffer stores and loads bytes and counts no capacity:
the scheduler state charges the tier each sequence's rounded tokens (`HostLedger.size`,
what the host memory really holds) and refuses a move that would overfill it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import jax

HOST_KINDS = ("pinned_host", "unpinned_host")
KEEP_EVENTS = 100_000  # swap events kept (a long-running server makes one per move)


@dataclass
class HostEntry:
    """One sequence's KV on the host, as the runner extracted it (see the module docstring)."""

    tokens: int  # real KV positions (the arrays hold them rounded up to whole chunks)
    arrays: list[jax.Array] = field(default_factory=list)


class HostKVBuffer:
    """Host store of sequences' KV, keyed by request id (its capacity is the scheduler's)."""

    def __init__(self, memory_kind: str | None = None):
        self.memory_kind = memory_kind or host_memory_kind()
        self.entries: dict[str, HostEntry] = {}
        # (time, "out"|"in"|"drop", id) of the newest moves, for debugging and the tests
        self.events: deque[tuple[float, str, str]] = deque(maxlen=KEEP_EVENTS)
        self.bytes_out = self.bytes_in = 0
        self._lock = threading.Lock()

    def put(self, seq_id: str, arrays: list[jax.Array], tokens: int, swap: bool = True) -> None:
        """Keep a sequence's extracted KV (`tokens` real positions). `swap`: count it as a
        swap-out (False: a group of the prefix cache's blocks, which the KV manager counts)."""
        if seq_id in self.entries:
            raise KeyError(f"{seq_id} is already in the host KV tier")
        entry = HostEntry(tokens, [self._to_host(a) for a in arrays])
        with self._lock:
            self.entries[seq_id] = entry
            if swap:
                self.bytes_out += sum(a.nbytes for a in arrays)
                self.events.append((time.perf_counter(), "out", seq_id))

    def pop(self, seq_id: str) -> HostEntry:
        """Remove and return a sequence's entry (its host memory is freed with it)."""
        with self._lock:
            return self.entries.pop(seq_id)

    def arrived(self, seq_id: str, nbytes: int) -> None:
        """Count a popped entry's `nbytes` as swapped in (called by the prefetcher thread)."""
        with self._lock:
            self.bytes_in += nbytes
            self.events.append((time.perf_counter(), "in", seq_id))

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


class Prefetcher:
    """A thread that moves requested sequences host -> device while decode runs.

    `request(id, shardings)` queues a sequence and returns its ticket; the thread pops its
    host entry, device_puts each chunk's K and V to the pair of shardings given (the decode
    layout's, from `Runner.kv_staging`) and waits for the copy, then the ticket shows up in
    `ready()`. The caller inserts ready sequences into free slots between decode steps
    (device buffers are only ever mutated by the caller's thread). `cancel(ticket)` forgets
    a request (its sequence was aborted): whether it is queued, being staged or staged, its
    staged copy is never kept, and its host entry is not popped if it was not yet (a later
    request for the same id, after the id was freed and reused, gets its own)."""

    def __init__(self, host: HostKVBuffer):
        self.host = host
        self._todo: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._staged: dict[int, tuple] = {}  # ticket -> (id, tokens, staged) | exception
        self._cancelled: set[int] = set()  # requested, then cancelled before it was staged
        self._tickets = 0
        self.pending = 0  # requested, neither handed out by `ready` nor cancelled
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="jaxpipe-prefetch", daemon=True)
        self._thread.start()

    def request(self, seq_id: str, shardings: list | None = None) -> int:
        """Queue `seq_id`'s host entry for staging; returns its ticket."""
        with self._lock:
            ticket, self._tickets = self._tickets, self._tickets + 1
            self.pending += 1
        self._todo.put((ticket, seq_id, shardings))
        return ticket

    def cancel(self, ticket: int) -> None:
        """Forget a request not handed out yet: its staged copy (if any) is freed now, or
        never made or kept."""
        with self._lock:
            if self._staged.pop(ticket, None) is None:
                self._cancelled.add(ticket)
            self.pending -= 1

    @property
    def staged(self) -> int:
        """Requests staged on the device and not handed out yet."""
        return len(self._staged)

    def ready(self, block: bool = False) -> list[tuple[int, str, int, list]]:
        """(ticket, id, tokens, staged arrays) of every request staged so far; `block`: wait
        for at least one if any is pending."""
        with self._lock:
            if block:
                self._lock.wait_for(lambda: self._staged or not self.pending)
            out = list(self._staged.values())
            self._staged.clear()
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
            ticket, seq_id, shardings = job
            try:
                result = self._fetch(ticket, seq_id, shardings)
            except BaseException as e:  # surfaced to the caller by ready()
                result = e
            with self._lock:
                if ticket in self._cancelled:
                    self._cancelled.discard(ticket)  # cancelled while it was staged: dropped
                else:
                    self._staged[ticket] = result
                    self._lock.notify_all()

    def _fetch(self, ticket: int, seq_id: str, shardings):
        """Stage `seq_id`'s entry for `ticket`: (ticket, id, tokens, staged arrays); staged
        None if the request was cancelled or the entry dropped (aborted) before its turn."""
        start = time.perf_counter()
        with self._lock:  # a cancel either comes first (nothing popped) or finds it popped
            entry = None if ticket in self._cancelled else self.host.entries.get(seq_id)
            if entry is not None:
                self.host.pop(seq_id)
        if entry is None:
            return ticket, seq_id, 0, None
        staged = stage_entry(self.host, seq_id, entry, shardings)
        self.seconds += time.perf_counter() - start
        return ticket, seq_id, entry.tokens, staged


def stage(host: HostKVBuffer, seq_id: str, shardings: list | None) -> tuple[int, list]:
    """Pop `seq_id`'s entry (KeyError if the tier does not hold it) and `stage_entry` it.
    Returns (real tokens, staged arrays)."""
    entry = host.pop(seq_id)
    return entry.tokens, stage_entry(host, seq_id, entry, shardings)


def stage_entry(host: HostKVBuffer, seq_id: str, entry: HostEntry, shardings: list | None
                ) -> list:
    """Put a popped entry's chunks on the device, K's in shardings[0] and V's in shardings[1]
    (None: the shardings they were read in); waits for the copies. Returns the staged
    arrays."""
    staged = []
    for i, a in enumerate(entry.arrays):
        dst = shardings[i % 2] if shardings else a.sharding.with_memory_kind("device")
        staged.append(jax.device_put(a, dst))
    jax.block_until_ready(staged)
    host.arrived(seq_id, sum(a.nbytes for a in entry.arrays))
    return staged
