"""Requests that share prefixes at every offset that matters to a block-level prefix cache
(16-token blocks): the workload of tests/engine/test_prefix_caching.py and
tests/multidevice/test_prefix_caching_engine.py."""

from __future__ import annotations

import numpy as np

from jaxpipe import SamplingParams
from jaxpipe.kv.device_cache import BLOCK

NEW = 8  # tokens each request generates
assert BLOCK == 16  # the prompts below are cut at these block edges


def waves(vocab: int) -> tuple[list[list[int]], list[list[int]], list[SamplingParams]]:
    """(first wave, second wave, the params of each request of a wave), token ids < vocab.

    A shared 48-token stem; in the first wave the prompts share 40 of it (a hit stops at the
    block before: 32), 32 (exactly two blocks), all of another prompt, 48 (three full
    blocks: the last is recomputed, for its logits). The second wave, sent once the first
    ended, shares them again; its entry 5 is None: the caller sets it to the first prompt
    with its output and a few tokens more (a replayed chat: blocks written by decode)."""
    rng = np.random.default_rng(7)

    def draw(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    stem = draw(48)
    first = [stem[:40] + draw(6), stem[:40] + draw(9), stem[:32] + draw(12), draw(20), None,
             stem[:48], stem[:40] + draw(5)]
    first[4] = list(first[0])
    second = [stem[:48] + draw(3), stem[:32] + draw(21), list(first[2]), stem[:16] + draw(30),
              draw(17), None, stem[:40] + draw(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                               repetition_penalty=1.5, presence_penalty=0.7,
                               frequency_penalty=0.5)
    params = [greedy, greedy, penalised, greedy, greedy, penalised, penalised]
    return first, second, params


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_waves(engine, vocab: int) -> tuple[tuple, tuple, list[SamplingParams]]:
    """The two waves through `engine`, one after the other: ((prompts, tokens) of each wave,
    params), the second wave's replay filled in from the first's output."""
    first, second, params = waves(vocab)
    out_first = tokens(engine.generate(prompt_token_ids=first, sampling_params=params))
    second[5] = first[0] + out_first[0] + [3, 1, 4]
    out_second = tokens(engine.generate(prompt_token_ids=second, sampling_params=params))
    return (first, out_first), (second, out_second), params


def check_waves(engine, reference) -> list[dict]:
    """Run the reference's two waves through `engine`, each checked against the reference
    tokens; every block released at the end. Returns each wave's stats."""
    *expected, params = reference
    stats = []
    for prompts, want in expected:
        engine.reset_stats()
        assert tokens(engine.generate(prompt_token_ids=prompts, sampling_params=params)) == want
        stats.append(engine.stats())
    assert_all_released(engine)
    return stats


def host_holds_no_sequence(engine) -> bool:
    """The host tier holds only the prefix cache's groups (each the ledger's), no sequence:
    with the cache on (the default), blocks the device pool evicted stay there."""
    state = engine.executor.state
    groups = state.host_kv.cache.groups() if state.host_kv.cache is not None else {}
    return set(engine.executor.kv.host.entries) == {("prefix", g) for g in groups}


def assert_all_released(engine) -> None:
    """Every request ended: no block has a reference, none is lost, the host tier holds no
    sequence (only the prefix cache's groups, each the ledger's)."""
    state = engine.executor.state
    assert state.device_kv.pool.num_held == 0 and state.device_kv.used == 0
    assert state.device_kv.pool.num_free == state.device_kv.num_blocks
    assert host_holds_no_sequence(engine)
    assert state.host_kv.used == 0
