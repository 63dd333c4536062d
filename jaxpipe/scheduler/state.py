"""What a scheduling policy sees, and the one place that moves sequences: the queues, and
the ledgers of the two KV tiers beside them.

A `SchedulerState` holds every live `SeqInfo` in exactly one place: the waiting queue (FIFO),
the device store (`device`, admission order) or the host tier (`host`, swap-out order). The
resources are counted by two ledgers a policy reads: `device_kv` (`DeviceLedger`: the device
store's blocks and slots) and `host_kv` (`HostLedger`: the host tier's tokens); `admission`
(`Admission`) is how waiting sequences enter the device store over the prefix cache. A
finished sequence leaves the state (it is counted in `num_finished`, and `apply` / `finish`
hand it back to the caller): a server that runs for weeks must not keep every request it
ever served.

Only `launch` and `apply` move sequences between places (`jaxpipe.scheduler.loop` is the
loop that calls them), and both check the ledgers' invariants on every move, so no executor
can silently overfill a tier. An executor that builds a step needs its blocks before running
it: it launches the `Run` first (`launch`: its prompts leave the waiting queue, every
sequence takes the blocks the run writes and is `busy`), then `apply` records it at once
(the engine's rule: a run is applied when it is dispatched, its sequences finish when it
lands) and charges nothing more. A busy sequence is in no other micro-batch (its next token
depends on this one) until `apply` records the run, or, for host-driven pipeline ticks
(`apply(..., busy=True)`), until `returned(run)` when its micro-batch leaves the last stage.
A test may `apply` a run it never launched.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Iterable

from jaxpipe.scheduler.actions import Action, Kind, Preempt, Run, SwapIn
from jaxpipe.scheduler.admission import Admission
from jaxpipe.scheduler.blocks import Blocks
from jaxpipe.scheduler.device_ledger import DeviceLedger
from jaxpipe.scheduler.host_ledger import HostLedger
from jaxpipe.scheduler.prefix_cache import BlockPool
from jaxpipe.scheduler.seq_info import Location, SeqInfo


class Phase(enum.StrEnum):
    """Which layout's weights are on the devices (for single-layout runs, always PREFILL)."""

    PREFILL = "prefill"
    DECODE = "decode"


class SchedulerState:
    """The queues (waiting FIFO, device, host FIFO) over the ledgers of both KV tiers."""

    def __init__(self, device_kv_tokens: int, max_device_seqs: int, host_kv_tokens: int = 0,
                 phase: Phase = Phase.PREFILL, host_unit: int = 1, device_unit: int = 1,
                 prefix_caching: bool = False, cache_key: Hashable = None, window: int = 0):
        """`host_unit`: the host tier stores each sequence's KV rounded up to a multiple of
        this many tokens (its copy programs compile per rounded length), and is charged so.
        `device_unit`: the device store's block size; a sequence holds whole blocks.
        `prefix_caching`: share cached full blocks between sequences with the same prefix;
        `cache_key`: whatever else changes the KV of the same tokens (e.g. the model's
        name), hashed into every block. `window`: the sliding window every layer reads
        through (0: some layer reads the whole context; `device_ledger.py`)."""
        blocks = Blocks(device_unit, window)
        self.host_kv = HostLedger(host_kv_tokens, host_unit,
                                  device_unit if prefix_caching else None)
        pool = BlockPool(device_kv_tokens // device_unit, device_unit, prefix_caching,
                         cache_key, self.host_kv.cache)
        self.device_kv = DeviceLedger(device_kv_tokens, max_device_seqs, blocks, pool)
        self.admission = Admission(self.device_kv)
        self.phase = Phase(phase)
        self.waiting: deque[SeqInfo] = deque()
        self.device: dict[Hashable, SeqInfo] = {}  # insertion order = admission order
        self.host: dict[Hashable, SeqInfo] = {}  # insertion order = swap-out order (FIFO)
        self.busy: set[Hashable] = set()  # sequences in a launched, not yet applied, Run
        self._to_host_on_return: dict[int, list[SeqInfo]] = {}  # id(run) -> its prefills
        self._fork_on_return: dict[int, list[SeqInfo]] = {}  # id(run) -> prefills with forks
        self.num_finished = 0  # sequences that ended or were aborted (they are not kept)
        self._arrivals = 0

    # ---- reading -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.device or self.host)

    def idle(self) -> list[SeqInfo]:
        """Device sequences in no micro-batch in flight (admission order)."""
        return [s for s in self.device.values() if s.seq_id not in self.busy]

    # ---- writing -------------------------------------------------------------------------
    def add(self, *seqs: SeqInfo) -> None:
        """Queue new requests; refuse one that could never fit the device store."""
        for seq in seqs:
            end = seq.prompt_len + seq.max_output_len
            need = self.device_kv.blocks.size(end) + len(seq.forks) * self.device_kv.fork_size(
                seq, end)
            if need > self.device_kv.capacity:
                raise ValueError(
                    f"sequence {seq.seq_id!r} needs up to {need} tokens of KV (its "
                    f"{1 + len(seq.forks)} samples) but the device store holds "
                    f"{self.device_kv.capacity}")
            seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
            self.waiting.append(seq)

    def launch(self, run: Run) -> None:
        """`run` starts (its step is about to be built, or earlier runs are still in flight):
        its prompts leave the waiting queue (`_admit`), every sequence takes the blocks the
        run writes and is busy until `apply(run)`."""
        for seq in run.seqs:
            if seq.seq_id in self.busy:
                raise RuntimeError(f"{seq.seq_id!r} is already in a micro-batch in flight")
        self._admit(run)
        for seq, num_tokens in run.prefill:
            self.device_kv.extend(seq, seq.computed + num_tokens)
        for seq in run.decode:
            self.device_kv.extend(seq, seq.computed + 1)
        self.busy.update(s.seq_id for s in run.seqs)
        self.device_kv.settle()
        self.host_kv.check()

    def apply(self, action: Action, finished: Iterable[Hashable] = (), busy: bool = False
              ) -> list[SeqInfo]:
        """Record that `action` ran; `finished` names the sequences that ended in it, which
        leave the state. Returns them (in `finished`'s order), for the policy's `landed`.
        `busy`: a run's sequences stay busy until `returned(run)` (host-driven pipeline
        ticks: nothing feeds their tokens to another micro-batch before it lands). A switch
        changes only the phase: a re-shard moves the held and the cached blocks
        (`BlockPool.data_blocks`), nothing is lost."""
        if action.kind is Kind.RUN:
            done = self._apply_run(action, action.prefill_to_host and not busy, fork=not busy)
            if busy:
                self._fork_on_return[id(action)] = [s for s in done if s.forks]
                self.busy.update(s.seq_id for s in action.seqs)
                if action.prefill_to_host:  # charged now, moved when the run returns
                    for seq in done:
                        self.host_kv.hold(seq)
                    self._to_host_on_return[id(action)] = done
        elif action.kind is Kind.SWITCH:
            self.phase = Phase(action.phase)
        else:
            self._move(action)
        self.device_kv.settle()
        self.host_kv.check()
        return self.finish(finished)

    def returned(self, run: Run) -> None:
        """`run`'s micro-batch landed: its sequences may join another (see `apply`'s busy),
        and the prefills it completed for the host tier go there now (their KV is whole only
        once the micro-batch left the last stage, so their blocks are held until then)."""
        self.busy.difference_update(s.seq_id for s in run.seqs)
        for seq in self._to_host_on_return.pop(id(run), ()):
            if seq.location is Location.DEVICE:
                self._to_host(seq, charged=True)
            else:  # it ended meanwhile: its charge goes
                self.host_kv.release(seq)
        for seq in self._fork_on_return.pop(id(run), ()):  # its prompt's KV is whole now
            self._fork(seq)
        self.device_kv.settle()
        self.host_kv.check()

    def finish(self, seq_ids: Iterable[Hashable]) -> list[SeqInfo]:
        """Record that these sequences ended after their run was applied (an executor that
        applies a run at dispatch learns its stops when the tokens reach the host); they
        leave the state. Returns them."""
        done = []
        for seq_id in seq_ids:
            seq = self.device.pop(seq_id, None) or self.host.pop(seq_id, None)
            if seq is None:
                raise RuntimeError(f"finished sequence {seq_id!r} is not running")
            if seq.location is Location.HOST:
                self.host_kv.release(seq)
            else:
                self.device_kv.leave(seq)
            seq.location = Location.FINISHED
            self.num_finished += 1
            self._fork(seq)  # samples still waiting to fork (it ended in the host tier)
            done.append(seq)
        return done

    def abort(self, seq_id: Hashable) -> SeqInfo | None:
        """Drop a sequence wherever it is (its KV budget is returned); None if unknown or
        already finished. For requests cancelled by their caller."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.location = Location.FINISHED
                self.num_finished += 1
                return self._drop_forks(seq)
        seq = self.device.get(seq_id) or self.host.get(seq_id)
        if seq is not None:
            self._drop_forks(seq)
            return self.finish([seq_id])[0]
        return None

    def _drop_forks(self, seq: SeqInfo) -> SeqInfo:
        """An aborted request's samples that had not forked yet end with it."""
        for child in seq.forks:
            child.location = Location.FINISHED
        self.num_finished += len(seq.forks)
        seq.forks = []
        return seq

    # ---- the moves -----------------------------------------------------------------------
    def _admit(self, run: Run) -> None:
        """`run`'s waiting sequences enter the device store with their cached prefixes, less
        the deferred ones (`Admission.admit`)."""
        for seq in self.admission.admit(run):
            self._to_device(seq)

    def _apply_run(self, run: Run, to_host: bool, fork: bool = True) -> list[SeqInfo]:
        """Record `run`; returns the prefills it completed (those of `to_host` went there)."""
        self.busy.difference_update(s.seq_id for s in run.seqs)
        if any(seq.location is Location.WAITING for seq, _ in run.prefill):
            self._admit(run)  # a run applied without `launch` (tests)
        self.admission.applied()
        completed = [seq for seq, num_tokens in run.prefill
                     if self._prefill(seq, num_tokens, to_host, fork)]
        pool, unit, filled = self.device_kv.pool, self.device_kv.blocks.unit, []
        for seq in run.decode:
            if seq.location is not Location.DEVICE or seq.in_prefill:
                raise RuntimeError(f"decode of {seq.seq_id!r} which is {seq.location.value}"
                                   f"{' and still prefilling' if seq.in_prefill else ''}")
            self.device_kv.extend(seq, seq.computed + 1)
            seq.computed += 1
            seq.generated += 1
            self.device_kv.slide(seq)
            # It filled a block, or came back from the host tier (its blocks are cached
            # once it decodes: its KV is in them by then).
            if pool.caching and (seq.computed % unit == 0 or not seq.block_hashes):
                filled.append(seq)
        pool.cache_full(filled)
        return completed

    def _prefill(self, seq: SeqInfo, num_tokens: int, to_host: bool, fork: bool) -> bool:
        """Advance a prefill by `num_tokens` and cache its full blocks; a completed prefill
        samples a token, its request's other samples fork from it (unless not `fork`: its
        micro-batch is still in the pipeline, they fork when it returns) and it stays on the
        device (or goes to the host tier if `to_host`). Returns whether it completed."""
        if not 1 <= num_tokens <= seq.to_prefill:
            raise RuntimeError(f"prefill chunk of {num_tokens} tokens for {seq.seq_id!r} "
                               f"which has {seq.to_prefill} left")
        self.device_kv.extend(seq, seq.computed + num_tokens)
        seq.computed += num_tokens
        self.device_kv.pool.cache_full([seq])
        self.device_kv.slide(seq)
        if seq.to_prefill == 0:
            seq.generated += 1
            if to_host:
                self._to_host(seq)
            if fork:
                self._fork(seq)
            return True
        return False

    def _fork(self, seq: SeqInfo) -> None:
        """`seq`'s prompt is prefilled: its request's other samples (n > 1) enter the
        device store sharing its prompt's blocks (`DeviceLedger.fork`), each to compute the
        last prompt token and sample from there. While `seq` is in the host tier (its
        prefill went there: `prefill_to_host`, seesaw) or waits to be recomputed, they stay
        with it and fork when its blocks are whole on the device again (`_to_device`), so
        the prompt is prefilled once. One that finds no slot or block, or whose parent has
        ended, waits first in line to prefill the prompt itself."""
        if not seq.forks or seq.location in (Location.HOST, Location.WAITING):
            return
        forks, seq.forks, wait = seq.forks, [], []
        for child in forks:
            child.arrival = seq.arrival
            if seq.location is Location.DEVICE and self.device_kv.fork(seq, child):
                self.device[child.seq_id] = child
                child.location = Location.DEVICE
            else:
                wait.append(child)
        self.waiting.extendleft(reversed(wait))

    def _move(self, action: SwapIn | Preempt) -> None:
        """A swap-in (host tier -> device store) or a preemption: to the host tier ("swap")
        or its KV dropped, to prefill prompt + outputs again later, first in line."""
        swap_in = action.kind is Kind.SWAP_IN
        for seq in action.seqs:
            if seq.location is not (Location.HOST if swap_in else Location.DEVICE):
                what = "swap-in of" if swap_in else "preempting"
                raise RuntimeError(f"{what} {seq.seq_id!r} which is {seq.location.value}")
            if swap_in:
                self._to_device(seq)
            elif action.mode == "swap":
                self._to_host(seq)
            else:
                del self.device[seq.seq_id]
                self.device_kv.leave(seq)
                seq.computed, seq.location = 0, Location.WAITING
                self.waiting.appendleft(seq)

    def _to_device(self, seq: SeqInfo) -> None:
        """`seq` enters the device store: a prompt from the waiting queue (its prefix cache
        hits already taken) or a swap-in from the host tier (blocks from its window's start
        on, for its KV to be copied into; the engine inserts it before its samples forked
        here read those blocks)."""
        swap_in = seq.location is Location.HOST
        if swap_in:
            del self.host[seq.seq_id]
            self.host_kv.release(seq)
        else:
            self.waiting.remove(seq)
        self.device_kv.enter(seq)
        self.device[seq.seq_id] = seq
        seq.location = Location.DEVICE
        self.device_kv.extend(seq, seq.computed)
        if swap_in:  # samples that waited with it in the host tier fork now
            self._fork(seq)

    def _to_host(self, seq: SeqInfo, charged: bool = False) -> None:
        """`seq`'s KV goes to the host tier: it leaves the device store (`charged`: the tier
        counted it already, when its run was applied)."""
        del self.device[seq.seq_id]
        self.device_kv.leave(seq)
        self.host[seq.seq_id] = seq
        if not charged:
            self.host_kv.hold(seq)
        seq.location = Location.HOST
