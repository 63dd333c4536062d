"""What a scheduling policy sees: sequences as plain integers and the two KV tiers' budgets.

A `SeqInfo` is one request reduced to token counts. A `SchedulerState` holds every live `SeqInfo`
in exactly one place — the waiting queue, the device KV store or the host KV tier — and the
capacities of the two tiers in tokens. A finished sequence leaves the state (it is counted in
`num_finished`, and `apply` / `finish` hand it back to the caller): a server that runs for weeks
must not keep every request it ever served. Only `SchedulerState.apply` moves sequences between
places (see `jaxpipe.scheduler.loop` for the loop that calls it), and it checks the capacity
invariants on every move, so no executor can silently overfill a tier.

Token accounting. `computed` is how many tokens of a sequence have KV (in whichever tier holds
it); `context_len` = prompt + generated. After a whole prefill `computed == context_len` and the
sampled token raises `generated` by one, so a decode step writes one more KV row (computed + 1).
Each tier charges a sequence its tokens rounded up to the tier's unit: the host tier in rounded
lengths (`host_unit`), the device store in blocks of `device_unit` tokens.

The device store's blocks and slots are this state's own ledger, the only one: each device
sequence holds the ids of its blocks (`SeqInfo.blocks`, in position order) and one slot
(`SeqInfo.slot`: its row of per-sequence device state, such as penalty counts), from free
lists of plain ints, so the engine sends a step exactly the blocks and slots the scheduler
charged. A sequence takes the lowest free slot when it enters the device store (its first
prefill chunk, or a swap-in) and gives slot and blocks back when it leaves (swap-out,
preemption, finish). Only this state takes blocks (`_reserve`) and slots (`_enter`): when a
run is launched, when an action is applied, and when a swap-in brings a sequence back; an
executor reads `SeqInfo.blocks` and `SeqInfo.slot`, it never takes any.

Sliding windows (`window`: every layer attends over its last `window` keys only, as
Mistral's; 0 when any layer reads the whole context, as Gemma's global layers do: one block
table serves every layer). A query at position p reads the blocks from the one holding
p - window + 1 (`first_live`); every later query starts later, so once a run is applied the
blocks before its sequences' next query's are given back (`_slide`): each such entry of
`SeqInfo.blocks` becomes `FREED` (out of every pool's range: attention never reads it), so
the list stays in position order. A sequence then holds at most window / block + 1 blocks
while it decodes (`peak_size`: a chunk reads its window too), and that, not its length, is
what admission reserves for it. A freed block that is cached goes back as any released
cached block does (LRU); the host tier keeps a swapped-out sequence's whole length (its
freed positions are garbage no one reads) and a swap-in takes only the blocks past the
window (`resume_size`).

Launching. An executor that builds a step needs its blocks before running it: it launches the
`Run` first (`launch`: its prompts leave the waiting queue, every sequence takes the blocks the
run writes and is `busy`), then `apply` records it at once (the engine's rule: a run is
applied when it is dispatched, its sequences finish when it lands; `jaxpipe.scheduler.loop`)
and charges nothing more. A busy sequence is in no other micro-batch (its next token depends
on this one) until `apply` records the run, or, for host-driven pipeline ticks
(`apply(..., busy=True)`), until `returned(run)` when its micro-batch leaves the last stage.
A test may `apply` a run it never launched.

Prefix caching (`prefix_caching=True`, `EngineConfig.prefix_caching`). The blocks are a
`BlockPool` (`jaxpipe.scheduler.prefix_cache`): reference-counted, and a full block of known
token ids (`SeqInfo.token_ids`) is cached under the hash of its prefix. When a waiting sequence
enters the device store it takes a reference to each block of its longest cached prefix of
whole blocks, short of its last context token (always computed, for its logits): its `computed`
and `cached_tokens` start there, and its first chunk in the run is shortened to what is left
(and, where the prefix revives blocks nobody held, which counted as free, so that the pool
gives no more blocks than it has left after the policy's charges). A run's full blocks are
cached when the run is applied (the engine applies a run when it dispatches its step, so the
next step reads them), never at launch: a step's micro-batches may run in any order with
respect to the blocks they read, so nothing written in a step is read by that step. Instead a
waiting sequence whose next block to compute is one that a sequence launched before it (and
not yet applied) computes is *deferred*: it leaves the run and stays first in line, and the
next step finds that block cached (vLLM's answer; computing it twice would waste the step's
budget on a copy that is never shared). A sequence that leaves the device drops its
references; a cached block nobody holds stays cached (LRU) and counts as free until a block
is needed and the free list is empty. Shared blocks are charged once (`device_used`).

The host tier as the cache's second tier (`host_prefix.py`): with prefix caching and a host
tier, the blocks the device pool evicts that were hit at least once (`prefix_cache.py`) are
kept there by hash as far as the swapped-out
sequences leave room (they come first: `host_free` does not count the cache, which shrinks
for them), and a prefix that goes on in the host tier is copied back into new device blocks.
The state only records what the bytes must do (`take_moves`); the engine does it, in order,
before the next step or KV move touches the pool. A re-shard (`Switch`) moves the cached
blocks with the held ones (`moved_blocks`) rather than dropping them: it costs a
device-to-device copy of their bytes at each switch, against computing a block again when it
is next hit, 2 x params FLOP a token against its KV bytes: 17 kFLOP per byte (SmolLM2-1.7B,
no GQA) to 120 k (Llama-3-8B), where an H100 computes about 2 kFLOP in the time NVLink moves
a byte (300 per HBM byte). A moved block pays if one in 8 to one in hundreds is hit again;
dropped, `seesaw` (a switch every cycle) would keep its cache for one prefill phase only.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from jaxpipe.scheduler.actions import Action, Kind, Preempt, Run, SwapIn, Switch
from jaxpipe.scheduler.host_prefix import HostPrefixCache, Move
from jaxpipe.scheduler.prefix_cache import FREED, BlockPool


class Location(enum.Enum):
    WAITING = "waiting"  # no KV (never prefilled, or preempted for recompute)
    DEVICE = "device"  # KV in the device store: decodable
    HOST = "host"  # KV in the host tier: must be swapped in before decoding
    FINISHED = "finished"


class Phase(enum.StrEnum):
    """Which layout's weights are on the devices (for single-layout runs, always PREFILL)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class SeqInfo:
    """One request as the scheduler sees it. Lengths in tokens."""

    seq_id: Hashable
    prompt_len: int
    max_output_len: int
    predicted_output_len: int | None = None  # e.g. from an output-length predictor
    first_prediction: int | None = None  # the predictor's first guess (its error is measured)
    generated: int = 0  # output tokens sampled so far
    computed: int = 0  # tokens whose KV exists (prefill progress, then one per decode step)
    location: Location = Location.WAITING
    arrival: int = 0  # admission order, set by SchedulerState.add (preemption picks the newest)
    blocks: list[int] = field(default_factory=list)  # device KV blocks held, in position order
    behind: int = 0  # of them, leading ones given back (FREED): behind every layer's window
    slot: int | None = None  # its device slot while it is in the device store
    cached_tokens: int = 0  # tokens of its context its last admission found in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of blocks[:len(this)]
    # The hashes of its context's first full blocks of known tokens, as far as the prefix
    # cache has hashed them (a memo: a block's tokens never change, so each is hashed once).
    hash_chain: list[bytes] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.prompt_len < 1 or self.max_output_len < 1:
            raise ValueError(f"sequence {self.seq_id!r}: prompt_len ({self.prompt_len}) and "
                             f"max_output_len ({self.max_output_len}) must be >= 1")

    @property
    def context_len(self) -> int:
        """Prompt plus generated tokens: what a (re)prefill must cover."""
        return self.prompt_len + self.generated

    @property
    def in_prefill(self) -> bool:
        """True until a (chunked) prefill of the whole context has sampled a token."""
        return self.generated == 0 or self.computed < self.context_len - 1

    @property
    def to_prefill(self) -> int:
        """Tokens still to prefill (prompt, plus outputs after a recompute preemption)."""
        return self.context_len - self.computed

    def token_ids(self, start: int, stop: int) -> list[int] | None:
        """Its context's token ids (prompt, then outputs) in [start, stop), as far as known;
        None if unknown: a plain SeqInfo carries only lengths (it never hits the cache)."""
        return None

    @property
    def expected_total(self) -> int:
        """Tokens of KV this sequence will hold at the end (predicted, else the maximum)."""
        out = self.predicted_output_len or self.max_output_len
        return self.prompt_len + min(out, self.max_output_len)


class SchedulerState:
    """Queues (waiting FIFO, device, host FIFO) and the KV budgets of both tiers, in tokens."""

    def __init__(self, device_kv_tokens: int, max_device_seqs: int, host_kv_tokens: int = 0,
                 phase: Phase = Phase.PREFILL, host_unit: int = 1, device_unit: int = 1,
                 prefix_caching: bool = False, cache_key: Hashable = None, window: int = 0):
        """`host_unit`: the host tier stores each sequence's KV rounded up to a multiple of
        this many tokens (its copy programs compile per rounded length), and is charged so.
        `device_unit`: the device store's block size; a sequence holds whole blocks.
        `prefix_caching`: share cached full blocks between sequences with the same prefix;
        `cache_key`: whatever else changes the KV of the same tokens (e.g. the model's
        name), hashed into every block. `window`: the sliding window every layer reads
        through (0: some layer reads the whole context; the module docstring)."""
        if (device_kv_tokens < 1 or max_device_seqs < 1 or host_kv_tokens < 0 or host_unit < 1
                or device_unit < 1):
            raise ValueError(f"need device_kv_tokens >= 1 (got {device_kv_tokens}), "
                             f"max_device_seqs >= 1 (got {max_device_seqs}), "
                             f"host_kv_tokens >= 0 (got {host_kv_tokens}), "
                             f"host_unit >= 1 (got {host_unit}) and "
                             f"device_unit >= 1 (got {device_unit})")
        if window < 0:
            raise ValueError(f"window must be >= 0 (0: none), got {window}")
        self.window = window
        self.host_unit = host_unit
        self.device_unit = device_unit
        self.device_kv_tokens = device_kv_tokens
        self.max_device_seqs = max_device_seqs
        self.host_kv_tokens = host_kv_tokens
        self.phase = Phase(phase)
        self.waiting: deque[SeqInfo] = deque()
        self.device: dict[Hashable, SeqInfo] = {}  # insertion order = admission order
        self.host: dict[Hashable, SeqInfo] = {}  # insertion order = swap-out order (FIFO)
        self.num_finished = 0  # sequences that ended or were aborted (they are not kept)
        self.num_blocks = device_kv_tokens // device_unit
        self.host_cache = self._host_cache() if prefix_caching and host_kv_tokens else None
        self.block_pool = BlockPool(self.num_blocks, device_unit, prefix_caching, cache_key,
                                    self.host_cache)
        self._computing: set[bytes] = set()  # hashes of blocks launched runs write (to apply)
        self._free_slots = list(range(max_device_seqs))  # a heap: lowest slot first
        self.peak_blocks = 0  # the most blocks held at once
        self.host_used = 0  # tokens of KV in the host tier (rounded up to host_unit each)
        self.host_peak = 0  # the most host_used has been
        self.busy: set[Hashable] = set()  # sequences in a launched, not yet applied, Run
        self._arrivals = 0

    def _host_cache(self) -> HostPrefixCache:
        """The prefix cache's host tier: groups of a swap chunk's blocks, charged a chunk."""
        per = max(1, self.host_unit // self.device_unit)
        cache = HostPrefixCache(per, self.host_size(per * self.device_unit))
        cache.limit = self.host_kv_tokens
        return cache

    # ---- reading -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.device or self.host)

    @property
    def device_used(self) -> int:
        """Tokens of KV the device store holds (whole blocks; a shared one once)."""
        return self.block_pool.num_held * self.device_unit

    @property
    def free_blocks(self) -> int:
        """Blocks free or cached with no reference (evictable)."""
        return self.block_pool.num_free

    def reset_peaks(self) -> None:
        """Restart `peak_blocks` and `host_peak` from what is held now (a stats reset)."""
        self.peak_blocks = self.block_pool.num_held
        self.host_peak = self.host_used

    def held_blocks(self) -> list[int]:
        """The device store's blocks some sequence holds (the pool's live data), ascending."""
        return self.block_pool.held()

    def moved_blocks(self) -> list[int]:
        """The blocks a re-shard moves: held ones and cached ones (see the module docstring)."""
        return self.block_pool.data_blocks()

    def take_moves(self) -> list[Move]:
        """The host tier's block moves recorded since the last call, in order (the engine
        carries them out before the next step or KV move)."""
        if self.host_cache is None or not self.host_cache.moves:
            return []
        moves, self.host_cache.moves = self.host_cache.moves, []
        return moves

    @property
    def device_free(self) -> int:
        """Tokens of KV the device store can still take (its free and evictable blocks)."""
        return self.block_pool.num_free * self.device_unit

    @property
    def host_free(self) -> int:
        return self.host_kv_tokens - self.host_used

    def host_size(self, tokens: int) -> int:
        """Host tier tokens that `tokens` tokens of KV occupy (rounded up to `host_unit`)."""
        return -(-tokens // self.host_unit) * self.host_unit

    def device_size(self, tokens: int) -> int:
        """Device store tokens that `tokens` tokens of KV occupy (whole blocks)."""
        return -(-tokens // self.device_unit) * self.device_unit

    def growth(self, seq: SeqInfo) -> int:
        """Device tokens a device sequence takes on when it writes one more KV token."""
        return self.device_size(seq.computed + 1) - self.device_size(seq.computed)

    def first_live(self, position: int) -> int:
        """The first block a query at `position` reads: the one its window starts in (0
        without a window)."""
        if not self.window:
            return 0
        return max(position - self.window + 1, 0) // self.device_unit

    def held_size(self, seq: SeqInfo) -> int:
        """Device tokens of the blocks `seq` holds (those behind its window given back)."""
        return (len(seq.blocks) - seq.behind) * self.device_unit

    def span_size(self, positions: int) -> int:
        """Device tokens of the most blocks `positions` (>= 1) consecutive positions fall on."""
        return (-(-(positions - 1) // self.device_unit) + 1) * self.device_unit

    def peak_size(self, seq: SeqInfo, tokens: int, chunk: int = 1) -> int:
        """The most device tokens `seq` holds at once from now until its context reaches
        `tokens`: the rest of its prefill in chunks of at most `chunk`, then a token at a
        time. Every block without a window; with one, what a step reads: a first chunk from
        position 0 its own blocks, any other chunk or decode its window before it too."""
        full = self.device_size(tokens)
        if not self.window:
            return full
        spans = [self.span_size(self.window)]  # a decode: its window
        rest = seq.to_prefill
        if seq.computed == 0:
            spans.append(self.device_size(min(rest, chunk)))
        if seq.computed > 0 or rest > chunk:
            spans.append(self.span_size(self.window + min(rest, chunk) - 1))
        return min(full, max(spans))

    def reserve_size(self, seq: SeqInfo, tokens: int, chunk: int = 1) -> int:
        """Device tokens `seq` takes, beyond those it holds, at most, until its context
        reaches `tokens` (`peak_size`): an admission's reservation."""
        return max(self.peak_size(seq, tokens, chunk) - self.held_size(seq), 0)

    def resume_size(self, seq: SeqInfo) -> int:
        """Device tokens a swapped-out `seq` takes to come back and decode one token: its
        blocks from its window's start."""
        unit = self.device_unit
        return self.device_size(seq.computed + 1) - self.first_live(seq.computed) * unit

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def idle(self) -> list[SeqInfo]:
        """Device sequences in no micro-batch in flight (admission order)."""
        return [s for s in self.device.values() if s.seq_id not in self.busy]

    # ---- writing -------------------------------------------------------------------------
    def _reserve(self, seq: SeqInfo, tokens: int) -> None:
        """Give `seq` device blocks until its first `tokens` positions fit (those before its
        window's start entered as FREED: a swap-in of a windowed sequence)."""
        first, end = self.first_live(seq.computed), -(-tokens // self.device_unit)
        need = end - max(len(seq.blocks), first)
        if need > self.free_blocks:
            raise RuntimeError(
                f"device KV overfilled: {seq.seq_id!r} needs {need} more blocks of "
                f"{self.device_unit} tokens, {self.free_blocks} of {self.num_blocks} are free")
        if len(seq.blocks) < first <= end:
            seq.blocks.extend([FREED] * (first - len(seq.blocks)))
            seq.behind = first
        seq.blocks.extend(self.block_pool.take() for _ in range(max(need, 0)))
        self.peak_blocks = max(self.peak_blocks, self.block_pool.num_held)

    def _slide(self, seq: SeqInfo) -> None:
        """Give back `seq`'s blocks that its next query's window has moved past (none
        without a window): their entries become FREED."""
        first = min(self.first_live(seq.computed), len(seq.blocks))
        for i in range(seq.behind, first):
            self.block_pool.release(seq.blocks[i])
            seq.blocks[i] = FREED
        seq.behind = max(seq.behind, first)

    def _enter(self, seq: SeqInfo) -> None:
        """`seq` joins the device store (a prompt leaving the waiting queue, or a swap-in
        leaving the host tier): it takes the lowest free slot."""
        if not self._free_slots:
            raise RuntimeError(f"device overfilled: no free slot for {seq.seq_id!r}, all "
                               f"{self.max_device_seqs} are held")
        seq.slot = heapq.heappop(self._free_slots)
        self.device[seq.seq_id] = seq
        seq.location = Location.DEVICE

    def _free_seq(self, seq: SeqInfo) -> None:
        """Drop `seq`'s references to its device blocks and return its slot (it leaves the
        device store; the caller takes it out of `device`)."""
        self.block_pool.drop(seq)
        seq.blocks, seq.block_hashes, seq.behind = [], [], 0
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None

    def add(self, seq: SeqInfo) -> None:
        """Queue a new request; refuse one that could never fit the device store."""
        if self.device_size(seq.prompt_len + seq.max_output_len) > self.device_kv_tokens:
            raise ValueError(
                f"sequence {seq.seq_id!r} needs up to {seq.prompt_len + seq.max_output_len} "
                f"tokens of KV but the device store holds {self.device_kv_tokens}")
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.waiting.append(seq)

    def add_all(self, seqs: Iterable[SeqInfo]) -> None:
        for seq in seqs:
            self.add(seq)

    def launch(self, run: Run) -> None:
        """`run` starts (its step is about to be built, or earlier runs are still in flight):
        its prompts leave the waiting queue (see `_admit`), every sequence takes the blocks
        the run writes and is busy until `apply(run)`."""
        for seq in run.seqs:
            if seq.seq_id in self.busy:
                raise RuntimeError(f"{seq.seq_id!r} is already in a micro-batch in flight")
        self._admit(run)
        for seq, num_tokens in run.prefill:
            self._reserve(seq, seq.computed + num_tokens)
        for seq in run.decode:
            self._reserve(seq, seq.computed + 1)
        self.busy.update(s.seq_id for s in run.seqs)
        self._settle()

    def _admit(self, run: Run) -> None:
        """`run`'s waiting sequences enter the device store, each with its longest cached
        prefix, and their first chunks are shortened to what is left past it (a step never
        computes more than its policy budgeted); one whose next block a run launched before
        it writes is deferred (it leaves `run`, still waiting: the module docstring)."""
        if all(seq.location is not Location.WAITING for seq, _ in run.prefill):
            for seq, num_tokens in run.prefill:
                self._computing.update(self.block_pool.hashes_written(seq, num_tokens))
            return
        spare = self.free_blocks - self._charged(run)  # what the run leaves free, as charged
        kept = []
        for seq, num_tokens in run.prefill:
            if seq.location is Location.WAITING:
                if self._computing and self.block_pool.first_uncached(seq) in self._computing:
                    continue  # deferred: a run launched before it writes its next block
                self.waiting.remove(seq)
                self._enter(seq)
                num_tokens, spare = self._take_prefix(seq, num_tokens, max(spare, 0))
            kept.append((seq, num_tokens))
            self._computing.update(self.block_pool.hashes_written(seq, num_tokens))
        run.prefill[:] = kept

    def _charged(self, run: Run) -> int:
        """The blocks `run` takes from the pool as its policy charged them (a waiting
        sequence's chunk from position 0)."""
        def new(seq: SeqInfo, end: int) -> int:
            return max(-(-end // self.device_unit) - len(seq.blocks), 0)
        return (sum(new(seq, seq.computed + n) for seq, n in run.prefill)
                + sum(new(seq, seq.computed + 1) for seq in run.decode))

    def _take_prefix(self, seq: SeqInfo, num_tokens: int, spare: int) -> tuple[int, int]:
        """`seq`, entering the device store, takes its longest cached prefix (its last
        context token is always computed): its `computed` and `cached_tokens` start there.
        A cached block nobody holds counts as free, so reviving one spends a block: from
        the `spare` blocks the run leaves free, then from the chunk's own charge (the chunk
        is shortened to fit). Returns (its first chunk, the spare blocks left)."""
        unit = self.device_unit
        charged = -(-num_tokens // unit)
        last = (seq.context_len - 1) // unit
        seq.cached_tokens, revived = self.block_pool.take_prefix(seq, last, spare + charged - 1)
        seq.computed = seq.cached_tokens
        over = max(revived - spare, 0)  # revived past the spare blocks: out of the chunk's
        chunk = min(num_tokens, seq.to_prefill, (charged - over) * unit)
        return chunk, spare + charged - revived - -(-chunk // unit)

    def apply(self, action: Action, finished: Iterable[Hashable] = (), busy: bool = False
              ) -> list[SeqInfo]:
        """Record that `action` ran; `finished` names the sequences that ended in it, which
        leave the state. Returns them (in `finished`'s order), for the policy's `landed`.
        `busy`: a run's sequences stay busy until `returned(run)` (host-driven pipeline
        ticks: nothing feeds their tokens to another micro-batch before it lands)."""
        handler = {Kind.RUN: self._apply_run, Kind.SWITCH: self._apply_switch,
                   Kind.SWAP_IN: self._apply_swap_in, Kind.PREEMPT: self._apply_preempt}
        handler[action.kind](action)
        if busy and action.kind is Kind.RUN:
            self.busy.update(s.seq_id for s in action.seqs)
        return self.finish(finished)

    def returned(self, run: Run) -> None:
        """`run`'s micro-batch landed: its sequences may join another (see `apply`'s busy)."""
        self.busy.difference_update(s.seq_id for s in run.seqs)

    def _apply_switch(self, action: Switch) -> None:
        # A re-shard moves the held and the cached blocks (`moved_blocks`): nothing is lost.
        self.phase = Phase(action.phase)

    def _apply_run(self, action: Run) -> None:
        self.busy.difference_update(s.seq_id for s in action.seqs)
        if any(seq.location is Location.WAITING for seq, _ in action.prefill):
            self._admit(action)  # a run applied without `launch` (tests)
        self._computing.clear()  # cached below: the next step's admissions find them
        for seq, num_tokens in action.prefill:
            self._prefill(seq, num_tokens, action.prefill_to_host)
        caching, unit, filled = self.block_pool.caching, self.device_unit, []
        for seq in action.decode:
            if seq.location is not Location.DEVICE or seq.in_prefill:
                raise RuntimeError(f"decode of {seq.seq_id!r} which is {seq.location.value}"
                                   f"{' and still prefilling' if seq.in_prefill else ''}")
            self._reserve(seq, seq.computed + 1)
            seq.computed += 1
            seq.generated += 1
            self._slide(seq)
            # It filled a block, or came back from the host tier (its blocks are cached
            # once it decodes: its KV is in them by then).
            if caching and (seq.computed % unit == 0 or not seq.block_hashes):
                filled.append(seq)
        self.block_pool.cache_full(filled)
        self._settle()

    def _prefill(self, seq: SeqInfo, num_tokens: int, to_host: bool) -> None:
        """Advance a prefill by `num_tokens` and cache its full blocks; a completed prefill
        samples a token and lands on the device (or in the host tier if `to_host`)."""
        if not 1 <= num_tokens <= seq.to_prefill:
            raise RuntimeError(f"prefill chunk of {num_tokens} tokens for {seq.seq_id!r} "
                               f"which has {seq.to_prefill} left")
        self._reserve(seq, seq.computed + num_tokens)
        seq.computed += num_tokens
        self.block_pool.cache_full([seq])
        self._slide(seq)
        if seq.to_prefill == 0:
            seq.generated += 1
            if to_host:
                self._move(seq, Location.HOST)

    def _apply_swap_in(self, action: SwapIn) -> None:
        for seq in action.seqs:
            if seq.location is not Location.HOST:
                raise RuntimeError(f"swap-in of {seq.seq_id!r} which is {seq.location.value}")
            self._move(seq, Location.DEVICE)
        self._settle()

    def _apply_preempt(self, action: Preempt) -> None:
        for seq in action.seqs:
            if seq.location is not Location.DEVICE:
                raise RuntimeError(f"preempting {seq.seq_id!r} which is {seq.location.value}")
            if action.mode == "swap":
                self._move(seq, Location.HOST)
            else:  # recompute: drop the KV, prefill prompt + outputs again later (first in line)
                del self.device[seq.seq_id]
                self._free_seq(seq)
                seq.computed, seq.location = 0, Location.WAITING
                self.waiting.appendleft(seq)
        self._settle()

    def _move(self, seq: SeqInfo, to: Location) -> None:
        """Move a sequence's KV between device and host (either direction)."""
        if to is Location.HOST:
            del self.device[seq.seq_id]
            self._free_seq(seq)
            self.host[seq.seq_id] = seq
            self.host_used += self.host_size(seq.computed)
            self.host_peak = max(self.host_peak, self.host_used)
            seq.location = Location.HOST
            self._host_changed()
        else:
            del self.host[seq.seq_id]
            self.host_used -= self.host_size(seq.computed)
            self._host_changed()
            self._enter(seq)
            self._reserve(seq, seq.computed)

    def finish(self, seq_ids: Iterable[Hashable]) -> list[SeqInfo]:
        """Record that these sequences ended after their run was applied (an executor that
        applies a run at dispatch learns its stops when the tokens reach the host); they
        leave the state. Returns them."""
        return [self._finish(seq_id) for seq_id in seq_ids]

    def _finish(self, seq_id: Hashable) -> SeqInfo:
        seq = self.device.pop(seq_id, None) or self.host.pop(seq_id, None)
        if seq is None:
            raise RuntimeError(f"finished sequence {seq_id!r} is not running")
        if seq.location is Location.HOST:
            self.host_used -= self.host_size(seq.computed)
            self._host_changed()
        else:
            self._free_seq(seq)
        seq.location = Location.FINISHED
        self.num_finished += 1
        return seq

    def abort(self, seq_id: Hashable) -> SeqInfo | None:
        """Drop a sequence wherever it is (its KV budget is returned); None if unknown or
        already finished. For requests cancelled by their caller."""
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.location = Location.FINISHED
                self.num_finished += 1
                return seq
        if seq_id in self.device or seq_id in self.host:
            return self._finish(seq_id)
        return None

    def _host_changed(self) -> None:
        """Swapped-out sequences' host tokens changed: the prefix cache gets what they leave
        (evicting its oldest groups when they need more)."""
        if self.host_cache is not None:
            self.host_cache.shrink(self.host_kv_tokens - self.host_used)

    def _settle(self) -> None:
        """Hand the blocks evicted by the last operation to the host tier (one group per
        swap chunk), then check that neither tier is overfilled."""
        self.block_pool.store_evicted()
        cached = self.host_cache.used if self.host_cache is not None else 0
        if self.host_used + cached > self.host_kv_tokens:
            raise RuntimeError(f"host KV tier overfilled: {self.host_used} tokens of sequences "
                               f"and {cached} of cached blocks, {self.host_kv_tokens} in all")
        if self.device_used > self.device_kv_tokens or len(self.device) > self.max_device_seqs:
            raise RuntimeError(
                f"device KV overfilled: {self.device_used}/{self.device_kv_tokens} tokens, "
                f"{len(self.device)}/{self.max_device_seqs} sequences")

