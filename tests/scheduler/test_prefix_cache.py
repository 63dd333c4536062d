"""The prefix cache in the one ledger: full blocks found by their hash chain, shared by
reference, cached when the run that writes them is applied, evicted least recently used only
when nobody holds them; and, under random arrivals, preemption and aborts, scheduled by each
policy, every block is exactly one of free, cached-unreferenced or referenced, and holds the
tokens its hash says."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from jaxpipe.scheduler import (
    Location,
    Preempt,
    Run,
    SchedulerState,
    SeqInfo,
    Sequence,
    SwapIn,
    Switch,
    make_policy,
)
from jaxpipe.scheduler.host_prefix import Fetch, Forget, Spill
from jaxpipe.scheduler.prefix_cache import FREED, ROOT, BlockPool, block_hash, extra_key_digest

UNIT = 4


def seq(seq_id, token_ids, max_tokens=4) -> Sequence:
    return Sequence.create(seq_id, list(token_ids), None, 0, max_tokens)


def cached_state(blocks=16, slots=4, **kwargs) -> SchedulerState:
    return SchedulerState(blocks * UNIT, slots, 64, host_unit=UNIT, device_unit=UNIT,
                          prefix_caching=True, **kwargs)


def prefill(state: SchedulerState, *seqs: Sequence) -> Run:
    """Prefill `seqs` whole in one run (launched, then applied); returns the run."""
    run = Run(prefill=[(s, s.to_prefill) for s in seqs])
    state.add(*(s for s in seqs if s.location is Location.WAITING and s not in state.waiting))
    state.launch(run)
    state.apply(run)
    return run


def alike(n: int) -> tuple[SchedulerState, Sequence, Sequence]:
    """A cached state where "a" then "b", both the prompt 0..n-1, were prefilled in turn."""
    state = cached_state()
    a, b = seq("a", range(n)), seq("b", range(n))
    prefill(state, a)
    prefill(state, b)
    return state, a, b


def test_block_hash_chains_parent_tokens_and_extra_key():
    key = extra_key_digest("smollm2")
    first = block_hash(ROOT, [1, 2, 3, 4], key)
    assert first == block_hash(ROOT, [1, 2, 3, 4], key)
    assert first != block_hash(ROOT, [1, 2, 3, 5], key)
    assert first != block_hash(ROOT, [1, 2, 3, 4], extra_key_digest("llama"))
    assert block_hash(first, [5, 6, 7, 8], key) != block_hash(ROOT, [5, 6, 7, 8], key)


def test_the_same_prefix_gets_the_same_blocks_and_another_key_does_not():
    state, a, b = alike(10)
    assert b.blocks[:2] == a.blocks[:2] and b.cached_tokens == 8
    assert b.blocks[2] != a.blocks[2]  # the partial block is never shared
    assert b.block_hashes == a.block_hashes
    def first(key):  # a new sequence each time: one remembers its hashes (one pool's)
        return BlockPool(4, UNIT, True, key).chain(seq("c", range(10)), 1)[0]
    assert first("m1") == first("m1") != first("m2")


@pytest.mark.parametrize("shared,hit", [(6, 4), (8, 8), (9, 8), (12, 12), (13, 12)])
def test_a_prefix_is_taken_in_whole_blocks_and_its_chunk_starts_after_it(shared, hit):
    """Prompts of 13 tokens sharing their first `shared`: inside a block the hit stops at the
    block before; exactly on a boundary it takes it; the whole prompt leaves its last token
    (and so its partial last block) to compute."""
    state = cached_state()
    prefill(state, seq("a", range(13)))
    b = seq("b", [*range(shared), *range(100, 113 - shared)])
    state.add(b)
    run = Run(prefill=[(b, 13)])
    state.launch(run)
    assert (b.cached_tokens, b.computed, run.prefill) == (hit, hit, [(b, 13 - hit)])
    assert run.sampling() == [b]
    state.apply(run)
    assert b.computed == 13 and b.generated == 1


def test_a_whole_prompt_of_full_blocks_recomputes_its_last_block():
    state, a, b = alike(8)
    assert b.cached_tokens == 4 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert b.block_hashes == a.block_hashes  # its own copy of block 1 stays uncached
    assert b.blocks[1] not in state.device_kv.pool.cached()


def test_shared_blocks_are_counted_once_and_references_return_to_zero():
    state = cached_state()
    a, b, c = seq("a", range(9)), seq("b", range(9)), seq("c", [*range(8), 50])
    prefill(state, a)
    prefill(state, b, c)
    pool = state.device_kv.pool
    assert [pool.refs(x) for x in a.blocks] == [3, 3, 1]
    assert state.device_kv.used == (2 + 3) * UNIT  # a's 3 blocks, and b's and c's own last
    state.apply(Run(), finished=["a", "b"])
    assert [pool.refs(x) for x in c.blocks] == [1, 1, 1]
    state.abort("c")
    assert pool.num_held == 0 and state.device_kv.used == 0
    assert pool.num_free == state.device_kv.num_blocks and len(pool.unreferenced_cached()) == 2
    assert (pool.queried_tokens, pool.hit_tokens) == (27, 16)


def test_a_sequence_whose_prefix_its_step_computes_waits_for_the_next_step():
    """In one run, or in a second run launched before the first is applied (a pipelined
    step): the later sequence leaves the run, first in line, and the next step finds the
    blocks cached. One whose next block nobody computes in the step is not deferred."""
    state = cached_state(slots=8)
    a, b, x = seq("a", range(9)), seq("b", range(9)), seq("x", range(50, 59))
    run = prefill(state, a, b, x)
    assert run.prefill == [(a, 9), (x, 9)] and list(state.waiting) == [b]
    assert b.location is Location.WAITING and b.blocks == []
    run = prefill(state, b)
    assert b.cached_tokens == 8 and b.blocks[:2] == a.blocks[:2] and run.prefill == [(b, 1)]
    c, d = seq("c", range(20, 29)), seq("d", range(70, 79))
    e = seq("e", range(20, 29))
    state.add(c, d, e)
    first, second = Run(prefill=[(c, 9)]), Run(prefill=[(d, 9), (e, 9)])
    state.launch(first)
    state.launch(second)
    assert second.prefill == [(d, 9)] and list(state.waiting) == [e]
    state.apply(first)
    state.apply(second)
    prefill(state, e)
    assert e.cached_tokens == 8 and e.blocks[:2] == c.blocks[:2]


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    """Seven blocks. a's and b's two full blocks are cached; a ends first, then b: the LRU
    is a's last, a's first, b's last, b's first (a chain's tail goes before its head). A new
    sequence takes the three free blocks, then evicts a's last; b's prefix is still found,
    and d's next block evicts a's first."""
    state = cached_state(blocks=7)
    a, b = seq("a", range(8)), seq("b", range(50, 58))
    prefill(state, a)
    prefill(state, b)
    a_blocks, b_blocks = list(a.blocks), list(b.blocks)
    state.apply(Run(), finished=["a", "b"])
    pool = state.device_kv.pool
    assert pool.unreferenced_cached() == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert state.device_kv.pool.num_free == 7 and state.device_kv.used == 0
    free = list(reversed(pool.free_list()))  # in the order they are given out
    c = seq("c", range(100, 115))
    prefill(state, c)
    assert c.blocks == [*free, a_blocks[1]] and pool.evictions == 1
    assert pool.unreferenced_cached() == [a_blocks[0], *reversed(b_blocks)]
    d = seq("d", range(50, 59))
    prefill(state, d)
    assert d.cached_tokens == 8 and d.blocks == [*b_blocks, a_blocks[0]]
    assert pool.evictions == 2 and pool.unreferenced_cached() == []


def test_a_block_someone_holds_is_never_given_out():
    state = cached_state(blocks=3)
    a = seq("a", range(8))
    prefill(state, a)
    b = seq("b", range(8))
    state.add(b)
    state.launch(Run(prefill=[(b, 8)]))  # hits a's first block, takes the last free one
    assert b.blocks[0] == a.blocks[0] and state.device_kv.pool.num_free == 0
    c = seq("c", range(30, 34))
    state.add(c)
    with pytest.raises(RuntimeError, match="overfilled"):
        state.launch(Run(prefill=[(c, 4)]))


def test_a_prefix_revives_cached_blocks_only_as_far_as_the_pool_has_room():
    """Eight blocks: c holds 3, a's 4 full blocks are cached and held by nobody (so they
    count free, with one free block: 5). A 16-token chunk of b (charged 4 blocks from
    position 0) over a's whole 16-token prefix would take those 4 and 4 new ones: it revives
    the one block the run leaves spare and 3 of its own charge, and computes one block."""
    state = cached_state(blocks=8)
    prefill(state, seq("c", range(100, 112)))
    a = seq("a", range(17))
    prefill(state, a)
    a_blocks = list(a.blocks)
    state.apply(Run(), finished=["a"])
    assert state.device_kv.pool.num_free == 5
    b = seq("b", [*range(16), *range(200, 212)])
    state.add(b)
    run = Run(prefill=[(b, 16)])
    state.launch(run)
    assert (b.cached_tokens, run.prefill) == (16, [(b, 4)])
    assert b.blocks[:4] == a_blocks[:4] and state.device_kv.pool.num_free == 0


def test_a_small_chunk_revives_a_prefix_from_the_room_the_run_leaves():
    """A 2-token chunk (charged one block) in a pool with room to spare finds the whole
    cached prefix, which nobody holds."""
    state = cached_state(blocks=16)
    a = seq("a", range(13))
    prefill(state, a)
    state.apply(Run(), finished=["a"])
    b = seq("b", range(13))
    state.add(b)
    run = Run(prefill=[(b, 2)])
    state.launch(run)
    assert (b.cached_tokens, run.prefill) == (12, [(b, 1)])
    assert state.device_kv.pool.num_free == 16 - 4


def test_a_released_prefix_is_found_again_and_a_switch_keeps_it():
    """A recompute preemption keeps its full blocks cached: coming back it recomputes only
    its last block (outputs included). A re-shard moves the held and the cached blocks: the
    cache survives it."""
    state = cached_state()
    a = seq("a", range(7), max_tokens=8)
    prefill(state, a)
    for token in (7, 8):
        a.output_token_ids.append(token)
        state.apply(Run(decode=[a]))
    assert a.computed == 9 and len(a.block_hashes) == 2
    state.apply(Preempt([a], "recompute"))
    assert a.blocks == [] and len(state.device_kv.pool.unreferenced_cached()) == 2
    a.output_token_ids.append(9)
    run = Run(prefill=[(a, a.to_prefill)])
    state.launch(run)
    assert (a.cached_tokens, run.prefill[0][1]) == (8, 2)
    state.apply(run)
    z = seq("z", range(40, 45))
    prefill(state, z)
    state.apply(Run(), finished=["z"])
    lru = state.device_kv.pool.unreferenced_cached()
    assert len(lru) == 1
    cached = state.device_kv.pool.cached()
    assert state.device_kv.pool.data_blocks() == sorted({*a.blocks, *lru})
    state.apply(Switch("decode"))
    assert state.device_kv.pool.unreferenced_cached() == lru
    assert state.device_kv.pool.cached() == cached


def test_outputs_are_cached_once_their_tokens_are_known():
    state = cached_state()
    a = seq("a", range(3), max_tokens=8)
    prefill(state, a)
    state.apply(Run(decode=[a]))  # position 3 written, but its token is not back yet
    assert a.computed == 4 and a.block_hashes == []
    a.output_token_ids += [3, 4]
    state.apply(Run(decode=[a]))
    assert len(a.block_hashes) == 1 and a.blocks[0] in state.device_kv.pool.cached()


def test_a_sequence_back_from_the_host_tier_hashes_its_blocks_at_its_first_decode():
    """Swapped out, a sequence forgets its blocks' hashes; swapped back in, its first decode
    (its KV is in the new blocks by then) takes them again, as a decode that fills a block."""
    state = cached_state()
    a = seq("a", range(9), max_tokens=8)
    prefill(state, a)
    a.output_token_ids.append(9)
    state.apply(Preempt([a], "swap"))
    state.apply(SwapIn([a]))
    assert a.block_hashes == [] and a.computed == 9
    state.apply(Run(decode=[a]))
    assert a.block_hashes == a.hash_chain[:2]


def test_plain_seqinfos_and_caching_off_never_hit():
    state = cached_state()
    for name in ("x", "y"):
        info = SeqInfo(name, 9, 2)
        state.add(info)
        state.apply(Run(prefill=[(info, 9)]))
        assert info.cached_tokens == 0
    off = SchedulerState(64, 4, device_unit=UNIT)
    prefill(off, seq("a", range(9)))
    b = seq("b", range(9))
    prefill(off, b)
    assert b.cached_tokens == 0 and off.device_kv.pool.cached() == {}


# ---- the property test ----------------------------------------------------------------------

def chain(token_ids: tuple) -> bytes:
    digest = ROOT
    for start in range(0, len(token_ids), UNIT):
        digest = block_hash(digest, token_ids[start:start + UNIT], extra_key_digest(None))
    return digest


POLICY_NAMES = ["prefill_first", "seesaw", "decode_first", "tdpipe", "throttle"]


def draw_policy(name: str, rng: random.Random):
    """`name` with drawn options (a prefill budget; the pipelined ones 1 or 2 micro-batches
    a step; tdpipe's predictor off and its switch back at a fixed finish ratio)."""
    opts = {"max_prefill_tokens": rng.choice([8, 24])}
    if name == "prefill_first":
        opts["preempt_mode"] = rng.choice(["swap", "recompute"])
    elif name in ("tdpipe", "throttle"):
        opts["pipeline_depth"] = rng.choice([1, 2])
    if name == "tdpipe":
        opts.update(predictor=None, finish_ratio=0.5)
    return make_policy(name, **opts)


class Driver:
    """A pure-Python engine: requests with shared prefixes arrive at random, run under a
    policy (`policy`, prefill_first by default; each one's own actions: seesaw's switches,
    its prefills parked in the host tier and swapped back in, tdpipe's and throttle's
    micro-batches), are preempted (both modes), aborted and finished at random; their output
    tokens come back at once or a step late. It keeps what each block holds (`holds`: the
    context prefix ending with a block, once its KV is fully written) and what each host-tier
    group holds (`host_holds`, moved as the state's `take_moves` say) to check both tiers.
    The pool (12 or 24 blocks), the host tier (none, one or two groups, 8 or 40 blocks) and
    its group size (1 or 2 blocks) are drawn, so blocks go to the host tier and come back,
    and a full tier evicts groups while blocks are copied back. With a sliding `window`
    every run is launched and its KV written before it is applied (as the engine's step
    writes it before the blocks behind the window are given back)."""

    def __init__(self, seed: int, caching: bool, policy: str = "prefill_first",
                 window: int = 0, samples: bool = False):
        self.rng = rng = random.Random(seed)
        group = rng.choice([1, 2])
        host = rng.choice([0, group, 2 * group, 8, 40])  # one or two groups: a full tier
        if policy == "seesaw":  # it parks prefills in the host tier: room for a sequence
            host = max(host, 10)
        self.state = SchedulerState(rng.choice([12, 24]) * UNIT, 6, host * UNIT,
                                    host_unit=group * UNIT,
                                    device_unit=UNIT, prefix_caching=caching, window=window)
        self.policy = draw_policy(policy, rng)
        # tdpipe and throttle preempt by recompute only and never swap in: so does this
        # driver; seesaw and decode_first decode what they swap in (seesaw parks only whole
        # prefills): only prefill_first takes back a prefill swapped out part-way
        self.swaps = policy not in ("tdpipe", "throttle")
        self.swaps_prefills = policy == "prefill_first"
        # a second run rides along only where the policy forms runs of idle sequences (the
        # engine's pipelined steps; prefill_first's, for the deferral of a shared prefix)
        self.rides = policy in ("prefill_first", "tdpipe", "throttle")
        prefixes = [[rng.randrange(30) for _ in range(rng.randint(1, 14))] for _ in range(3)]
        self.arrivals = []
        self.truth: dict[str, list[int]] = {}
        for i in range(30):
            prompt = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
            out = rng.randint(1, 12)
            self.arrivals.append(seq(f"r{i}", prompt, out))
            self.truth[f"r{i}"] = prompt + [rng.randrange(30) for _ in range(out)]
        if samples:
            self.draw_samples(random.Random(seed + 1000))
        self.late: list[Sequence] = []  # sampled, its token not received yet
        self.holds: dict[int, tuple] = {}
        self.host_holds: dict[int, list[tuple]] = {}  # group -> what its blocks hold

    def draw_samples(self, rng: random.Random) -> None:
        """Give half the requests 1 to 3 more samples (n = 2..4) with outputs of their own,
        as many as the device store could hold together."""
        kv = self.state.device_kv
        for parent in self.arrivals:
            end = parent.prompt_len + parent.max_output_len
            most = (kv.capacity - kv.blocks.size(end)) // max(kv.fork_size(parent, end), 1)
            for k in range(1, min(rng.randint(1, 3), most) + 1 if rng.random() < 0.5 else 1):
                sid, out = f"{parent.seq_id}.{k}", rng.randint(1, 12)
                parent.forks.append(seq(sid, parent.prompt_token_ids, out))
                self.truth[sid] = parent.prompt_token_ids + [rng.randrange(30) for _ in range(out)]

    def move(self) -> None:
        """Carry out the host tier's block moves, in order, as the engine's KV manager does,
        then the copies on write of forked samples (a block a copy writes may have been
        evicted for it: read out first)."""
        for m in self.state.host_kv.take_moves():
            if isinstance(m, Spill):
                self.host_holds[m.group] = [self.holds[b] for b in m.blocks]
            elif isinstance(m, Fetch):
                # held: by its new holder, and by any sequence admitted after it that shares it
                assert self.state.device_kv.pool.refs(m.block) >= 1
                self.holds[m.block] = self.host_holds[m.group][m.index]
            else:
                del self.host_holds[m.group]
        for _, copy in self.state.device_kv.take_copies():
            assert self.state.device_kv.pool.refs(copy) >= 1
            self.holds.pop(copy, None)  # a partly filled block: nothing cached in it

    def run(self) -> None:
        while self.arrivals or self.state.has_work():
            self.receive()
            roll = self.rng.random()
            if self.arrivals and (roll < 0.3 or not self.state.has_work()):
                self.state.add(self.arrivals.pop(0))
            elif roll < 0.35:
                self.abort()
            elif roll < 0.42 and self.state.device:
                self.preempt()
            else:
                self.step()
            self.check()

    def receive(self) -> None:
        for s in self.late:
            s.output_token_ids.append(self.truth[s.seq_id][s.num_tokens])
        self.late = []

    def abort(self) -> None:
        live = [*self.state.waiting, *self.state.device.values(), *self.state.host.values()]
        if live:
            self.state.abort(self.rng.choice(live).seq_id)

    def preempt(self) -> None:
        victim = self.rng.choice(list(self.state.device.values()))
        swap = self.swaps and (self.swaps_prefills or not victim.in_prefill) and \
            self.state.host_kv.size(victim.computed) <= self.state.host_kv.free
        self.state.apply(Preempt([victim], "swap" if swap and self.rng.random() < 0.5
                                 else "recompute"))
        self.move()

    def step(self) -> None:
        action = self.policy.schedule(self.state)
        if action is None:
            raise AssertionError("stalled")
        if not isinstance(action, Run):
            self.state.apply(action)
            self.move()
            if action.kind.value == "swap_in":  # the host copy lands in the new blocks
                for s in action.seqs:
                    self.write(s, 0, s.computed, landing=True)
            return
        runs = [action]
        # engine-like: launch (a second run rides along), apply; a run whose prefills go to
        # the host tier is launched first (its KV is written in the blocks it takes there)
        if self.rng.random() < 0.5 or self.early(action):
            self.state.launch(action)
            second = self.policy.schedule(self.state) if self.rides else None
            # (not beside a run to the host tier: its room is only charged as it is applied)
            if isinstance(second, Run) and self.rng.random() < 0.5 and not (
                    action.prefill_to_host or second.prefill_to_host):
                self.state.launch(second)
                runs.append(second)
            self.move()
        for run in runs:
            self.apply(run)

    def early(self, run: Run) -> bool:
        """Whether `run`'s KV is written as it is launched: before its prefills leave the
        device, its window moves on, or its samples fork and share its prompt's blocks."""
        return bool(run.prefill_to_host or self.state.device_kv.blocks.window
                    or any(s.forks for s, _ in run.prefill))

    def apply(self, run: Run) -> None:
        before = {s.seq_id: s.generated for s in run.seqs}
        early = self.early(run)  # written as launched
        if early:  # before its prefills leave the device, or its window moves on
            for s, n in run.prefill:
                self.write(s, s.computed, s.computed + n)
            for s in run.decode:
                self.write(s, s.computed, s.computed + 1)
        self.state.apply(run)
        self.move()
        for s, n in run.prefill if not early else ():
            self.write(s, s.computed - n, s.computed)  # `n` trimmed past the cached prefix
        for s in run.decode if not early else ():
            self.write(s, s.computed - 1, s.computed)
        sampled = [s for s in run.seqs if s.generated > before[s.seq_id]]
        ended = [s.seq_id for s in sampled
                 if s.generated >= s.max_output_len or self.rng.random() < 0.05]
        for s in sampled:
            if s.seq_id in ended:
                continue
            if self.rng.random() < 0.5:  # its token comes back with the next step
                self.late.append(s)
            else:
                s.output_token_ids.append(self.truth[s.seq_id][s.num_tokens])
        finished = self.state.finish(ended)
        self.policy.landed(run, finished, self.state)

    def write(self, s: Sequence, start: int, stop: int, landing: bool = False) -> None:
        """KV rows [start, stop) of `s` written: never into a block someone else holds
        (rows behind its window, FREED, are dropped: a swap-in's), but for a swap-in
        `landing`: the samples that forked from it as it came back share its prompt's
        blocks, and read them only once it has landed (the engine waits for it)."""
        truth = self.truth[s.seq_id]
        samples = {c.seq_id for c in self.state.device.values()
                   if c.seq_id.startswith(f"{s.seq_id}.")} if landing else set()
        for pos in range(start, stop):
            block = s.blocks[pos // UNIT]
            if block == FREED:
                continue
            sharing = sum(block in self.state.device[c].blocks for c in samples)
            assert self.state.device_kv.pool.refs(block) == 1 + sharing, "wrote a shared block"
            if pos % UNIT == 0:
                self.holds.pop(block, None)
            if pos % UNIT == UNIT - 1:
                self.holds[block] = tuple(truth[:pos + 1])

    def check(self) -> None:
        state, pool = self.state, self.state.device_kv.pool
        holders = Counter(b for s in state.device.values() for b in s.blocks if b != FREED)
        free, lru = pool.free_list(), pool.unreferenced_cached()
        referenced = [b for b in range(state.device_kv.num_blocks) if pool.refs(b)]
        assert sorted(free + lru + referenced) == list(range(state.device_kv.num_blocks))
        assert all(pool.refs(b) == holders[b] for b in range(state.device_kv.num_blocks))
        assert all(len(set(s.blocks) - {FREED}) == len(s.blocks) - s.behind
                   for s in state.device.values())
        assert state.device_kv.used == len(holders) * UNIT == pool.num_held * UNIT
        assert all(len(s.blocks) == -(-s.computed // UNIT) for s in state.device.values())
        assert not any(s.blocks or s.block_hashes
                       for s in [*state.waiting, *state.host.values()])
        cached = pool.cached()
        assert set(lru) <= set(cached) and len(set(cached.values())) == len(cached)
        for block, digest in cached.items():  # a cached block holds the prefix its hash names
            assert chain(self.holds[block]) == digest
        host = state.host_kv.cache
        if host is not None:  # a host group holds the prefixes its hashes name
            assert state.host_kv.used + host.used <= state.host_kv.capacity
            assert set(host.groups()) == set(self.host_holds)
            for group, hashes in host.groups().items():
                assert [chain(h) for h in self.host_holds[group]] == hashes
        for s in state.device.values():  # and a sequence's full blocks hold its own prefix
            truth = tuple(self.truth[s.seq_id])
            first = state.device_kv.blocks.first_live(s.computed)  # the rest: given back
            assert s.blocks[:first] == [FREED] * first and FREED not in s.blocks[first:]
            for i in range(first, s.computed // UNIT):
                assert self.holds.get(s.blocks[i]) == truth[:(i + 1) * UNIT]


HOST_HITS = Counter()


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_keeps_every_block_accounted_and_shared_correctly(seed):
    """Each policy over 4 seeds."""
    driver = Driver(seed, caching=True, policy=POLICY_NAMES[seed % len(POLICY_NAMES)])
    driver.run()
    state, pool = driver.state, driver.state.device_kv.pool
    assert pool.num_held == 0 and state.device_kv.used == 0 and state.host_kv.used == 0
    assert all(pool.refs(b) == 0 for b in range(state.device_kv.num_blocks))
    assert state.device_kv.pool.num_free == state.device_kv.num_blocks and state.num_finished == 30
    assert pool.hit_tokens > 0
    HOST_HITS[seed] = pool.host_hit_tokens


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_with_a_window_gives_back_what_it_passed(seed):
    """As above with every layer reading through a sliding window of 3, 5 or 9 tokens
    (blocks of 4): blocks behind each sequence's window are given back (cached ones to the
    LRU) as it goes, through prefix hits, swaps and both preemptions, every policy; a
    sequence never holds more than ceil(window / 4) + 1 blocks once its run is applied."""
    window = random.Random(seed).choice([3, 5, 9])
    driver = Driver(seed, caching=True, policy=POLICY_NAMES[seed % len(POLICY_NAMES)],
                    window=window)
    bound, most, behind = -(-window // UNIT) + 1, [0], [0]
    check = driver.check

    def check_bounded():
        check()
        for s in driver.state.device.values():
            most[0] = max(most[0], len(s.blocks) - s.behind)
            behind[0] = max(behind[0], s.behind)
            assert len(s.blocks) - s.behind <= bound or s.seq_id in driver.state.busy

    driver.check = check_bounded
    driver.run()
    state = driver.state
    assert state.device_kv.pool.num_held == 0 and state.num_finished == 30
    assert 0 < most[0] <= bound and behind[0] > 0


def test_random_traffic_hits_in_the_host_tier():
    """Some of the seeds above (drawn small pools with a host tier) copy prefixes back."""
    for seed in range(20):
        if seed not in HOST_HITS:
            driver = Driver(seed, caching=True, policy=POLICY_NAMES[seed % len(POLICY_NAMES)])
            driver.run()
            HOST_HITS[seed] = driver.state.device_kv.pool.host_hit_tokens
    assert sum(HOST_HITS.values()) > 0


def test_random_traffic_with_caching_off_hits_nothing():
    driver = Driver(0, caching=False)
    driver.run()
    assert driver.state.device_kv.pool.cached() == {}
    assert driver.state.device_kv.pool.num_free == driver.state.device_kv.num_blocks


def test_evicted_blocks_go_to_the_host_tier_and_come_back():
    """Four device blocks, a host tier of 16 tokens in groups of 2 blocks (8 tokens):
    a's two full blocks, hit by a2 and then evicted together by b, are one group (one
    Spill); c = a's prompt again finds them there: both copied back into new blocks (Fetch),
    counted as host hits, and the host copy stays. A swap-out that needs the host room
    forgets the group."""
    state = SchedulerState(4 * UNIT, 4, 4 * UNIT, host_unit=2 * UNIT, device_unit=UNIT,
                           prefix_caching=True)
    a = seq("a", range(9))
    prefill(state, a)
    a_blocks, a_hashes = list(a.blocks[:2]), list(a.block_hashes)
    state.apply(Run(), finished=["a"])
    prefill(state, seq("a2", [*range(8), 5]))  # hits both
    state.apply(Run(), finished=["a2"])
    assert state.host_kv.take_moves() == []
    prefill(state, seq("b", range(50, 63), max_tokens=3))  # the 2 free blocks, then a's
    assert state.host_kv.take_moves() == [Spill(0, tuple(reversed(a_blocks)))]
    assert state.host_kv.cache.groups() == {0: list(reversed(a_hashes))}
    state.apply(Run(), finished=["b"])
    c = seq("c", range(9))
    run = prefill(state, c)
    moves = state.host_kv.take_moves()  # b's blocks, never hit, are evicted for them: no Spill
    assert [(m.group, m.index, m.block) for m in moves] == [(0, 1, c.blocks[0]),
                                                            (0, 0, c.blocks[1])]
    assert c.cached_tokens == 8 and run.prefill == [(c, 1)] and c.block_hashes == a_hashes
    pool = state.device_kv.pool
    assert pool.host_hit_tokens == 8 and pool.hit_tokens == 16  # a2's on the device, c's here
    assert state.host_kv.cache.groups()[0] == list(reversed(a_hashes))  # the copy stays
    state.apply(Preempt([c], "swap"))  # c's 9 tokens take the tier's 16 (units of 8)
    assert {type(m) for m in state.host_kv.take_moves()} == {Forget}
    assert state.host_kv.cache.used == 0 and state.host_kv.used == 16


def test_blocks_never_hit_are_forgotten_when_evicted_not_spilled():
    """Where nothing is shared nothing goes to the host tier: a's blocks, evicted by b
    before anyone asked for them, cost no device-to-host copy, and c = a's prompt computes
    them again."""
    state = SchedulerState(4 * UNIT, 4, 4 * UNIT, host_unit=2 * UNIT, device_unit=UNIT,
                           prefix_caching=True)
    prefill(state, seq("a", range(9)))
    state.apply(Run(), finished=["a"])
    prefill(state, seq("b", range(50, 63), max_tokens=3))  # evicts a's two blocks
    state.apply(Run(), finished=["b"])
    c = seq("c", range(9))
    prefill(state, c)
    assert state.host_kv.take_moves() == [] and state.host_kv.cache.groups() == {}
    assert state.device_kv.pool.evictions == 4 and state.host_kv.cache.stored_blocks == 0
    assert c.cached_tokens == 0


def test_a_copy_back_that_evicts_a_block_keeps_the_group_it_reads():
    """A host tier of one group (one block): a's block A was hit and evicted to it (group
    0). c, with a's prompt, copies A back into a new device block; taking that block evicts
    B (hit too, so worth spilling), and the room B's group needs must not come from the
    group the copy reads (it used to: the fetch then found nothing, a KeyError). B is not
    kept, A comes back."""
    state = SchedulerState(5 * UNIT, 4, UNIT, host_unit=UNIT, device_unit=UNIT,
                           prefix_caching=True)
    for name, last in (("a", 99), ("a2", 98)):  # a2 hits a's block A
        prefill(state, seq(name, [*range(4), last], max_tokens=3))
        state.apply(Run(), finished=[name])
    b, d = seq("b", [*range(50, 58), 7], 3), seq("d", [*range(50, 58), 8], 3)
    prefill(state, b)
    prefill(state, d)  # hits b's two full blocks
    b_blocks = list(b.blocks[:2])
    state.apply(Run(), finished=["b", "d"])
    prefill(state, seq("g", range(70, 81), 3))  # the 2 free blocks, then evicts A
    assert list(state.host_kv.cache.groups()) == [0] and state.device_kv.pool.free_list() == []
    state.host_kv.take_moves()
    c = seq("c", [*range(4), 97], 3)
    prefill(state, c)
    assert c.cached_tokens == UNIT and c.blocks[0] == b_blocks[1]  # B's block, evicted
    assert state.host_kv.take_moves() == [Fetch(0, 0, c.blocks[0]), Forget(0),
                                          Spill(1, (b_blocks[0],))]
    assert c.blocks[1] == b_blocks[0] and list(state.host_kv.cache.groups()) == [1]


def test_each_block_is_hashed_once(monkeypatch):
    """A prompt of 3 full blocks and a bit, prefilled in two chunks (each launched, then
    applied: the deferral check and the cache both ask for the hashes), then decoded into a
    fourth full block: 4 hashes, each computed once (`SeqInfo.hash_chain`)."""
    import jaxpipe.scheduler.prefix_cache as prefix_cache

    calls = []
    real = prefix_cache.block_hash
    monkeypatch.setattr(prefix_cache, "block_hash", lambda *a: calls.append(a) or real(*a))
    state = cached_state()
    s = seq("a", range(13), max_tokens=8)
    state.add(s)
    for run in (Run(prefill=[(s, 6)]), Run(prefill=[(s, 7)]), *(Run(decode=[s]),) * 3):
        state.launch(run)
        state.apply(run)
        if s.generated > len(s.output_token_ids):
            s.output_token_ids.append(100 + s.generated)
    assert s.computed == 16 and len(s.block_hashes) == 4 and s.hash_chain == s.block_hashes
    assert len(calls) == 4
    assert [c[1] for c in calls] == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12)),
                                     [12, 101, 102, 103]]


def test_a_chain_stops_at_the_first_block_with_a_token_not_back():
    """`chain` hashes as far as token ids are known, then goes on from there once more are."""
    pool = BlockPool(8, UNIT, True)
    s = seq("a", range(6), max_tokens=8)
    s.generated = 4  # sampled, one output token back so far
    s.output_token_ids = [6]
    assert len(pool.chain(s, 3)) == 1  # tokens 4..7: 7 is not back
    s.output_token_ids += [7, 8, 9]
    assert pool.chain(s, 3) == [chain(tuple(range(4 * (i + 1)))) for i in range(2)]


def test_under_seesaw_samples_wait_in_the_host_tier_and_fork_as_their_prompt_comes_back():
    """A 10-token prompt of n = 3 (blocks of 4) prefilled into the host tier: its samples
    hold nothing meanwhile; its swap-in reserves their slots and a block each (to compute
    the last prompt token in) and they fork there, sharing its 2 full blocks and copying the
    third; seesaw's decode step carries their one-token rows beside its decode. A prompt
    whose first sample ends in the host tier sends its samples to prefill it themselves."""
    state, policy = cached_state(slots=6), make_policy("seesaw")
    parent = seq("p", range(10), max_tokens=5)
    parent.forks = [seq(f"p.{i}", range(10), max_tokens=5) for i in (1, 2)]
    state.add(parent)
    run = policy.schedule(state)
    assert run.prefill == [(parent, 10)] and run.prefill_to_host
    state.launch(run)
    state.apply(run)
    assert list(state.host) == ["p"] and len(parent.forks) == 2 and not state.waiting
    assert state.device_kv.pool.num_held == 0
    state.apply(policy.schedule(state))  # the switch to decode
    assert state.device_kv.resume(parent) == 3 * UNIT + 2 * UNIT
    assert state.device_kv.comebacks(parent) == 3
    swap = policy.schedule(state)
    assert swap == SwapIn([parent])
    state.apply(swap)
    children = [state.device["p.1"], state.device["p.2"]]
    assert not parent.forks and [c.computed for c in children] == [9, 9]
    assert all(c.blocks[:2] == parent.blocks[:2] and c.blocks[2] != parent.blocks[2]
               for c in children)
    assert state.device_kv.take_copies() == [(parent.blocks[2], c.blocks[2]) for c in children]
    step = policy.schedule(state)
    assert step.prefill == [(c, 1) for c in children] and step.decode == [parent]
    state.launch(step)
    state.apply(step)
    assert [c.generated for c in children] == [1, 1] and not any(c.in_prefill for c in children)
    state.finish(["p", "p.1", "p.2"])
    ended = seq("q", range(20, 30), max_tokens=5)
    ended.forks = [seq("q.1", range(20, 30), max_tokens=5)]
    state.add(ended)
    state.apply(policy.schedule(state))  # the switch back to prefill
    run = policy.schedule(state)
    state.launch(run)
    state.apply(run, finished=["q"])  # its first token was its last
    assert [s.seq_id for s in state.waiting] == ["q.1"] and not state.host
    assert state.device_kv.pool.num_held == 0 and state.host_kv.used == 0


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_with_n_samples_shares_prompts_and_returns_every_block(seed, window):
    """Requests of n = 2..4 samples among the traffic above (each policy, aborts, both
    preemptions, the host tier, the prefix cache): a request's samples fork from its prompt's
    prefill sharing its full blocks (no block is written while shared: `write` checks) and
    copying the partly filled one; at the end every reference is gone and every sample of
    every request ended exactly once (with its request, if that was aborted before its
    prefill completed). Under seesaw each prefill goes to the host tier: its samples wait
    there with it and fork when it is swapped back in (aborted, preempted and finished in
    the host tier on the way). With a sliding window (5 tokens, blocks of 4) a prompt whose
    window gave blocks back already has its samples prefill it themselves."""
    driver = Driver(seed, caching=True, policy=POLICY_NAMES[seed % len(POLICY_NAMES)],
                    window=window, samples=True)
    everyone = [s for p in driver.arrivals for s in [p, *p.forks]]
    assert len(everyone) > 30
    forked, hosted = Counter(), set()  # (shared, through the host tier); parents kept there
    fork, check = driver.state.device_kv.fork, driver.check

    def counting_fork(parent, child):
        shared = fork(parent, child)
        forked[shared, parent.seq_id in hosted] += 1
        return shared

    def noting_check():
        check()
        hosted.update(s.seq_id for s in driver.state.host.values() if s.forks)

    driver.state.device_kv.fork, driver.check = counting_fork, noting_check
    driver.run()
    state, pool = driver.state, driver.state.device_kv.pool
    assert pool.num_held == 0 and state.device_kv.used == 0 and state.host_kv.used == 0
    assert all(pool.refs(b) == 0 for b in range(state.device_kv.num_blocks))
    assert pool.num_free == state.device_kv.num_blocks
    assert state.num_finished == len(everyone)
    assert all(s.location is Location.FINISHED for s in everyone)
    if window:
        return
    if driver.policy.name == "seesaw":  # every fork comes back from the host tier
        assert forked[True, True] > 0 and not forked[True, False] + forked[False, False]
    else:
        assert forked[True, False] > 0
