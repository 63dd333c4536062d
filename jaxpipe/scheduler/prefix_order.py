"""The order to queue a known list of prompts in, so that a block-level prefix cache serves
them well: longest-prefix-match grouping (SGLang's `lpm`), for `Engine.generate` on a list.

Sorted by their token ids, prompts that share a longer prefix are nearer each other, and those
that share their first block form one contiguous group. The cache shares only blocks written
in an earlier step (`SchedulerState` defers a request whose next block another request of the
same step is computing), so a group queued back to back would wait a step behind its first
request; instead each group's first prompt is queued ahead, right before the previous group's
others, so its prefix is written (and cached) by the time its own group arrives.
"""

from __future__ import annotations

from collections.abc import Sequence


def admission_order(prompts: Sequence[Sequence[int]], block: int) -> list[int]:
    """Indices of `prompts` (token ids) in the order to queue them (see the module
    docstring). Prompts with no full block before their last token (which is always
    computed) share nothing and are groups of one; equal prompts keep their input order."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    groups: list[list[int]] = []
    last_key = None
    for i in sorted(range(len(prompts)), key=lambda i: list(prompts[i])):
        key = tuple(prompts[i][:block]) if len(prompts[i]) > block else None
        if groups and key is not None and key == last_key:
            groups[-1].append(i)
        else:
            groups.append([i])
        last_key = key
    order = [groups[0][0]] if groups else []
    for k, members in enumerate(groups):
        if k + 1 < len(groups):
            order.append(groups[k + 1][0])  # the next group's prefix, a step ahead of it
        order.extend(members[1:])
    return order
