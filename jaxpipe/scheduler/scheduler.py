"""Continuous batching on one layout: prefill whenever a slot is free, else decode.

The scheduler holds only queues and plain integers (the KV slots). Every running sequence owns
one slot for its whole life, sized for max_model_len, so a running sequence never runs out of
KV and never needs preempting. New sequences take the lowest free slot, which keeps the decode
batch (slots 0..B-1) as small as the occupancy allows.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jaxpipe.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """What the runner executes next."""

    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]


class Scheduler:
    """Waiting queue, running set by slot, and the prefill/decode choice."""

    def __init__(self, num_slots: int, prefill_fits: Callable[[int, int], bool],
                 length_bucket: Callable[[int], int] | None = None, window: int = 256):
        """`prefill_fits(count, longest)` says whether a prefill batch is within budget.

        With `length_bucket` (prompt length -> the padded length it compiles for), a prefill
        batch is the oldest waiting prompt plus the next ones *in its bucket* among the first
        `window` waiting, so prompts are not padded to a longer neighbour's bucket (FIFO
        mixing padded 2.1x the real tokens on the ShareGPT-like benchmark). The oldest prompt
        is always in the batch, so nothing starves. Without it, admission is plain FIFO."""
        self.num_slots = num_slots
        self.prefill_fits = prefill_fits
        self.length_bucket = length_bucket
        self.window = window
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Prefill the next waiting prompts if a slot is free, else decode everything running."""
        if self.waiting and self._free:
            return Batch("prefill", self._admit())
        if self.running:
            return Batch("decode", [self.running[s] for s in sorted(self.running)])
        return None

    def _admit(self) -> list[Sequence]:
        """Move the next prefill batch (see __init__) from waiting into free slots."""
        seqs: list[Sequence] = []
        longest = 0
        for nxt in self._candidates():
            if len(seqs) == len(self._free):
                break
            if seqs and not self.prefill_fits(len(seqs) + 1, max(longest, nxt.prompt_len)):
                break
            longest = max(longest, nxt.prompt_len)
            seqs.append(nxt)
        for seq in seqs:
            self.waiting.remove(seq)
            seq.slot = heapq.heappop(self._free)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.slot] = seq
        return seqs

    def _candidates(self) -> list[Sequence]:
        """Waiting sequences in the order a prefill batch takes them."""
        if self.length_bucket is None:
            return list(self.waiting)
        head = self.waiting[0]
        bucket = self.length_bucket(head.prompt_len)
        window = itertools.islice(self.waiting, 1, self.window)
        return [head] + [s for s in window if self.length_bucket(s.prompt_len) == bucket]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and free its slot (or drop it from the waiting queue)."""
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def decode_rows(self) -> int:
        """Rows a decode step must cover: highest running slot + 1."""
        return max(self.running) + 1 if self.running else 0
