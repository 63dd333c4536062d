"""Cache-aware admission order (jaxpipe/scheduler/prefix_order.py): a permutation that keeps
the prompts sharing a first block together, queues each group's first prompt one group early,
and keeps equal prompts in input order."""

from __future__ import annotations

import random

import pytest

from jaxpipe.scheduler.prefix_order import admission_order

BLOCK = 4


def test_groups_run_together_and_each_first_prompt_goes_one_group_early():
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    prompts = [b + [9], a + [5], c + [1], a + [2], b + [1], [0, 7], c + [0], a + [2]]
    order = admission_order(prompts, BLOCK)
    # groups in the input order of their first members: b (0), a (1), c (2), then [0, 7] (5),
    # shorter than a block past its last token, a group of one; each group sorted by tokens:
    # b+[1] (4), b+[9] (0); a+[2] (3, then its equal 7), a+[5] (1); c+[0] (6), c+[1] (2).
    assert order == [4, 3, 0, 6, 7, 1, 5, 2]


def test_prompts_without_a_full_block_before_their_last_token_are_alone():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3]]
    assert admission_order(prompts, BLOCK) == [0, 1, 2]  # groups of one: the input order


def test_a_workload_that_shares_nothing_keeps_its_order():
    """Nothing to share, nothing to gain: the queue is the input order (a sort would change
    which requests batch together, and so the throughput, for no hit)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    assert admission_order(prompts, BLOCK) == list(range(50))


def test_a_prompt_sharing_nothing_keeps_its_place_among_groups():
    a = [1, 1, 1, 1]
    prompts = [[7, 7, 7, 7, 7], a + [2], [8, 8, 8, 8, 8], a + [1], [9, 9, 9, 9, 9]]
    # a's group takes its first member's place (1), sorted: 3 (a+[1]) leads, queued a group
    # early (right after 0), its other member 1 right after the next group's leader (2);
    # the prompts sharing nothing keep their relative order.
    assert admission_order(prompts, BLOCK) == [0, 3, 2, 1, 4]


@pytest.mark.parametrize("seed", range(20))
def test_a_permutation_where_groups_run_together_after_their_leaders(seed):
    """Less each group's first prompt in the order (its leader), every group is
    contiguous."""
    rng = random.Random(seed)
    stems = [[rng.randrange(5) for _ in range(BLOCK)] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(9) for _ in range(rng.randrange(6))]
               for _ in range(rng.randrange(1, 30))]
    order = admission_order(prompts, BLOCK)
    assert sorted(order) == list(range(len(prompts)))

    def key(i):
        return tuple(prompts[i][:BLOCK]) if len(prompts[i]) > BLOCK else ("alone", i)

    leaders = {}
    for i in order:
        leaders.setdefault(key(i), i)
    rest = [key(i) for i in order if leaders[key(i)] != i]
    runs = [k for n, k in enumerate(rest) if n == 0 or rest[n - 1] != k]
    assert len(runs) == len(set(runs))  # each group's rest in one run


def test_a_bad_block_is_refused():
    with pytest.raises(ValueError, match="block must be >= 1"):
        admission_order([[1]], 0)
