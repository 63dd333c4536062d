"""The prefix cache's second tier: full blocks the device pool evicted after they were hit at
least once (`prefix_cache.py` says why), kept in the host KV tier by their hash (SGLang's
HiCache), as plain integers; `jaxpipe.kv` holds the bytes.

Blocks go to the host in *groups*: the blocks one launch (or swap-in) evicts from the device
pool's LRU, up to a swap chunk's worth (`group_blocks`), are read out together by one chunk
extract, the program Seesaw's swaps already compiled, and each group is charged the host tier
one chunk (`group_tokens`: what host memory holds). A group leaves the host whole, least
recently used first (a hit makes its group the newest), when the tier needs the room: for a
newer group, or for a sequence swapped out (those come first: the cache only uses what they
leave). A hit copies its block into a device block and keeps the host copy (the block may be
evicted from the device again; then it is already on the host and costs no copy).

The ledger records what the bytes must do as `moves`, in order, for the engine to carry out
before anything else touches the pool (`HostLedger.take_moves`):

  Spill(group, blocks)         read these device blocks, just evicted, into a new host group
  Fetch(group, index, block)   copy the group's block `index` into device block `block`
  Forget(group)                the group left the host tier: free its memory
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Spill:
    group: int
    blocks: tuple[int, ...]  # device blocks, in group order


@dataclass(frozen=True)
class Fetch:
    group: int
    index: int  # the block's place in its group
    block: int  # the device block it goes into


@dataclass(frozen=True)
class Forget:
    group: int


Move = Spill | Fetch | Forget


class HostPrefixCache:
    """Groups of cached blocks in the host tier: hash -> (group, index), groups in LRU order."""

    def __init__(self, group_blocks: int, group_tokens: int):
        if group_blocks < 1 or group_tokens < 1:
            raise ValueError(f"need group_blocks >= 1 (got {group_blocks}) and group_tokens "
                             f">= 1 (got {group_tokens})")
        self.group_blocks = group_blocks
        self.group_tokens = group_tokens
        self.limit = 0  # host tokens the cache may use now (what swapped-out sequences leave)
        self._where: dict[bytes, tuple[int, int]] = {}
        self._groups: OrderedDict[int, list[bytes]] = OrderedDict()  # oldest first
        self._next_group = 0
        self.moves: list[Move] = []
        self.stored_blocks = 0  # blocks copied to the host
        self.evictions = 0  # blocks the host tier forgot (their group left)

    @property
    def used(self) -> int:
        """Host tokens the cached groups occupy."""
        return len(self._groups) * self.group_tokens

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._where

    def groups(self) -> dict[int, list[bytes]]:
        """Every group and its blocks' hashes, oldest first."""
        return {g: list(h) for g, h in self._groups.items()}

    def fetch(self, digest: bytes, block: int) -> None:
        """Copy the block cached under `digest` into device `block`; its group is now the
        newest."""
        group, index = self._where[digest]
        self._groups.move_to_end(group)
        self.moves.append(Fetch(group, index, block))

    def store(self, evicted: list[tuple[int, bytes]], keep: bytes | None = None) -> None:
        """Keep device blocks just evicted ((block, hash), eviction order) not already here,
        in groups, as far as `limit` allows (evicting older groups for newer ones).
        `keep`: the hash of a block about to be fetched (its copy-back took the device block
        whose eviction this stores): its group becomes the newest and is never evicted to
        make room, the new group is dropped instead (the fetch must still find it)."""
        kept = None
        if keep is not None:
            kept = self._where[keep][0]
            self._groups.move_to_end(kept)
        new = [(b, h) for b, h in evicted if h not in self._where]
        for start in range(0, len(new), self.group_blocks):
            if not self._make_room(self.group_tokens, kept):
                return
            part = new[start:start + self.group_blocks]
            group, self._next_group = self._next_group, self._next_group + 1
            self._groups[group] = [h for _, h in part]
            for index, (_, digest) in enumerate(part):
                self._where[digest] = (group, index)
            self.stored_blocks += len(part)
            self.moves.append(Spill(group, tuple(b for b, _ in part)))

    def shrink(self, limit: int) -> None:
        """The cache may now use `limit` host tokens: evict groups past it."""
        self.limit = limit
        while self._groups and self.used > limit:
            self._evict_oldest()

    def _make_room(self, tokens: int, kept: int | None) -> bool:
        """Evict the oldest groups, never `kept` (the newest), until `tokens` more fit under
        `limit`; False if they cannot."""
        if tokens > self.limit:
            return False
        while self.used + tokens > self.limit:
            if next(iter(self._groups)) == kept:
                return False
            self._evict_oldest()
        return True

    def _evict_oldest(self) -> None:
        group, hashes = self._groups.popitem(last=False)
        for digest in hashes:
            del self._where[digest]
        self.evictions += len(hashes)
        self.moves.append(Forget(group))
