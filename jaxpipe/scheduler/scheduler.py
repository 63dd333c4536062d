"""Continuous batching on one layout: prefill whenever a slot is free, else decode.

The scheduler holds only queues and plain integers (the KV slots). Every running sequence owns
one slot for its whole life, sized for max_model_len, so a running sequence never runs out of
KV and never needs preempting. New sequences take the lowest free slot, which keeps the decode
batch (slots 0..B-1) as small as the occupancy allows.
"""

from __future__ import annotations

import heapq
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

    def __init__(self, num_slots: int, prefill_fits: Callable[[int, int], bool]):
        """`prefill_fits(count, longest)` says whether a prefill batch is within budget."""
        self.num_slots = num_slots
        self.prefill_fits = prefill_fits
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
        """Pop waiting sequences (FIFO) into free slots while the prefill batch fits."""
        seqs: list[Sequence] = []
        longest = 0
        while self.waiting and len(seqs) < len(self._free):
            nxt = self.waiting[0]
            if seqs and not self.prefill_fits(len(seqs) + 1, max(longest, nxt.prompt_len)):
                break
            longest = max(longest, nxt.prompt_len)
            seqs.append(self.waiting.popleft())
        for seq in seqs:
            seq.slot = heapq.heappop(self._free)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.slot] = seq
        return seqs

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
