"""Where each sequence's KV is: device blocks, the host tier, or on its way between them.

The scheduler decides *that* a sequence moves (`SchedulerState` counts tokens); this object
does the moving for the engine and keeps the physical side: which device slot (batch row)
each running sequence owns (its row of per-slot state such as penalty counts) and which
blocks of the device KV pool hold its tokens (each step sends them as block-table rows), the
host KV tier (`HostKVBuffer`) and the prefetcher thread that brings sequences back.

  allocate(seq, n)     a slot and blocks for n tokens
  grow(seq, n)         more blocks, so that n tokens fit
  swap_out(seq)        blocks -> host, dispatched asynchronously; slot and blocks free at once
  swap_in(seq)         reserve a slot and blocks, ask the prefetcher for the KV (returns at once)
  deliver(block)       insert whatever the prefetcher has staged; the ids now decodable
  drop(seq)            forget its KV wherever it is (finished, aborted, recompute)

A sequence swapped in is not decodable until `deliver` has inserted it: the engine decodes the
ready ones and lets the rest catch up, which is how swap-in overlaps decode.
"""

from __future__ import annotations

import heapq
import time

from jaxpipe.kv.device_cache import blocks_for
from jaxpipe.kv.host_buffer import HostKVBuffer, Prefetcher
from jaxpipe.scheduler import Sequence


class KVManager:
    """Device slots and blocks, the host tier and transfers between them, for one runner."""

    def __init__(self, runner, num_slots: int, host_tokens: int, host_size,
                 on_insert=lambda seq: None):
        """`host_size(tokens)`: the rounded length a sequence is kept at in the host tier
        (`SchedulerState.host_size`, so both count the same tokens). `on_insert(seq)` runs
        after a swapped-in sequence's KV is in its slot (per-slot state to rebuild)."""
        self.runner = runner
        self.on_insert = on_insert
        self.max_len = runner.max_len
        self.host = HostKVBuffer(host_tokens)
        self.host_size = host_size
        self.prefetcher = Prefetcher(self.host) if host_tokens else None
        self._free = list(range(num_slots))  # a heap: lowest slot first
        self._free_blocks = list(range(runner.num_blocks - 1, -1, -1))  # a stack
        self._blocks: dict[int, list[int]] = {}  # slot -> its blocks in position order
        self.peak_blocks = 0  # the most blocks in use at once
        self._incoming: dict[str, Sequence] = {}  # swap-in requested, not inserted yet
        self.swap_seconds = 0.0  # this thread's time in swap dispatch, inserts and waits

    # ---- slots ---------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def allocate(self, seq: Sequence, tokens: int) -> int:
        """A slot for `seq` and blocks for its first `tokens` positions; returns the slot."""
        if not self._free:
            raise RuntimeError(f"no free device KV slot for {seq.request_id}: the scheduler "
                               "admitted more sequences than there are slots")
        seq.slot = heapq.heappop(self._free)
        self._blocks[seq.slot] = []
        self.grow(seq, tokens)
        return seq.slot

    def blocks(self, seq: Sequence) -> list[int]:
        """`seq`'s blocks in position order (a copy)."""
        return list(self._blocks[seq.slot])

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give `seq` blocks until its first `tokens` positions fit."""
        owned = self._blocks[seq.slot]
        need = blocks_for(tokens) - len(owned)
        if need <= 0:
            return
        if need > len(self._free_blocks):
            raise RuntimeError(f"device KV pool exhausted: {seq.request_id} needs {need} more "
                               f"blocks, {len(self._free_blocks)} are free (the scheduler "
                               "should have preempted)")
        owned.extend(self._free_blocks.pop() for _ in range(need))
        self.peak_blocks = max(self.peak_blocks, self.runner.num_blocks - self.free_blocks)

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s slot and blocks if it holds them."""
        if seq.slot is not None:
            self._free_blocks.extend(reversed(self._blocks.pop(seq.slot)))
            heapq.heappush(self._free, seq.slot)
            seq.slot = None

    def decodable(self, seq: Sequence) -> bool:
        return seq.slot is not None and seq.request_id not in self._incoming

    # ---- moving ----------------------------------------------------------------------------

    def swap_out(self, seq: Sequence, tokens: int) -> None:
        """KV positions 0..tokens-1 of `seq` -> the host tier; frees its slot and blocks."""
        start = time.perf_counter()
        self._settle(seq)
        padded = self.host_size(tokens)
        arrays = self.runner.kv_extract(self._blocks[seq.slot], min(padded, self.max_len))
        self.host.put(seq.request_id, arrays, tokens, padded)
        self.release(seq)
        self.swap_seconds += time.perf_counter() - start

    def swap_in(self, seq: Sequence) -> None:
        """Reserve a slot and blocks for `seq` and have the prefetcher bring its KV into the
        current layout's shards; `deliver` inserts it."""
        entry = self.host.entries[seq.request_id]
        self.allocate(seq, entry.tokens)
        self._incoming[seq.request_id] = seq
        self.prefetcher.request(seq.request_id,
                                self.runner.kv_staging(min(entry.padded, self.max_len)))

    def deliver(self, block: bool = False) -> list[Sequence]:
        """Insert every staged swap-in into its slot (`block`: wait for at least one);
        returns the sequences inserted (each also passed to `on_insert`)."""
        if self.prefetcher is None or not self._incoming:
            return []
        start = time.perf_counter()
        done = []
        for seq_id, _, staged in self.prefetcher.ready(block=block):
            seq = self._incoming.pop(seq_id, None)
            if staged is not None and seq is not None and seq.slot is not None:  # else aborted
                self.runner.kv_insert(self._blocks[seq.slot], staged)
                self.on_insert(seq)
                done.append(seq)
        self.swap_seconds += time.perf_counter() - start
        return done

    def drop(self, seq: Sequence) -> None:
        """Forget `seq`'s KV wherever it is and free its slot."""
        self._incoming.pop(seq.request_id, None)  # a late delivery is then discarded
        self.host.drop(seq.request_id)
        self.release(seq)

    @property
    def pending(self) -> int:
        """Swap-ins requested and not inserted yet."""
        return len(self._incoming)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _settle(self, seq: Sequence) -> None:
        """Wait until `seq`'s own swap-in (if any) has landed in its slot."""
        while seq.request_id in self._incoming:
            self.deliver(block=True)
