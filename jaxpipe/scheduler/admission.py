"""Prefix admission: how a run's waiting sequences enter the device store when the blocks are
a prefix cache (`prefix_cache.py`), and which of them wait a step.

A waiting sequence entering the device store takes a reference to each block of its longest
cached prefix of whole blocks, short of its last context token (always computed, for its
logits): its `computed` and `cached_tokens` start there, and its first chunk in the run is
shortened to what is left. A cached block nobody holds counts as free, so reviving one
spends a block: first from the blocks the run leaves free as its policy charged it, then
from the chunk's own charge (the chunk is shortened to fit), so that the pool gives no more
blocks than the policy's charges left.

A run's full blocks are cached when the run is applied (the engine applies a run when it
dispatches its step, so the next step reads them), never at launch: a step's micro-batches
may run in any order with respect to the blocks they read, so nothing written in a step is
read by that step. Instead a waiting sequence whose next block to compute is one that a
sequence launched before it (and not yet applied) computes is *deferred*: it leaves the run
and stays first in line, and the next step finds that block cached (vLLM's answer; computing
it twice would waste the step's budget on a copy that is never shared).
"""

from __future__ import annotations

from jaxpipe.scheduler.actions import Run
from jaxpipe.scheduler.device_ledger import DeviceLedger
from jaxpipe.scheduler.seq_info import Location, SeqInfo


class Admission:
    """The prefix admission of the runs launched on one device store (`device_kv`)."""

    def __init__(self, device_kv: DeviceLedger):
        self.device_kv = device_kv
        self._computing: set[bytes] = set()  # hashes of blocks launched runs write (to apply)

    def admit(self, run: Run) -> list[SeqInfo]:
        """`run`'s waiting sequences take their longest cached prefixes and their first
        chunks are shortened to what is left past them (a step never computes more than its
        policy budgeted); one whose next block a run launched before it writes is deferred
        (it leaves `run.prefill`). Returns those that enter the device store (the caller
        gives them their slots), in order."""
        pool, entered, kept, spare = self.device_kv.pool, [], [], None
        for seq, chunk in run.prefill:
            if seq.location is Location.WAITING:
                if spare is None:  # what the run leaves free, as charged
                    spare = pool.num_free - self._charged(run)
                if self._computing and pool.first_uncached(seq) in self._computing:
                    continue  # deferred: a run launched before it writes its next block
                entered.append(seq)
                chunk, spare = self._take_prefix(seq, chunk, max(spare, 0))
            kept.append((seq, chunk))
            self._computing.update(pool.hashes_written(seq, chunk))
        run.prefill[:] = kept
        return entered

    def applied(self) -> None:
        """The runs launched so far were applied: their blocks are cached (the next step's
        admissions find them), none is being computed any more."""
        self._computing.clear()

    def _charged(self, run: Run) -> int:
        """The blocks `run` takes from the pool as its policy charged them (a waiting
        sequence's chunk from position 0)."""
        new = self.device_kv.new_blocks
        return (sum(new(seq, seq.computed + n) for seq, n in run.prefill)
                + sum(new(seq, seq.computed + 1) for seq in run.decode))

    def _take_prefix(self, seq: SeqInfo, chunk: int, spare: int) -> tuple[int, int]:
        """`seq`, entering the device store, takes its longest cached prefix (its last
        context token is always computed): its `computed` and `cached_tokens` start there.
        Reviving a block nobody held spends one: from the `spare` blocks the run leaves
        free, then from the chunk's own charge (shortening it). Returns (its first chunk,
        the spare blocks left for the sequences after it)."""
        if not seq.reads_cache:
            seq.cached_tokens = 0
            return min(chunk, seq.to_prefill), spare
        blocks = self.device_kv.blocks
        charged = blocks.count(chunk)  # what the policy charged the chunk, from position 0
        last = (seq.context_len - 1) // blocks.unit  # the block of its last context token
        # At most one block short of what the spare blocks and the charge together give: the
        # chunk still computes its last token's block.
        seq.cached_tokens, revived = self.device_kv.pool.take_prefix(
            seq, last, spare + charged - 1)
        seq.computed = seq.cached_tokens
        from_charge = max(revived - spare, 0)  # revived past the spare blocks
        chunk = min(chunk, seq.to_prefill, (charged - from_charge) * blocks.unit)
        spare_left = max(spare - revived, 0)  # spare blocks no revived one took
        charge_left = charged - from_charge - blocks.count(chunk)  # the shortened chunk's
        return chunk, spare_left + charge_left
