"""The device KV store's ledger: its blocks and its slots, the only one of either.

Each device sequence holds the ids of its blocks (`SeqInfo.blocks`, in position order) and
one slot (`SeqInfo.slot`: its row of per-sequence device state, such as penalty counts),
from free lists of plain ints, so the engine sends a step exactly the blocks and slots the
scheduler charged. A sequence takes the lowest free slot when it enters the device store
(`enter`: its first prefill chunk, or a swap-in) and gives slot and blocks back when it
leaves (`leave`: swap-out, preemption, finish). Only this ledger gives out blocks (`extend`)
and slots; an executor reads `SeqInfo.blocks` and `SeqInfo.slot`, it never takes any.

The blocks are a `BlockPool` (`prefix_cache.py`): reference counts, a free list and, with
prefix caching, full blocks cached by the hash of their prefix. A block is free, cached with
no reference (evictable: it counts as free) or held; a block shared by several sequences is
charged once (`used`).

Sliding windows (`Blocks.window`: every layer attends over its last `window` keys only, as
Mistral's; 0 when any layer reads the whole context, as Gemma's global layers do: one block
table serves every layer). Every query after position p starts at p or later, so once a run
is applied the blocks before its sequences' next query's window are given back (`slide`):
each such entry becomes `FREED` (out of every pool's range: attention never reads it, a
write there is dropped), so the list stays in position order and `SeqInfo.behind` counts
them. A sequence then holds at most window / block + 1 blocks while it decodes; `peak`, not
its length, is what an admission reserves for it. A freed block that is cached goes back as
any released cached block does (to the LRU). A swapped-out sequence comes back with only the
blocks past its window (`resume`).

Invariants (`settle` checks the first; the tests check the rest): the held blocks' tokens
are within `capacity`, the device sequences within `max_seqs` slots; every block is free,
cached-unreferenced or held, and held by as many sequences as its reference count; each
device sequence has an entry per block of its `computed` positions, FREED exactly for those
before its next query's window.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from jaxpipe.scheduler.blocks import Blocks
from jaxpipe.scheduler.prefix_cache import FREED, BlockPool

if TYPE_CHECKING:
    from jaxpipe.scheduler.seq_info import SeqInfo


class DeviceLedger:
    """`capacity` tokens of device KV in `pool`'s blocks (`blocks`: their arithmetic) and
    `max_seqs` slots."""

    def __init__(self, capacity: int, max_seqs: int, blocks: Blocks, pool: BlockPool):
        if capacity < 1 or max_seqs < 1:
            raise ValueError(f"need device_kv_tokens >= 1 (got {capacity}) and "
                             f"max_device_seqs >= 1 (got {max_seqs})")
        self.capacity, self.max_seqs, self.blocks, self.pool = capacity, max_seqs, blocks, pool
        self.num_blocks = pool.num_blocks
        self._free_slots = list(range(max_seqs))  # a heap: lowest slot first
        self.peak_blocks = 0  # the most blocks held at once
        # Copies on write for forked samples, not issued yet: (source, destination) blocks,
        # both held by the copy until `take_copies` (so neither is given out before it runs).
        self._copies: list[tuple[int, int]] = []
        self.forked = self.fork_copies = 0  # samples forked sharing blocks, blocks copied

    # ---- reading: what the store holds, and what a sequence takes ----------------------------
    @property
    def free(self) -> int:
        """Tokens of KV the store can still take (its free and evictable blocks)."""
        return self.pool.num_free * self.blocks.unit

    @property
    def used(self) -> int:
        """Tokens of KV the store holds (whole blocks; a shared one once)."""
        return self.pool.num_held * self.blocks.unit

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def held(self, seq: SeqInfo) -> int:
        """Tokens of the blocks `seq` holds (those behind its window given back)."""
        return (len(seq.blocks) - seq.behind) * self.blocks.unit

    def new_blocks(self, seq: SeqInfo, end: int) -> int:
        """Blocks `seq` takes to hold positions up to `end` (what a step writing them is
        charged: none for positions in blocks it has)."""
        return max(self.blocks.count(end) - len(seq.blocks), 0)

    def growth(self, seq: SeqInfo) -> int:
        """Tokens a device sequence takes on when it writes one more KV token."""
        return self.blocks.size(seq.computed + 1) - self.blocks.size(seq.computed)

    def peak(self, seq: SeqInfo, tokens: int, chunk: int = 1) -> int:
        """The most tokens `seq` holds at once from now until its context reaches `tokens`:
        the rest of its prefill in chunks of at most `chunk`, then a token at a time. Every
        block without a window; with one, what a step reads: a first chunk from position 0
        its own blocks, any other chunk or a decode its window before it too."""
        return self._own_peak(seq, tokens, chunk) + len(seq.forks) * self.fork_size(seq, tokens)

    def fork_size(self, seq: SeqInfo, tokens: int) -> int:
        """Tokens a sample forked from `seq` holds of its own up to `tokens` (its copy of
        the prompt's last, partly filled block on; the full blocks before it are shared)."""
        return max(self.blocks.size(tokens) - self.shared_blocks(seq) * self.blocks.unit, 0)

    def shared_blocks(self, seq: SeqInfo) -> int:
        """The full blocks of `seq`'s prompt short of its last token: what a sample forked
        from it shares (it computes the last prompt token itself, for its own logits)."""
        return (seq.prompt_len - 1) // self.blocks.unit

    def _own_peak(self, seq: SeqInfo, tokens: int, chunk: int) -> int:
        blocks, full = self.blocks, self.blocks.size(tokens)
        if not blocks.window:
            return full
        spans = [blocks.span(blocks.window)]  # a decode: its window
        rest = seq.to_prefill
        if seq.computed == 0:
            spans.append(blocks.size(min(rest, chunk)))
        if seq.computed > 0 or rest > chunk:
            spans.append(blocks.span(blocks.window + min(rest, chunk) - 1))
        return min(full, max(spans))

    def need(self, seq: SeqInfo, tokens: int, chunk: int = 1) -> int:
        """Tokens `seq` takes beyond those it holds, at most, until its context reaches
        `tokens` (`peak`): an admission's reservation."""
        return max(self.peak(seq, tokens, chunk) - self.held(seq), 0)

    def resume(self, seq: SeqInfo) -> int:
        """Tokens a swapped-out `seq` takes to come back and decode one token: its blocks
        from its window's start, and a block for each of its samples that fork as it comes
        back (`comebacks`), to compute the last prompt token in."""
        first = self.blocks.first_live(seq.computed)
        own = self.blocks.size(seq.computed + 1) - first * self.blocks.unit
        return own + (self.comebacks(seq) - 1) * self.fork_size(seq, seq.prompt_len)

    def comebacks(self, seq: SeqInfo) -> int:
        """Slots a swapped-out `seq` takes when it comes back: its own, and one for each
        sample waiting to fork from it (its prefill went to the host tier), as many as the
        store has slots beside it (the rest prefill the prompt themselves); none once its
        window gave blocks back (`fork` cannot share them)."""
        if not seq.forks or self.blocks.first_live(seq.computed):
            return 1
        return 1 + min(len(seq.forks), self.max_seqs - 1)

    # ---- writing: only here are blocks and slots given out and taken back --------------------
    def enter(self, seq: SeqInfo) -> None:
        """`seq` joins the device store: it takes the lowest free slot."""
        if not self._free_slots:
            raise RuntimeError(f"device overfilled: no free slot for {seq.seq_id!r}, all "
                               f"{self.max_seqs} are held")
        seq.slot = heapq.heappop(self._free_slots)

    def extend(self, seq: SeqInfo, tokens: int) -> None:
        """Give `seq` blocks until its first `tokens` positions fit (those before its
        window's start entered as FREED: a swap-in of a windowed sequence)."""
        first, end = self.blocks.first_live(seq.computed), self.blocks.count(tokens)
        need = end - max(len(seq.blocks), first)
        if need > self.pool.num_free:
            raise RuntimeError(
                f"device KV overfilled: {seq.seq_id!r} needs {need} more blocks of "
                f"{self.blocks.unit} tokens, {self.pool.num_free} of {self.num_blocks} are "
                f"free")
        if len(seq.blocks) < first <= end:
            seq.blocks.extend([FREED] * (first - len(seq.blocks)))
            seq.behind = first
        seq.blocks.extend(self.pool.take() for _ in range(max(need, 0)))
        self.peak_blocks = max(self.peak_blocks, self.pool.num_held)

    def slide(self, seq: SeqInfo) -> None:
        """Give back `seq`'s blocks that its next query's window has moved past (none
        without a window): their entries become FREED."""
        first = min(self.blocks.first_live(seq.computed), len(seq.blocks))
        for i in range(seq.behind, first):
            self.pool.release(seq.blocks[i])
            seq.blocks[i] = FREED
        seq.behind = max(seq.behind, first)

    def leave(self, seq: SeqInfo) -> None:
        """`seq` leaves the device store: it drops its references to its blocks and gives
        back its slot. A copy on write into its blocks not issued yet is dropped (the
        engine issues the copies before it moves a sequence's KV anywhere)."""
        if self._copies:
            self._cancel_copies(set(seq.blocks))
        self.pool.drop(seq)
        seq.blocks, seq.block_hashes, seq.behind = [], [], 0
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None

    def fork(self, parent: SeqInfo, child: SeqInfo) -> bool:
        """`child`, a sample of `parent`'s request, joins the device store sharing
        `parent`'s prompt: a reference to each full block before its last prompt token, and
        a copy (on write: queued, `take_copies`) of the partly filled block that token is
        in, which the child computes again for its own logits. False (nothing taken) when
        no slot or block is free, or `parent`'s window gave blocks back already."""
        full = self.shared_blocks(parent)
        partial = (parent.prompt_len - 1) % self.blocks.unit != 0
        if parent.behind or not self._free_slots or self.pool.num_free < partial:
            return False
        self.enter(child)
        child.blocks = list(parent.blocks[:full])
        for block in child.blocks:
            self.pool.share(block)
        if partial:
            source, copy = parent.blocks[full], self.pool.take()
            self.pool.share(source)
            self.pool.share(copy)
            child.blocks.append(copy)
            self._copies.append((source, copy))
            self.fork_copies += 1
        self.forked += 1
        child.computed = child.cached_tokens = parent.prompt_len - 1
        child.block_hashes = list(parent.block_hashes[:full])
        child.hash_chain = list(parent.hash_chain[:parent.prompt_len // self.blocks.unit])
        self.peak_blocks = max(self.peak_blocks, self.pool.num_held)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copies on write, (source, destination) blocks, for the executor to
        issue now, before anything else touches the pool; their holds are dropped."""
        copies, self._copies = self._copies, []
        for source, copy in copies:
            self.pool.release(source)
            self.pool.release(copy)
        return copies

    def _cancel_copies(self, blocks: set[int]) -> None:
        for source, copy in [c for c in self._copies if c[1] in blocks]:
            self._copies.remove((source, copy))
            self.pool.release(source)
            self.pool.release(copy)

    def reset_peak(self) -> None:
        """Restart `peak_blocks` from what is held now (a stats reset)."""
        self.peak_blocks = self.pool.num_held

    def settle(self) -> None:
        """Hand the blocks the last operation evicted to the host tier (one group per swap
        chunk; `host_prefix.py`), then check that the store is not overfilled (slots cannot
        be: `enter` gives only free ones)."""
        self.pool.store_evicted()
        if self.used > self.capacity:
            raise RuntimeError(f"device KV overfilled: {self.used}/{self.capacity} tokens")
