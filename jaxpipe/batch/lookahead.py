"""Cache-aware admission for a batch job: its requests, read as a stream, are queued a window
at a time, each window in the prefix cache's order (`jaxpipe.scheduler.prefix_order`:
sorted by token ids, grouped by first block, each group's first request a step ahead of
it), so requests that share a prefix (a system prompt, few-shot examples, one document asked
many questions) run close together and find it cached.

The window is the next `lookahead` readable requests, taken in input order: what a job holds
in memory stays bounded, and a request waits behind at most one window's reordering. Records
are still written as requests finish and keyed by custom_id; only the order they enter the
engine (and so finish) changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from jaxpipe.scheduler.prefix_order import admission_order

T = TypeVar("T")
# Lines read ahead by default: max_in_flight's default, so a window is about what the engine
# holds queued at once, and 5 system prompts over shuffled lines make groups of ~50.
DEFAULT_LOOKAHEAD = 256


def in_windows(items: Iterator[T], tokens: Callable[[T], Sequence[int]], lookahead: int,
               block: int) -> Iterator[T]:
    """`items` in windows of `lookahead` (the last one shorter), each window in
    `admission_order` of its items' `tokens(item)` for a cache of `block`-token blocks.
    `lookahead` 1 keeps the input order."""
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {lookahead}")
    while window := list(itertools.islice(items, lookahead)):
        if len(window) == 1:
            yield window[0]
            continue
        for i in admission_order([tokens(x) for x in window], block):
            yield window[i]
