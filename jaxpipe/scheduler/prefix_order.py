"""The order to queue a known list of prompts in, so that a block-level prefix cache serves
them well: longest-prefix-match grouping (SGLang's `lpm`), for `Engine.generate` on a list.

Prompts that share their first block form one group, its members sorted by their token ids
(so that those sharing a longer prefix are next to each other); the groups keep the input
order of their first members, so a prompt that shares nothing keeps its place and a workload
without sharing runs in its own order. The cache shares only blocks written in an earlier
step (the state's admission, `admission.py`, defers a request whose next block another request
of the same step is computing), so a group queued back to back would wait a step behind its
first request; instead each group's first prompt is queued ahead, right before the previous
group's others, so its prefix is written (and cached) by the time its own group arrives.
"""

from __future__ import annotations

from collections.abc import Sequence


def admission_order(prompts: Sequence[Sequence[int]], block: int) -> list[int]:
    """Indices of `prompts` (token ids) in the order to queue them (see the module
    docstring). Prompts with no full block before their last token (which is always
    computed) share nothing and are groups of one; equal prompts keep their input order."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    by_key: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):  # dicts keep insertion order: first members' order
        key = tuple(prompt[:block]) if len(prompt) > block else ("alone", i)
        by_key.setdefault(key, []).append(i)
    groups = [sorted(members, key=lambda i: list(prompts[i])) for members in by_key.values()]
    order = [groups[0][0]] if groups else []
    for k, members in enumerate(groups):
        if k + 1 < len(groups):
            order.append(groups[k + 1][0])  # the next group's prefix, a step ahead of it
        order.extend(members[1:])
    return order
