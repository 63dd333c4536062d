"""Static shapes: the bucket sizes the jitted step is compiled for (pure Python, no jax).

A step is a flat batch of tokens (`step_inputs.py`); its real token count is rounded up to the
next bucket, so a handful of compiled programs serve every step and only the tail of the
bucket is padding. Token buckets are multiples of 8 up to 64 and of 16 up to max_num_seqs (at
most 256: decode-only steps, whose size is the running batch's, never exceed it), then grow
by 1.5x and 2x alternately (steps of prompt chunks fill the budget, so those are mostly full).
One compile per bucket, and each compiled program is resident (~30 MB of code for the default
model on CPU), so no bucket exists that no step can use. The rows of a step (one per sequence
in it) are at most min(tokens, max_num_seqs); the LM head and sampler run on the sampled
rows, rounded up to a power of two (multiples of 32 past 32).
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


def token_buckets(lo: int, hi: int, fine: int = 256) -> tuple[int, ...]:
    """Multiples of lo/2 up to 4*lo (the few-row steps of a workload's tail), multiples of lo
    up to `fine` (decode steps of any batch pad at most lo - 1 tokens), both ending at `fine`
    at most, then 1.5x and 2x alternately (384, 512, 768, ...), ending exactly at hi."""
    small = max(lo // 2, 1)
    out = list(range(small, min(4 * lo, fine, hi) + 1, small))
    out += list(range(4 * lo + lo, min(fine, hi) + 1, lo))
    b = out[-1]
    while b < hi:
        out += [b + b // 2, 2 * b]
        b *= 2
    return tuple(sorted({x for x in out if x < hi} | {hi}))


SAMPLE_STEP = 32  # sampled-row buckets are multiples of this past it


def round_up_to(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` >= value."""
    return -(-value // multiple) * multiple


def round_up(value: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= value."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class Buckets:
    """Every static shape the runner compiles for one engine configuration."""

    step_tokens: tuple[int, ...]  # tokens of one step
    kv_len: tuple[int, ...]  # the XLA attention's key bound (the C++ kernel needs none)
    max_rows: int  # sequences in one step at most (max_num_seqs)

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_model_len: int,
                   max_num_batched_tokens: int) -> Buckets:
        """Steps of up to max(max_num_batched_tokens, max_num_seqs) tokens: a decode step of
        every running sequence always fits."""
        most = max(max_num_batched_tokens, max_num_seqs)
        lo = min(16, most)
        fine = min(256, -(-max_num_seqs // lo) * lo)
        return cls(step_tokens=token_buckets(lo, most, fine),
                   kv_len=pow2_buckets(min(128, max_model_len), max_model_len),
                   max_rows=max_num_seqs)

    @property
    def max_tokens(self) -> int:
        return self.step_tokens[-1]

    def tokens(self, count: int) -> int:
        """The token bucket of a step of `count` real tokens."""
        return round_up(count, self.step_tokens)

    def rows(self, tokens: int) -> int:
        """Rows of a step of `tokens` (a bucket) tokens: one per sequence in it at most."""
        return min(tokens, self.max_rows)

    def sample_rows(self, count: int) -> int:
        """Rows the LM head and sampler run on for `count` sampled rows: a power of two up to
        SAMPLE_STEP, then a multiple of it (powers of two padded the default workload's
        LM head rows by about a quarter)."""
        if count > SAMPLE_STEP:
            return min(round_up_to(count, SAMPLE_STEP), self.max_rows)
        return min(1 << max(count - 1, 0).bit_length(), self.max_rows)

    def sample_row_buckets(self) -> list[int]:
        """Every value `sample_rows` takes."""
        return sorted({self.sample_rows(n) for n in range(1, self.max_rows + 1)})
