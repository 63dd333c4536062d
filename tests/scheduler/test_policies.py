"""The three policies driven by a pure-Python executor: every request finishes exactly once
with all its tokens, KV tiers are never overfilled, seesaw switches rarely, preemption loses
nothing."""

from __future__ import annotations

import math

import pytest

from jaxpipe.scheduler import Driver, Kind, Location, Run, SchedulerState, SeqInfo, make_policy
from scheduler.helpers import Trace, TraceExecutor, make_seqs, prefill_to_decode, run_policy

DEVICE_KV, SLOTS, HOST_KV = 200, 8, 300

CONFIGS = {
    "seesaw": ("seesaw", {}),
    "prefill_first": ("prefill_first", {"chunked": False}),
    "prefill_first_swap": ("prefill_first", {"chunked": False, "preempt_mode": "swap"}),
    "prefill_first_chunked": ("prefill_first", {"max_prefill_tokens": 48}),
    "prefill_first_chunked_two_layouts": ("prefill_first", {"two_layouts": True}),
    "prefill_first_two_layouts": ("prefill_first", {"chunked": False, "two_layouts": True}),
    "decode_first": ("decode_first", {}),
    "decode_first_chunked": ("decode_first", {"max_prefill_tokens": 48}),
    "decode_first_two_layouts": ("decode_first", {"two_layouts": True}),
}


def test_make_policy_names_the_accepted_policies():
    with pytest.raises(ValueError, match="decode_first.*prefill_first.*seesaw"):
        make_policy("fcfs")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="preempt_mode"):
        make_policy("prefill_first", preempt_mode="drop")


def test_state_refuses_a_sequence_longer_than_the_device_store():
    state = SchedulerState(device_kv_tokens=100, max_device_seqs=4)
    with pytest.raises(ValueError, match="needs up to 101 tokens"):
        state.add(SeqInfo("long", prompt_len=90, max_output_len=11))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_request_finishes_once_with_all_its_tokens(config, seed):
    name, options = CONFIGS[config]
    seqs = make_seqs(40, seed)
    state, trace = run_policy(make_policy(name, **options), seqs, DEVICE_KV, SLOTS, HOST_KV)
    assert sorted(trace.finished) == list(range(40))  # each id exactly once
    assert all(s.location is Location.FINISHED for s in seqs)
    assert all(s.generated == s.max_output_len for s in seqs)
    assert state.device_kv.used == 0 and state.host_kv.used == 0
    assert trace.max_host_used <= HOST_KV and trace.max_device_used <= DEVICE_KV


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_over_four_stages_every_request_finishes_once_and_the_pipeline_fills(config):
    """The driver splits each policy's runs over 4 stages (host ticks): every request still
    ends once with all its tokens, no decode goes before a prompt's last chunk (a prompt's
    chunks may land apart from the rest of its batch), and up to 4 micro-batches fly."""
    name, options = CONFIGS[config]
    seqs = make_seqs(40, 0)
    state, trace = run_policy(make_policy(name, **options), seqs, DEVICE_KV, SLOTS, HOST_KV,
                              stages=4)
    assert sorted(trace.finished) == list(range(40))
    assert all(s.generated == s.max_output_len for s in seqs)
    assert state.device_kv.used == 0 and state.host_kv.used == 0
    assert trace.max_in_flight == 4


@pytest.mark.parametrize("config", sorted(c for c in CONFIGS if "chunked" not in c))
def test_block_accounting_charges_whole_blocks_and_preempts_growth(config):
    """Tiers in 16-token blocks, a device store of 12 blocks for 8 slots: sequences that
    cross a block boundary need a new block, so growth preempts; nothing overfills (the
    helper checks every step that each sequence is charged whole blocks)."""
    name, options = CONFIGS[config]
    seqs = make_seqs(30, seed=3, prompt=(10, 40), output=(10, 50))
    _, trace = run_policy(make_policy(name, **options), seqs, 192, SLOTS, HOST_KV, unit=16)
    assert sorted(trace.finished) == list(range(30))
    assert all(s.generated == s.max_output_len for s in seqs)
    assert trace.max_device_used <= 192 and trace.max_host_used <= HOST_KV
    if name == "prefill_first":
        assert trace.preempted > 0


def test_tight_device_memory_forces_preemption_and_loses_nothing():
    seqs = make_seqs(30, seed=7, prompt=(20, 40), output=(30, 60))
    for mode in ("recompute", "swap"):
        fresh = [SeqInfo(s.seq_id, s.prompt_len, s.max_output_len) for s in seqs]
        policy = make_policy("prefill_first", preempt_mode=mode)
        _, trace = run_policy(policy, fresh, device_kv=120, slots=8, host_kv=400)
        assert trace.preempted > 0, mode
        assert sorted(trace.finished) == list(range(30))
        assert all(s.generated == s.max_output_len for s in fresh)
        assert (trace.swapped_in > 0) == (mode == "swap")


@pytest.mark.parametrize("seed", range(4))
def test_seesaw_switches_rarely(seed):
    """The paper's regime: a host tier much larger than the device store (when the decode batch
    is parked in the host tier, each prefill phase adds host - device tokens of new prompts)."""
    host_kv = 2000
    seqs = make_seqs(200, seed)
    _, trace = run_policy(make_policy("seesaw"), seqs, DEVICE_KV, SLOTS, host_kv)
    bound = math.ceil(sum(s.prompt_len for s in seqs) / host_kv) + 1
    assert 2 <= prefill_to_decode(trace) <= bound
    baseline = make_policy("prefill_first", chunked=False, two_layouts=True)
    _, base_trace = run_policy(baseline, make_seqs(200, seed), DEVICE_KV, SLOTS, host_kv)
    assert len(trace.switches) < len(base_trace.switches)


def test_seesaw_alternates_phases_and_prefills_into_the_host_tier():
    seqs = make_seqs(30, seed=3)
    state = SchedulerState(DEVICE_KV, SLOTS, HOST_KV)
    state.add(*seqs)
    first = make_policy("seesaw").schedule(state)
    assert isinstance(first, Run) and first.prefill_to_host and not first.decode
    _, trace = run_policy(make_policy("seesaw"), make_seqs(30, seed=3), DEVICE_KV, SLOTS,
                          HOST_KV)
    assert trace.switches[0] == "decode"
    assert all(a != b for a, b in zip(trace.switches, trace.switches[1:], strict=False))


def test_seesaw_refuses_a_host_tier_smaller_than_a_prompt():
    state = SchedulerState(DEVICE_KV, SLOTS, host_kv_tokens=10)
    state.add(SeqInfo("p", prompt_len=50, max_output_len=5))
    with pytest.raises(ValueError, match="host KV tier of 10 tokens"):
        make_policy("seesaw").schedule(state)


class Watched(TraceExecutor):
    """A `TraceExecutor` that hands each run to `check(run, state)` as it is launched and
    each new policy decision's state to `before(state)`."""

    def __init__(self, check, before=lambda state: None):
        super().__init__(Trace())
        self.check, self.before = check, before

    def scheduled(self, start, state):
        self.before(state)

    def launch(self, runs, state):
        self.check(runs[0], state)
        return super().launch(runs, state)


def drive_watched(policy, seqs, executor) -> SchedulerState:
    state = SchedulerState(DEVICE_KV, SLOTS)
    state.add(*seqs)
    Driver(policy, state, executor).run()
    return state


def test_decode_first_admits_only_into_an_empty_device():
    decoded_since_empty = False

    def before(state):
        nonlocal decoded_since_empty
        decoded_since_empty = decoded_since_empty and bool(state.device)

    def check(run, state):
        nonlocal decoded_since_empty
        assert not (run.prefill and decoded_since_empty), "admitted while a batch was decoding"
        decoded_since_empty = decoded_since_empty or bool(run.decode)

    state = drive_watched(make_policy("decode_first"), make_seqs(30, seed=5),
                          Watched(check, before))
    assert state.num_finished == 30


def test_chunked_prefill_mixes_decode_and_respects_the_budget():
    mixed = 0

    def check(run, state):
        nonlocal mixed
        assert run.prefill_tokens + len(run.decode) <= 40
        mixed += bool(run.prefill and run.decode)

    executor = Watched(check)
    state = drive_watched(make_policy("prefill_first", chunked=True, max_prefill_tokens=40),
                          make_seqs(20, seed=2, prompt=(30, 60), output=(5, 20)), executor)
    assert mixed > 0 and state.num_finished == 20
    assert set(executor.trace.actions) <= {"run", "preempt"}


def test_apply_refuses_to_overfill_the_host_tier():
    state = SchedulerState(DEVICE_KV, SLOTS, host_kv_tokens=30)
    seq = SeqInfo("a", prompt_len=40, max_output_len=5)
    state.add(seq)
    with pytest.raises(RuntimeError, match="host KV tier overfilled"):
        state.apply(Run(prefill=[(seq, 40)], prefill_to_host=True))


def test_kinds_are_distinct():
    assert len({k.value for k in Kind}) == 4
