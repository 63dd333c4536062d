"""The host KV tier's ledger: tokens of the sequences swapped out to it, and of the prefix
cache's blocks kept there in what they leave; `jaxpipe.kv` moves the bytes.

A swapped-out sequence is charged its `computed` tokens rounded up to the tier's `unit`
(`size`: the host copy programs compile per rounded length, so that is what host memory
holds), from when the state records the move (`hold`) until it comes back or ends
(`release`). With prefix caching the tier is also the cache's second tier
(`host_prefix.HostPrefixCache`): blocks the device pool evicts that were hit at least once
are kept there by hash, in groups of a swap chunk's blocks, as far as the swapped-out
sequences leave room (they come first: `free` does not count the cache, which shrinks for
them); a prefix that goes on in the tier is copied back into new device blocks. The ledger
only records what the bytes must do (`take_moves`); the engine does it, in order, before the
next step or KV move touches the pool.

Invariant (`check`): the sequences' tokens and the cache's groups fit `capacity`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpipe.scheduler.host_prefix import HostPrefixCache, Move

if TYPE_CHECKING:
    from jaxpipe.scheduler.seq_info import SeqInfo


class HostLedger:
    """`capacity` tokens of host KV in units of `unit` tokens; `cache_block`: the device
    block size when the tier is the prefix cache's second tier (None: it is not)."""

    def __init__(self, capacity: int, unit: int = 1, cache_block: int | None = None):
        if capacity < 0 or unit < 1:
            raise ValueError(f"need host_kv_tokens >= 0 (got {capacity}) and host_unit >= 1 "
                             f"(got {unit})")
        self.capacity, self.unit = capacity, unit
        self.used = 0  # tokens of the sequences it holds (each rounded up to `unit`)
        self.peak = 0  # the most `used` has been
        self.cache: HostPrefixCache | None = None
        if cache_block is not None and capacity:
            per = max(1, unit // cache_block)  # a group: one swap chunk's blocks
            self.cache = HostPrefixCache(per, self.size(per * cache_block))
            self.cache.limit = capacity

    @property
    def free(self) -> int:
        """Tokens a swapped-out sequence may still take (the cache gives way to it)."""
        return self.capacity - self.used

    def size(self, tokens: int) -> int:
        """Host tokens that `tokens` tokens of KV occupy (rounded up to `unit`)."""
        return -(-tokens // self.unit) * self.unit

    def hold(self, seq: SeqInfo) -> None:
        """`seq` was swapped out: charge its KV (the cache evicts what it needs)."""
        self.used += self.size(seq.computed)
        self.peak = max(self.peak, self.used)
        self._shrink_cache()

    def release(self, seq: SeqInfo) -> None:
        """`seq` came back or ended: its KV leaves the tier."""
        self.used -= self.size(seq.computed)
        self._shrink_cache()

    def reset_peak(self) -> None:
        """Restart `peak` from what is held now (a stats reset)."""
        self.peak = self.used

    def take_moves(self) -> list[Move]:
        """The prefix cache's block moves recorded since the last call, in order (the engine
        carries them out before the next step or KV move)."""
        if self.cache is None or not self.cache.moves:
            return []
        moves, self.cache.moves = self.cache.moves, []
        return moves

    def check(self) -> None:
        """Raise if the sequences and the cache's groups overfill the tier."""
        cached = self.cache.used if self.cache is not None else 0
        if self.used + cached > self.capacity:
            raise RuntimeError(f"host KV tier overfilled: {self.used} tokens of sequences "
                               f"and {cached} of cached blocks, {self.capacity} in all")

    def _shrink_cache(self) -> None:
        """The cache may use what the sequences leave (evicting its oldest groups)."""
        if self.cache is not None:
            self.cache.shrink(self.capacity - self.used)
