"""Positions to device KV blocks: the arithmetic every count of the device store is made of.

A sequence's position t is in its block t // unit; it holds whole blocks, so `tokens`
positions take `count(tokens)` blocks, `size(tokens)` tokens of the store. With a sliding
`window` (every layer attends over its last `window` keys), a query at position p reads
keys p - window + 1 .. p: from block `first_live(p)` on; no block before is ever read again
by it or any later query.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Blocks:
    """Blocks of `unit` tokens; `window`: the sliding window of every layer (0: none)."""

    unit: int
    window: int = 0

    def __post_init__(self):
        if self.unit < 1 or self.window < 0:
            raise ValueError(f"need device_unit >= 1 (a block's tokens; got {self.unit}) and "
                             f"window >= 0 (0: none; got {self.window})")

    def count(self, tokens: int) -> int:
        """Blocks that hold positions 0 .. tokens - 1."""
        return -(-tokens // self.unit)

    def size(self, tokens: int) -> int:
        """Store tokens that `tokens` positions occupy: whole blocks."""
        return self.count(tokens) * self.unit

    def first_live(self, position: int) -> int:
        """The first block a query at `position` reads: the one its window starts in (0
        without a window)."""
        if not self.window:
            return 0
        return max(position - self.window + 1, 0) // self.unit

    def span(self, positions: int) -> int:
        """Store tokens of the most blocks `positions` (>= 1) consecutive positions fall on
        (one more than they fill when they start inside a block)."""
        return (self.count(positions - 1) + 1) * self.unit
