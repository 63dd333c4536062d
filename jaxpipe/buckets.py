"""Static shapes: the bucket sizes jitted steps are compiled for (pure Python, no jax).

A step's real size is rounded up to the next bucket so that a handful of compiled programs
serve every batch. Buckets are powers of two: each one is a compile (seconds on a loaded
2-core machine), and the decode padding they cost is limited because each block of rows
attends over its own KV-length bucket (see runner.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2·lo, 4·lo, ... ending exactly at hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def round_up(value: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= value."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class Buckets:
    """Every static shape the runner compiles for one engine configuration."""

    decode_batch: tuple[int, ...]
    kv_len: tuple[int, ...]
    prefill_len: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    prefill_tokens: int  # budget: padded prefill batch × length

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                   min_decode_batch: int = 16) -> Buckets:
        lo = min(min_decode_batch, max_num_seqs)
        return cls(
            decode_batch=pow2_buckets(lo, max_num_seqs),
            kv_len=pow2_buckets(min(128, max_model_len), max_model_len),
            prefill_len=pow2_buckets(min(32, max_model_len), max_model_len),
            prefill_batch=pow2_buckets(1, max_num_seqs),
            prefill_tokens=max_num_batched_tokens)

    def prefill_shape(self, count: int, longest: int) -> tuple[int, int]:
        """(batch, length) bucket for `count` prompts whose longest has `longest` tokens."""
        return round_up(count, self.prefill_batch), round_up(longest, self.prefill_len)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (batch, length) bucket a prefill batch can take."""
        return [(b, t) for t in self.prefill_len for b in self.prefill_batch
                if b * t <= self.prefill_tokens or b == 1]

    def prefill_length(self, length: int) -> int:
        """The padded length a prompt of `length` tokens is prefilled at."""
        return round_up(length, self.prefill_len)

    def prefill_fits(self, count: int, longest: int) -> bool:
        b, t = self.prefill_shape(count, longest)
        return b * t <= self.prefill_tokens or count == 1
