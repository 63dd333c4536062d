"""The device store's blocks as a reference-counted pool that can also cache full blocks by
content (automatic prefix caching, as vLLM's block hashing).

A block is one of three things at any time:

- **free**: on the free list (a stack: the block given back last is given out first);
- **referenced**: held by one or more device sequences (`refs(block)` of them);
- **cached and unreferenced**: nobody holds it, but it keeps full, known KV under its hash,
  in an LRU; it is evicted (its hash forgotten) only when the free list runs dry. With a
  host tier (`host`, `jaxpipe.scheduler.host_prefix`) an evicted block's KV is kept there
  under its hash if the block was hit at least once (a prefix lookup took it, or it was
  copied back from the host tier), and a prefix that goes on in the host tier is copied
  back into new blocks.

Why only hit blocks go to the host tier (SGLang HiCache's "write_through_selective"): every
finished sequence leaves its full blocks cached, so once the pool is full nearly every block
given out evicts one. Spilling them all costs a device-to-host copy of a block's KV per
eviction (SmolLM2-135M: 368,640 bytes a 16-token block in bf16) where nothing is shared and
nobody ever reads them back. A block that was never hit while it stayed on the device is a
prompt's own tail or a one-off request; one that was hit is a shared prefix that is likely
to be asked for again.

Free and cached-unreferenced blocks are both capacity (`num_free`): the scheduler charges only
referenced blocks, each once however many sequences share it.

A full block's hash chains its parent's hash, an extra key (anything else that changes the
KV: the model, later a LoRA or cache salt) and its token ids (`block_hash`), so equal hashes
mean an equal prefix up to and including that block. Hashes are SHA-256: stable across
processes and not forgeable into a collision by a crafted prompt. With caching off nothing
is ever hashed and the pool is exactly a free list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpipe.scheduler.host_prefix import HostPrefixCache
    from jaxpipe.scheduler.seq_info import SeqInfo

ROOT = bytes(32)  # the parent hash of a sequence's first block
# The entry of a block a sequence gave back while it goes on (its window has moved past it):
# out of every pool's range (jaxpipe.kernels.paged.OUT_OF_RANGE, the int32 maximum), so a
# block table carries it as it is: attention never reads it, a write there is dropped.
FREED = 2**31 - 1


def block_hash(parent: bytes, token_ids: Sequence[int], key: bytes) -> bytes:
    """The hash of a full block: its parent's hash, the extra `key` (itself a 32-byte
    digest, see `extra_key_digest`) and its token ids."""
    digest = hashlib.sha256(parent)
    digest.update(key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extra_key_digest(extra_key: Hashable) -> bytes:
    """A fixed-size digest of the extra key (its repr: e.g. the model's name)."""
    return hashlib.sha256(repr(extra_key).encode()).digest()


class BlockPool:
    """`num_blocks` device blocks of `block_size` tokens: free list, reference counts and,
    when `caching`, the prefix cache (hash -> block, LRU of unreferenced cached blocks)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False,
                 extra_key: Hashable = None, host: HostPrefixCache | None = None):
        """`host`: the second tier evicted blocks go to (None: they are forgotten)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._key = extra_key_digest(extra_key)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 first
        self._refs = [0] * num_blocks
        self.num_held = 0  # blocks with a reference
        self._by_hash: dict[bytes, int] = {}  # every cached block, by its hash
        self._hash_of: dict[int, bytes] = {}  # the same, inverted
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: oldest first
        self.queried_tokens = 0  # context tokens looked up at admission
        self.hit_tokens = 0  # of which found cached (on the device or in the host tier)
        self.host_hit_tokens = 0  # of which found in the host tier (copied back)
        self.evictions = 0  # cached blocks evicted to be given out again
        self.host = host if caching else None
        self._evicted: list[tuple[int, bytes]] = []  # (block, hash): for the host tier
        self._hit: set[int] = set()  # cached blocks hit at least once: the ones worth spilling
        # Device sequences with full blocks of written KV not cached yet, their token ids not
        # all known when `cache_full` was told (an ordered set: dict keys).
        self._unhashed: dict[SeqInfo, None] = {}

    # ---- reading -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be given out: free, or cached with no reference (evictable)."""
        return len(self._free) + len(self._lru)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def held(self) -> list[int]:
        """Blocks with a reference, ascending."""
        return [b for b, n in enumerate(self._refs) if n]

    def cached(self) -> dict[int, bytes]:
        """Every cached block (referenced or not) and its hash."""
        return dict(self._hash_of)

    def unreferenced_cached(self) -> list[int]:
        """Cached blocks nobody holds, least recently released first (eviction order)."""
        return list(self._lru)

    def free_list(self) -> list[int]:
        return list(self._free)

    def data_blocks(self) -> list[int]:
        """Blocks whose KV is worth keeping (held, or cached), ascending: what a re-shard
        moves. Moving the cached ones too costs a device-to-device copy of their bytes at
        each switch, against computing a block again when it is next hit: 2 x params FLOP a
        token against its KV bytes, 17 kFLOP per byte (SmolLM2-1.7B, no GQA) to 120 k
        (Llama-3-8B), where an H100 computes about 2 kFLOP in the time NVLink moves a byte
        (300 per HBM byte). A moved block pays if one in 8 to one in hundreds is hit again;
        dropped, `seesaw` (a switch every cycle) would keep its cache for one prefill phase
        only."""
        return sorted({*self.held(), *self._hash_of})

    # ---- giving out and taking back ------------------------------------------------------
    def take(self) -> int:
        """A block for new KV, with one reference: a free one, else the least recently
        used unreferenced cached block (evicted from the cache)."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            digest = self._hash_of.pop(block)
            del self._by_hash[digest]
            self.evictions += 1
            if self.host is not None and block in self._hit:
                self._evicted.append((block, digest))
            self._hit.discard(block)
        else:
            raise RuntimeError(f"no free block: all {self.num_blocks} are held")
        self._ref(block)
        return block

    def drop(self, seq: SeqInfo) -> None:
        """`seq` leaves the device store: drop one reference to each of its blocks (in
        position order; entries given back already, `FREED`, are skipped). A block nobody
        holds any more goes to the LRU if it is cached, else to the free list; both in
        reverse order, so a chain's last blocks are given out (evicted) first. Its blocks
        still waiting for token ids stay uncached."""
        self._unhashed.pop(seq, None)
        for block in reversed(seq.blocks):
            if block != FREED:
                self.release(block)

    def release(self, block: int) -> None:
        """Drop one reference to `block` (a sequence gives it back: it leaves the device, or
        its window has moved past the block); nobody's any more, it goes to the LRU if it is
        cached, else to the free list."""
        if self._refs[block] < 1:
            raise RuntimeError(f"block {block} dropped but nobody holds it")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self.num_held -= 1
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def share(self, block: int) -> None:
        """One more reference to a held `block` (a forked sample shares its prompt's)."""
        if self._refs[block] < 1:
            raise RuntimeError(f"block {block} shared but nobody holds it")
        self._ref(block)

    def store_evicted(self, keep: bytes | None = None) -> None:
        """Hand the hit blocks evicted since the last call to the host tier (its `Spill` moves
        read them before anything writes them again); `keep`: see `HostPrefixCache.store`."""
        if self._evicted:
            self.host.store(self._evicted, keep)
            self._evicted = []

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._lru.pop(block, None)
            self.num_held += 1
        self._refs[block] += 1

    # ---- the prefix cache ----------------------------------------------------------------
    def chain(self, seq: SeqInfo, blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `blocks` blocks, fewer where a block's token ids are
        not all known: `seq.hash_chain`, extended as far as needed (each block is hashed
        once per sequence; its token ids are read in one slice)."""
        chain, size = seq.hash_chain, self.block_size
        if len(chain) >= blocks:
            return chain
        token_ids = seq.token_ids(len(chain) * size, blocks * size)
        if token_ids:
            digest = chain[-1] if chain else ROOT
            for start in range(0, len(token_ids) - size + 1, size):
                digest = block_hash(digest, token_ids[start:start + size], self._key)
                chain.append(digest)
        return chain

    def take_prefix(self, seq: SeqInfo, max_blocks: int, max_revived: int) -> tuple[int, int]:
        """`seq` (entering the device store with no blocks) takes a reference to each block
        of its longest cached prefix, at most `max_blocks`, of which at most `max_revived`
        held by nobody or copied back from the host tier (those spend capacity: a cached
        block nobody holds counts as free, a copy takes a new block); they become its first
        blocks and their hashes its `block_hashes`. Returns (tokens they cover, blocks
        revived or copied)."""
        if not self.caching:
            return 0, 0
        self.queried_tokens += seq.context_len
        revived = fetched = 0
        chain = self.chain(seq, max_blocks)
        while len(seq.blocks) < min(max_blocks, len(chain)):
            digest = chain[len(seq.blocks)]
            block = self._by_hash.get(digest)
            in_host = block is None and self.host is not None and digest in self.host
            if (block is None and not in_host) or (
                    (in_host or self._refs[block] == 0) and revived == max_revived):
                break
            if in_host:
                block = self._copy_back(digest)
                fetched += 1
            else:
                revived += self._refs[block] == 0
                self._ref(block)
                self._hit.add(block)
            revived += in_host
            seq.blocks.append(block)
            seq.block_hashes.append(digest)
        self.hit_tokens += len(seq.blocks) * self.block_size
        self.host_hit_tokens += fetched * self.block_size
        return len(seq.blocks) * self.block_size, revived

    def _copy_back(self, digest: bytes) -> int:
        """A new block (held once) that the host tier's copy of `digest` goes into, cached
        under it at once: the copy is issued before any step that reads it."""
        block = self.take()
        # A block it evicted is read out before the copy overwrites it, and the room that
        # read-out needs must not come from the group the copy reads.
        self.store_evicted(keep=digest)
        self.host.fetch(digest, block)
        self._by_hash[digest] = block
        self._hash_of[block] = digest
        self._hit.add(block)
        return block

    def first_uncached(self, seq: SeqInfo) -> bytes | None:
        """The hash of the first block of `seq`'s context found in neither tier (None if
        caching is off or that block is not full of known tokens). Changes nothing."""
        if not self.caching:
            return None
        for digest in self.chain(seq, seq.context_len // self.block_size):
            if digest not in self._by_hash and (self.host is None or digest not in self.host):
                return digest
        return None

    def hashes_written(self, seq: SeqInfo, num_tokens: int) -> list[bytes]:
        """The hashes of the full blocks of known tokens that `seq`'s next `num_tokens`
        tokens complete (from its first block not hashed yet)."""
        if not self.caching:
            return []
        full = (seq.computed + num_tokens) // self.block_size
        return self.chain(seq, full)[len(seq.block_hashes):full]

    def cache_full(self, seqs: list[SeqInfo]) -> None:
        """Cache the full blocks of written KV (a sequence's first `computed` tokens) whose
        token ids are known, in order from the first not yet hashed, of `seqs` (those that
        may have filled a block: the caller skips the others, 15 decode steps in 16) and of
        the sequences whose full blocks waited for a token id: the token a decode step reads
        is still in flight on the device when the step is applied (overlap), so the block
        it fills is cached a step later. A block whose hash another block already has (the
        same prefix computed twice) stays uncached."""
        if not self.caching:
            return
        for seq in seqs:
            self._unhashed[seq] = None
        for seq in list(self._unhashed):
            if self._cache_blocks(seq):
                del self._unhashed[seq]

    def _cache_blocks(self, seq: SeqInfo) -> bool:
        """Cache `seq`'s full blocks of known tokens; False if one waits for a token id."""
        full = min(seq.computed // self.block_size, len(seq.blocks))
        chain = self.chain(seq, full)
        for index in range(len(seq.block_hashes), min(full, len(chain))):
            digest, block = chain[index], seq.blocks[index]
            seq.block_hashes.append(digest)
            if block != FREED and digest not in self._by_hash:  # FREED: given back already
                self._by_hash[digest] = block
                self._hash_of[block] = digest
        return len(seq.block_hashes) >= full
