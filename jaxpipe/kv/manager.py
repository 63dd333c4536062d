"""Where each sequence's KV is: device blocks, the host tier, or on its way between them.

The scheduler decides *that* a sequence moves, and its device ledger is the one of the
pool's blocks and slots (`SeqInfo.blocks`, `SeqInfo.slot`: only the ledger gives them out);
this object moves the bytes for the engine: between the pool, the host KV tier
(`HostKVBuffer`) and the prefetcher thread that brings sequences back.

  swap_out(seq)        its blocks -> host: queued, a copy (the state drops its references
                       and slot when it records the move; blocks others share stay theirs)
  flush()              read every queued swap-out out of the pool (copies dispatched
                       asynchronously); before anything else touches the pool
  swap_in(seq)         ask the prefetcher for the KV (returns at once); it goes into the
                       slot and blocks the state gave when it recorded the swap-in
  deliver(block)       insert whatever the prefetcher has staged; the ids now decodable
  drop(seq)            forget its KV wherever it is (finished, aborted, recompute): a
                       swap-in on its way is cancelled, its staged copy freed at once
  copy_blocks(copies)  forked samples' copies on write, device block to device block
  await_blocks(blocks) insert the swap-ins on their way into any of these blocks now (a
                       sample forked as its parent came back reads the parent's blocks)
  move_blocks(moves)   the prefix cache's host-tier moves, as the state recorded them
                       (`HostLedger.take_moves`): evicted blocks read out into a host
                       group (`Spill`), a group's block copied into a device block (`Fetch`),
                       a group freed (`Forget`); groups are host entries keyed ("prefix", g)

A sequence swapped in is not decodable until `deliver` has inserted it: the engine decodes the
ready ones and lets the rest catch up, which is how swap-in overlaps decode.
"""

from __future__ import annotations

import time

from jaxpipe.kernels.paged import OUT_OF_RANGE
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.kv.host_buffer import HostKVBuffer, Prefetcher, stage
from jaxpipe.scheduler import Sequence
from jaxpipe.scheduler.host_prefix import Fetch, Move, Spill


class KVManager:
    """The host tier and the transfers between it and the device pool, for one runner."""

    def __init__(self, runner, host_tier: bool, on_insert=lambda seq: None, mirror=None):
        """`host_tier`: whether the engine has one (the `SchedulerState` counts its tokens).
        `on_insert(seq)` runs after a swapped-in sequence's KV is in its blocks (per-slot
        state to rebuild). `mirror(name, *args)`: several processes (distributed.py): each
        move is sent to the followers first ("swap_out", "swap_in", "drop"; the prefix
        cache's groups by "swap_out", "prefix_fetch" and "drop"), and swap-ins run on this
        thread (every process must issue its transfers in the same order)."""
        self.runner = runner
        self.on_insert = on_insert
        self.mirror = mirror
        self.host = HostKVBuffer()
        self.prefetcher = Prefetcher(self.host) if host_tier and mirror is None else None
        self._incoming: dict[str, tuple[Sequence, int]] = {}  # swap-in requested: its ticket
        self._outgoing: dict[str, tuple[list[int], int]] = {}  # swap-out queued: blocks, tokens
        self.swap_seconds = 0.0  # this thread's time in swap dispatch, inserts and waits
        self.prefix_bytes_out = self.prefix_bytes_in = 0  # the prefix cache's host copies

    def decodable(self, seq: Sequence) -> bool:
        """Whether `seq` is in the device store with its KV in its blocks (not still being
        swapped in)."""
        return seq.slot is not None and seq.request_id not in self._incoming

    def swap_out(self, seq: Sequence, tokens: int) -> None:
        """Queue KV positions 0..tokens-1 of `seq` for the host tier. The state frees its
        blocks and slot when it records the move; `flush` reads them before anything writes
        the pool again. Queued, because the step that writes a finished prefill's KV
        has only just been dispatched: the engine flushes when that step is done, right
        before the next one. A swap-in still bringing any of its blocks (its own, or its
        parent's that it shares) lands first."""
        self.await_blocks(seq.blocks)
        self._outgoing[seq.request_id] = (list(seq.blocks), tokens)

    @property
    def outgoing(self) -> int:
        """Swap-outs queued and not read out yet."""
        return len(self._outgoing)

    def flush(self) -> None:
        """Read every queued swap-out out of the pool into the host tier (the copies are
        dispatched; they run while the next steps do)."""
        if not self._outgoing:
            return
        start = time.perf_counter()
        for seq_id, (blocks, tokens) in self._outgoing.items():
            if self.mirror is not None:
                self.mirror("swap_out", seq_id, blocks, tokens)
            arrays = self.runner.kv_extract(blocks, tokens)
            self.host.put(seq_id, arrays, tokens)
        self._outgoing.clear()
        self.swap_seconds += time.perf_counter() - start

    def swap_in(self, seq: Sequence) -> None:
        """The prefetcher bringing `seq`'s KV into the current layout's shards, for the slot
        and blocks the state gave it when it recorded the swap-in; `deliver` inserts it."""
        self.flush()
        if seq.request_id not in self.host.entries:
            raise KeyError(f"swap-in of {seq.request_id!r}, which the host KV tier does not hold")
        if self.mirror is not None:
            self._swap_in_here(seq)
            return
        ticket = self.prefetcher.request(seq.request_id, self.runner.kv_staging())
        self._incoming[seq.request_id] = (seq, ticket)

    def _swap_in_here(self, seq: Sequence) -> None:
        """Swap `seq` in on this thread (several processes: no prefetcher)."""
        start = time.perf_counter()
        self.mirror("swap_in", seq.request_id, list(seq.blocks))
        _, staged = stage(self.host, seq.request_id, self.runner.kv_staging())
        self.runner.kv_insert(seq.blocks, staged)
        self.swap_seconds += time.perf_counter() - start
        self.on_insert(seq)

    def deliver(self, block: bool = False) -> list[Sequence]:
        """Insert every staged swap-in into its slot (`block`: wait for at least one);
        returns the sequences inserted (each also passed to `on_insert`)."""
        if self.prefetcher is None or not self.prefetcher.pending:
            return []
        self.flush()  # queued reads of freed blocks come before writes into them
        start = time.perf_counter()
        done = []
        for ticket, seq_id, _, staged in self.prefetcher.ready(block=block):
            seq, asked = self._incoming.pop(seq_id)
            if staged is None or asked != ticket:
                raise RuntimeError(f"swap-in of {seq_id!r}: the prefetcher staged ticket "
                                   f"{ticket} with {'no' if staged is None else 'a'} copy, "
                                   f"ticket {asked} was asked for")
            self.runner.kv_insert(seq.blocks, staged)
            self.on_insert(seq)
            done.append(seq)
        self.swap_seconds += time.perf_counter() - start
        return done

    def drop(self, seq: Sequence) -> None:
        """Forget `seq`'s host KV, queued swap-out and pending swap-in, staged or not (the
        state frees its blocks and slot when it records the finish or preemption)."""
        incoming = self._incoming.pop(seq.request_id, None)
        if incoming is not None:
            self.prefetcher.cancel(incoming[1])
        self._outgoing.pop(seq.request_id, None)
        if self.mirror is not None and seq.request_id in self.host.entries:
            self.mirror("drop", seq.request_id)
        self.host.drop(seq.request_id)

    def move_blocks(self, moves: list[Move]) -> None:
        """Carry out the prefix cache's host-tier moves in order (after `flush`: a queued
        swap-out may read a block that a copy back writes). Dispatched, not waited for: a
        copy back runs on the device before the step that reads it and overlaps the step in
        flight, as a swap-out's reads do."""
        if not moves:
            return
        start = time.perf_counter()
        for move in moves:
            key = ("prefix", move.group)
            if isinstance(move, Spill):
                self._spill(key, list(move.blocks))
            elif isinstance(move, Fetch):
                self._fetch(key, move.index, move.block)
            else:
                if self.mirror is not None:
                    self.mirror("drop", key)
                self.host.drop(key)
        self.swap_seconds += time.perf_counter() - start

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) device block: a forked sample's copy on write of
        its prompt's last, partly filled block (dispatched, not waited for; a source still
        being swapped in is inserted first). Several processes repeat it as a prefix
        group's read-out, copy back and drop."""
        self.await_blocks(source for source, _ in copies)
        for source, copy in copies:
            if self.mirror is not None:
                key = ("copy", source, copy)
                self.mirror("swap_out", key, [source], BLOCK)
                self.mirror("prefix_fetch", key, [copy])
                self.mirror("drop", key)
            self.runner.kv_insert([copy], self.runner.kv_extract([source], BLOCK))

    def await_blocks(self, blocks) -> None:
        """Insert now every swap-in on its way into one of `blocks` (waiting for the
        prefetcher): samples forked from a sequence as it came back from the host tier
        share its blocks, and their copies and first rows read them."""
        if not self._incoming:
            return
        wanted = set(blocks) - {OUT_OF_RANGE}  # (entries behind a window: no block)
        for seq, _ in list(self._incoming.values()):
            if wanted.intersection(seq.blocks):
                self._settle(seq)

    def _spill(self, key: tuple, blocks: list[int]) -> None:
        """Evicted device `blocks` -> a new host group (one swap chunk's extract)."""
        tokens = len(blocks) * BLOCK
        if self.mirror is not None:
            self.mirror("swap_out", key, blocks, tokens)
        arrays = self.runner.kv_extract(blocks, tokens)
        self.host.put(key, arrays, tokens, swap=False)
        self.prefix_bytes_out += sum(a.nbytes for a in arrays)

    def _fetch(self, key: tuple, index: int, block: int) -> None:
        """Block `index` of a host group -> device `block` (the group's other places are
        out of range: their writes are dropped); the host copy stays."""
        ids = [OUT_OF_RANGE] * index + [block]
        if self.mirror is not None:
            self.mirror("prefix_fetch", key, ids)
        arrays = self.host.entries[key].arrays
        self.runner.kv_insert(ids, arrays)
        chunk = sum(a.nbytes for a in arrays[:2])  # K and V of the group's chunk
        self.prefix_bytes_in += chunk * BLOCK // self.runner.kv_chunk

    @property
    def pending(self) -> int:
        """Swap-ins requested and not inserted yet."""
        return len(self._incoming)

    def close(self) -> None:
        """Stop the prefetcher and free the host tier's entries."""
        self._outgoing.clear()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for seq_id in list(self.host.entries):
            self.host.drop(seq_id)

    def _settle(self, seq: Sequence) -> None:
        """Wait until `seq`'s own swap-in (if any) has arrived in its slot."""
        while seq.request_id in self._incoming:
            self.deliver(block=True)
