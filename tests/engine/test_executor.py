"""The engine driven by each scheduling policy on one device, with a host KV tier small enough
that sequences really move: out to the host after prefill, back into *other* slots, parked,
recomputed, aborted mid-way. Tokens must equal a reference run in which every request keeps its
own slot from start to end (greedy, penalties and seeded sampling: all must follow a sequence
wherever it goes). The model is conftest's two-layer random one with SmolLM2's tokenizer: the
reference is the engine itself, and the prompts' lengths (which decide every move) are SmolLM2's."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import ENGINE_KWARGS
from prefix_workload import host_holds_no_sequence

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.scheduler import Kind, Preempt, make_policy

PROMPTS = [f"{s} (case {i}):" for i, s in enumerate([
    "The capital of France is", "Water boils at", "A list of fruits: apple, banana,",
    "In 1492, Columbus", "The opposite of hot is", "def add(a, b):",
    "Roses are red, violets are", "The largest planet in our solar system is", "Once upon a time",
    "My favourite colour is"])]
KWARGS = {**ENGINE_KWARGS, "max_model_len": 128}


@pytest.fixture(scope="module")
def kwargs(tiny_smollm2) -> dict:
    """The engines' settings: the tiny model, contexts of 128 tokens."""
    return {**KWARGS, "model": tiny_smollm2}


def params() -> list[SamplingParams]:
    """Greedy, penalised and seeded-sampled requests of different lengths."""
    out = []
    for i in range(len(PROMPTS)):
        n = 6 + (i * 5) % 9
        if i % 3 == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        elif i % 3 == 1:
            out.append(SamplingParams(temperature=0.0, max_tokens=n, repetition_penalty=1.4,
                                      presence_penalty=0.6, frequency_penalty=0.4,
                                      ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=n,
                                      ignore_eos=True))
    return out


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engine(kwargs):
    """3 slots for 10 requests; the host tier holds about three prompts. Shared: each test
    sets its policy (the engine is idle between tests)."""
    return Engine(EngineConfig(**{**kwargs, "max_num_seqs": 3}, scheduler="prefill_first",
                               host_kv_tokens=64))


@pytest.fixture(scope="module")
def reference(engine):
    """prefill_first: every request keeps one slot from prefill to its last token (a slot
    holds max_model_len tokens, so nothing is ever preempted or moved)."""
    engine.set_scheduler("prefill_first")
    engine.reset_stats()
    engine.set_overlap(False)  # the synchronous loop: each step lands before the next
    try:
        out = tokens(engine.generate(PROMPTS, params()))
    finally:
        engine.set_overlap(True)
    stats = engine.stats()
    assert stats["swap_out_bytes"] == 0 == stats["preemptions"]
    return out


def test_the_penalties_and_seeds_shape_the_reference(engine, reference):
    """On the tiny random model too, the tests below are not vacuous: every penalised request's
    greedy tokens differ without its penalties (state that failed to follow a sequence would
    change them), and a sampled request's tokens differ under another seed."""
    sp = params()
    plain = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                                 frequency_penalty=0.0) for p in sp]
    plain[2] = dataclasses.replace(sp[2], seed=sp[2].seed + 1)
    engine.set_scheduler("prefill_first")
    got = tokens(engine.generate(PROMPTS, plain))
    assert all(got[i] != reference[i] for i in range(1, len(sp), 3))
    assert got[2] != reference[2]


def run_with(engine, policy: str, overlap: bool = True) -> tuple[list, dict]:
    """(tokens, stats) of all requests under `policy`, stats reset first."""
    engine.set_scheduler(policy)
    engine.reset_stats()
    engine.set_overlap(overlap)
    try:
        return tokens(engine.generate(PROMPTS, params())), engine.stats()
    finally:
        engine.set_overlap(True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("policy", ["seesaw", "prefill_first", "decode_first"])
def test_every_policy_gives_the_reference_tokens(engine, reference, policy, overlap):
    got, stats = run_with(engine, policy, overlap)
    assert got == reference
    assert stats["finished_requests"] == len(PROMPTS)
    assert stats["host_kv_peak"] <= 64 and engine.executor.state.host_kv.used == 0
    assert host_holds_no_sequence(engine)
    if policy == "seesaw":
        assert stats["swap_in_bytes"] == stats["swap_out_bytes"] > 0
        assert stats["to_decode"] >= 3  # the tier holds ~3 prompts: several refills


@pytest.mark.parametrize("policy", ["seesaw", "prefill_first"])
def test_the_host_sampler_gives_the_reference_tokens(engine, reference, policy):
    """Sampled on the host (penalty state kept per slot on the host, following sequences
    through swaps into other slots), with overlap: the host-sampled tokens are fed."""
    engine.runner.set_sampler("host")
    try:
        got, stats = run_with(engine, policy)
    finally:
        engine.runner.set_sampler("device")
    assert got == reference
    assert stats["fed_steps"] > 0
    if policy == "seesaw":
        assert stats["swap_in_bytes"] > 0


class RecomputeOnce:
    """seesaw, except that at its `at`-th decode step it preempts the oldest running
    sequence by recompute (its KV dropped; prompt + outputs prefilled again later)."""

    depth = 1

    def __init__(self, at: int):
        self.inner, self.at, self.decodes, self.victims = make_policy("seesaw"), at, 0, []

    def schedule(self, state):
        action = self.inner.schedule(state)
        if action is not None and action.kind is Kind.RUN and action.decode:
            self.decodes += 1
            if self.decodes == self.at:
                self.victims.append(action.decode[0].seq_id)
                return Preempt([action.decode[0]], "recompute")
        return action

    def landed(self, run, finished, state):
        self.inner.landed(run, finished, state)


def test_recompute_preemption_gives_the_reference_tokens(engine, reference):
    engine.reset_stats()
    engine.executor.policy = policy = RecomputeOnce(at=4)
    try:
        assert tokens(engine.generate(PROMPTS, params())) == reference
    finally:
        engine.set_scheduler("seesaw")
    assert len(policy.victims) == 1 and engine.stats()["preemptions"] >= 1
    # The victim's outputs so far were prefilled again with its prompt.
    assert engine.stats()["prefill_tokens"] > sum(len(engine.tokenizer.encode(p))
                                                  for p in PROMPTS)


def test_abort_in_the_host_tier_frees_it_and_spares_the_others(engine, reference):
    engine.set_scheduler("seesaw")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(), strict=True)]
    while not engine.executor.state.host:
        engine.step()
    victim = next(iter(engine.executor.state.host))
    engine.abort(victim)
    assert victim not in engine.executor.kv.host.entries
    while engine.has_unfinished():
        engine.step()
    outs = [engine.pop_output(i) for i in ids]
    for i, out in zip(ids, outs, strict=True):
        if i == victim:
            assert out.outputs[0].finish_reason == "abort"
        else:
            assert out.outputs[0].token_ids == reference[ids.index(i)]
    assert engine.executor.state.host_kv.used == 0 and host_holds_no_sequence(engine)


def test_abort_during_a_swap_in_leaves_no_staged_copy_and_spares_the_others(engine, reference):
    """A request aborted while the prefetcher brings its KV back: its request is cancelled
    (every request the prefetcher still has is one the KV manager waits for; the aborted
    one's staged copy stayed in the prefetcher's queue, holding device memory), and the
    others' tokens are the reference's."""
    engine.set_scheduler("seesaw")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(), strict=True)]
    kv = engine.executor.kv
    while not kv.pending:
        engine.step()
    victim = next(s for s in engine.executor.state.device.values() if not kv.decodable(s))
    engine.abort(victim.request_id)
    assert kv.prefetcher.pending == kv.pending
    while engine.has_unfinished():
        engine.step()
    outs = {i: engine.pop_output(i).outputs[0] for i in ids}
    assert outs[victim.request_id].finish_reason == "abort"
    assert all(outs[i].token_ids == reference[k] for k, i in enumerate(ids)
               if i != victim.request_id)
    assert kv.prefetcher.pending == kv.prefetcher.staged == 0 and host_holds_no_sequence(engine)


def test_reset_stats_zeroes_the_counters(engine):
    engine.set_scheduler("seesaw")
    engine.generate(PROMPTS[:4], params()[:4])
    assert engine.stats()["transitions"] > 0
    engine.reset_stats()
    stats = engine.stats()
    zero = ("transitions", "swap_out_bytes", "swap_in_bytes", "preemptions", "decode_steps",
            "prefill_seconds", "swap_seconds", "generated_tokens")
    assert all(stats[k] == 0 for k in zero), {k: stats[k] for k in zero}
    assert stats["host_timeline"] == [[0.0, 0]]


def test_set_scheduler_needs_an_idle_engine(engine):
    rid = engine.add_request(PROMPTS[0], params()[0])
    with pytest.raises(RuntimeError, match="idle"):
        engine.set_scheduler("decode_first")
    engine.abort(rid)
    engine.forget(rid)
    with pytest.raises(RuntimeError, match="set_overlap needs an idle engine"):
        rid = engine.add_request(PROMPTS[0], params()[0])
        engine.set_overlap(False)
    engine.abort(rid)
    engine.forget(rid)
    with pytest.raises(ValueError, match="policy knobs"):
        engine.set_scheduler("tdpipe", max_num_seqs=2)
    with pytest.raises(ValueError, match="tdpipe_finish_ratio"):
        engine.set_scheduler("tdpipe", tdpipe_finish_ratio=2.0)
    engine.set_scheduler("decode_first")
    assert engine.executor.policy.name == "decode_first"
    assert engine.config.scheduler == "prefill_first"  # the config is what the engine began with


def test_seesaw_without_a_host_tier_is_refused():
    with pytest.raises(ValueError, match="host KV tier.*prefill_first"):
        EngineConfig(scheduler="seesaw", host_kv_gb=0)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        EngineConfig(scheduler="fcfs")


@pytest.fixture(scope="module")
def tight(kwargs):
    """6 rows on a device KV pool of 128 tokens (8 blocks): the 10 requests need 2 blocks
    each by their end, so running sequences outgrow the pool."""
    return Engine(EngineConfig(**{**kwargs, "max_num_seqs": 6}, kv_cache_tokens=128,
                               scheduler="prefill_first", host_kv_tokens=64))


@pytest.mark.parametrize("policy", ["prefill_first", "seesaw", "decode_first"])
def test_a_pool_smaller_than_the_running_sequences(tight, reference, policy):
    got, stats = run_with(tight, policy)
    assert got == reference
    assert stats["device_kv_capacity"] == 128 and 0 < stats["device_kv_peak"] <= 128
    assert tight.executor.state.device_kv.pool.num_free == 8  # every block back in the pool
    if policy == "prefill_first":  # admits while prompts fit, then the sequences grow
        assert stats["preemptions"] >= 1


def test_a_pool_that_cannot_hold_one_sequence_is_refused(kwargs):
    with pytest.raises(ValueError, match="kv_cache_tokens=64.*max_model_len=128"):
        Engine(EngineConfig(**kwargs, kv_cache_tokens=64))


# ---- overlap: step n + 1 is dispatched before step n's tokens reach the host -----------------


def step_all(engine) -> list[str]:
    """Step until idle; the request id of every token handed back, in order."""
    seen = []
    while engine.has_unfinished():
        seen += [s.request_id for s in engine.step()]
    return seen


def test_a_stop_token_ends_the_request_before_the_step_in_flight(engine, reference):
    """Request 0's stop token arrives in step n while step n + 1, already dispatched,
    decodes it again: that token must be discarded, and nothing else may move."""
    engine.set_scheduler("prefill_first")
    ref = reference[0]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    sp = params()
    sp[0] = SamplingParams(temperature=0.0, max_tokens=len(ref), stop_token_ids=[ref[k]],
                           ignore_eos=True)
    engine.reset_stats()
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, sp, strict=True)]
    seq = engine.executor.state.waiting[0]
    in_flight_at_stop = None
    seen = []
    while engine.has_unfinished():
        seen += [s.request_id for s in engine.step()]
        if seq.is_finished and in_flight_at_stop is None:
            flight = engine.executor._flight
            in_flight_at_stop = flight is not None and seq in flight.sampled
    outs = [engine.pop_output(i) for i in ids]
    assert in_flight_at_stop  # the overlap really had the next step under way
    assert outs[0].outputs[0].token_ids == ref[:k + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert seen.count(ids[0]) == k + 1
    assert [o.outputs[0].token_ids for o in outs[1:]] == reference[1:]
    assert engine.stats()["generated_tokens"] == len(seen) == sum(
        len(o.outputs[0].token_ids) for o in outs)


def test_aborting_a_request_with_a_token_in_flight_frees_it_once(engine, reference):
    engine.set_scheduler("prefill_first")
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, params(), strict=True)]
    victim = engine.executor.state.waiting[1]
    while True:
        engine.step()
        flight = engine.executor._flight
        if flight is not None and victim in flight.sampled and victim.output_token_ids:
            break
    had = list(victim.output_token_ids)
    engine.abort(victim.request_id)
    engine.abort(victim.request_id)  # a second abort is a no-op
    seen = step_all(engine)
    assert victim.request_id not in seen
    outs = {i: engine.pop_output(i) for i in ids}
    assert outs[victim.request_id].outputs[0].token_ids == had
    assert outs[victim.request_id].outputs[0].finish_reason == "abort"
    assert [outs[i].outputs[0].token_ids for i in ids if i != victim.request_id] == [
        r for i, r in zip(ids, reference, strict=True) if i != victim.request_id]
    state = engine.executor.state
    # every slot, once
    assert sorted(state.device_kv._free_slots) == list(range(engine.max_num_seqs))
    assert state.device_kv.pool.num_free == state.device_kv.num_blocks


# ---- TD-Pipe: the predictor learns from each landed run's own finishes -----------------------


def early_text(engine, output: list[int]) -> str:
    """A stop string `output` meets early: the stripped text of one of its first tokens (not
    the very first) that its whole text contains."""
    whole = engine.tokenizer.decode(output)
    for token in output[1:]:
        text = engine.tokenizer.decode([token]).strip()
        if text and text in whole:
            return text
    raise AssertionError(f"no stop string to take from {whole!r}")


def watch_landings(policy) -> list[tuple[list, list]]:
    """Wrap `policy.landed` and its predictor's `observe`; per landing, (the ids of the
    landed run's sequences that ended since the previous landing, the ids the predictor
    learned from). One run lands at a time (one device: one micro-batch a step)."""
    known, ended, calls, learned = {}, set(), [], []
    observe, landed = policy.predictor.observe, policy.landed

    def observing(seq):
        learned.append(seq.seq_id)
        observe(seq)

    def landing(run, finished, state):
        known.update((s.seq_id, s) for s in run.seqs)
        new = {i for i, s in known.items() if s.is_finished} - ended
        ended.update(new)
        start = len(learned)
        landed(run, finished, state)
        calls.append((sorted(s.seq_id for s in run.seqs if s.seq_id in new),
                      sorted(learned[start:])))

    policy.predictor.observe, policy.landed = observing, landing
    return calls


def test_tdpipe_learns_from_exactly_the_sequences_each_run_ended(engine, reference):
    """TD-Pipe with overlap: every third request ends on a stop string the detokenizer worker
    finds (the request is aborted from the scheduler state as a run lands), the others by
    length (freed when the step with their last token is dispatched, a landing early). At
    every landing the predictor learns from exactly the landed run's sequences that ended
    since the previous one; each request at most once, every length-ended one."""
    sp = params()
    stops = {i: early_text(engine, reference[i]) for i in range(0, len(sp), 3)}
    for i, stop in stops.items():
        sp[i] = dataclasses.replace(sp[i], stop=[stop])
    try:
        engine.set_scheduler("tdpipe", tdpipe_finish_ratio=0.5)  # no step-time table to measure
        calls = watch_landings(engine.executor.policy)
        outs = engine.generate(PROMPTS, sp)
    finally:
        engine.set_scheduler("prefill_first")
    assert [o.outputs[0].stop_reason for i, o in enumerate(outs) if i in stops] == \
        list(stops.values())
    lengths = {o.request_id for i, o in enumerate(outs) if i not in stops}
    assert all(o.outputs[0].finish_reason == "length" for o in outs if o.request_id in lengths)
    assert all(expected == learned for expected, learned in calls), calls
    learned = [i for _, ids in calls for i in ids]
    assert len(learned) == len(set(learned)) and lengths <= set(learned)
