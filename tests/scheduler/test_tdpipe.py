"""TD-Pipe's mechanisms on hand-made traces: Algorithm 1's stop point, work stealing after
skewed completions, the intensity switch where the formula says, the learned predictor and
its accumulated error; and the policy over a pipelined executor."""

from __future__ import annotations

import pytest

from jaxpipe.scheduler import Driver, Location, Run, SchedulerState, SeqInfo, make_policy
from jaxpipe.scheduler.predictor import Learned, accumulated_error
from jaxpipe.scheduler.tdpipe import future_usage
from scheduler.helpers import LinearTiming, Trace, TraceExecutor, make_seqs, run_pipelined


def decoding_state(n: int, capacity: int = 100_000, prompt: int = 10, output: int = 50):
    """n sequences on the device past their prefill (prompt tokens of KV each)."""
    state = SchedulerState(device_kv_tokens=capacity, max_device_seqs=1024)
    seqs = [SeqInfo(i, prompt, output) for i in range(n)]
    state.add(*seqs)
    state.apply(Run(prefill=[(s, prompt) for s in seqs]))
    return state, seqs


def test_algorithm_1_stops_where_future_usage_would_exceed_capacity():
    """Prompts of 100 tokens predicted (oracle) to generate 64: each holds 132 tokens at
    decode step 32 and 164 at step 64, so 1000 tokens of KV take 6 (984), not 7 (1148),
    although 9 prompts fit the store right now (9 x 101 = 909)."""
    state = SchedulerState(device_kv_tokens=1000, max_device_seqs=64)
    state.add(*(SeqInfo(i, 100, 64) for i in range(10)))
    assert future_usage(state, [(s, 64) for s in list(state.waiting)[:6]], (32, 64, 96)) == \
        [6 * 132, 6 * 164, 0]
    policy = make_policy("tdpipe", pipeline_depth=2, predictor="oracle", finish_ratio=0.5,
                         max_prefill_tokens=10_000)
    run = policy.schedule(state)
    assert [s.seq_id for s, _ in run.prefill] == list(range(6))
    state.launch(run)
    assert policy.schedule(state) is None  # the 7th does not fit: the phase ends
    assert policy.phase == "decode" and policy.switches == 1


def test_algorithm_1_counts_the_running_sequences():
    """Two running sequences predicted to go on for 64 more tokens (context 10 + p) take
    2 x 74 at step 64, leaving room for 5 prompts (5 x 164 + 148 = 968 <= 1000)."""
    state, _ = decoding_state(2, capacity=1000, prompt=10, output=65)
    state.add(*(SeqInfo(f"w{i}", 100, 64) for i in range(10)))
    policy = make_policy("tdpipe", pipeline_depth=2, predictor="oracle", finish_ratio=0.5,
                         max_prefill_tokens=10_000)
    run = policy.schedule(state)
    assert [s.seq_id for s, _ in run.prefill] == [f"w{i}" for i in range(5)]


def test_occupancy_ratio_without_a_predictor():
    state = SchedulerState(device_kv_tokens=1000, max_device_seqs=64)
    state.add(*(SeqInfo(i, 100, 500) for i in range(10)))
    policy = make_policy("tdpipe", pipeline_depth=2, predictor=None, occupancy=0.5,
                         finish_ratio=0.5, max_prefill_tokens=10_000)
    run = policy.schedule(state)
    assert len(run.prefill) == 4  # 4 x 101 + 100 > 500


def launch_round(policy, state, depth):
    runs = []
    for _ in range(depth):
        run = policy.schedule(state)
        state.launch(run)
        runs.append(run)
    return runs


def land(policy, state, run, finish: int):
    """Land `run` with its first `finish` sequences finished (the driver's order: they
    leave the state, the policy hears the run left, then that it landed)."""
    finished = state.apply(run, [s.seq_id for s in run.decode[:finish]])
    policy.left(run, state)
    policy.landed(run, finished, state)


@pytest.mark.parametrize("stealing,sizes", [(True, [1, 1, 3, 3, 3]), (False, [1, 1, 4, 4, 1])])
def test_work_stealing_evens_out_skewed_completions(stealing, sizes):
    """16 decoding sequences in 4 batches of 4; batches 0 and 1 lose 3 each (10 left, target
    ceil(10/4) = 3). With stealing, batches 2 and 3 give up one each, which refill batch 0
    when it comes round again; without, the batches keep their sizes."""
    state, _ = decoding_state(16)
    policy = make_policy("tdpipe", pipeline_depth=4, finish_ratio=1.0,
                         work_stealing=stealing)
    policy.phase = "decode"
    runs = launch_round(policy, state, 4)
    assert [len(r.decode) for r in runs] == [4, 4, 4, 4]
    got = []
    for i, finish in enumerate([3, 3, 0, 0]):
        land(policy, state, runs[i], finish)
        runs.append(policy.schedule(state))
        state.launch(runs[-1])
        got.append(len(runs[-1].decode))
    land(policy, state, runs[4], 0)  # batch 0 comes round again
    got.append(len(policy.schedule(state).decode))
    expected = [sizes[0], sizes[1], sizes[2], sizes[3], 3 if stealing else 1]
    assert got == expected
    if stealing:
        assert max(got[-4:]) - min(got[-4:]) < 4 - 1  # the spread without stealing


def test_intensity_switch_fires_where_the_formula_says():
    """Spatial: (b / (1 + 0.01 b)) / (256 / 3.56) at b per batch; temporal with two waiting
    prompts of 1000 tokens (one 20 s prefill micro-batch), depth 4: 1 - bubble / (20 + 4 d +
    bubble), d = 1 + 0.01 b, bubble = 20 - d. Spatial overtakes temporal at b = 76."""
    timing = LinearTiming()
    peak = 256 / (1 + 0.01 * 256)

    def expected(b):
        d = 1 + 0.01 * b
        bubble = max(0.0, 20.0 - d)
        return b / d / peak, 1 - bubble / (20.0 + 4 * d + bubble)

    for b in (10, 75, 76, 100, 256):
        state, _ = decoding_state(4 * b)
        state.add(SeqInfo("a", 1000, 5), SeqInfo("b", 1000, 5))
        policy = make_policy("tdpipe", pipeline_depth=4, timing=timing,
                             max_prefill_tokens=4096)
        policy.phase = "decode"
        spatial, temporal = expected(b)
        assert policy.spatial_intensity(4 * b) == pytest.approx(spatial)
        assert policy.temporal_intensity(state, 4 * b) == pytest.approx(temporal)
        run = policy.schedule(state)
        switched = policy.phase == "prefill"
        assert switched == (spatial < temporal) == (b < 76)
        assert bool(run.prefill) == switched and bool(run.decode) != switched


def test_tdpipe_needs_timing_or_a_finish_ratio():
    with pytest.raises(ValueError, match="PhaseTiming"):
        make_policy("tdpipe")
    with pytest.raises(ValueError, match="unknown output-length predictor"):
        make_policy("tdpipe", predictor="bert", finish_ratio=0.5)


class Recording(Learned):
    """The learned predictor, noting which sequences it learned from."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, seq):
        self.seen.append(seq.seq_id)
        super().observe(seq)


def test_the_predictor_learns_from_exactly_the_finishes_it_is_handed():
    """The engine's order of events around a landing: of run 0's four sequences, 0 ends now
    and 1 was freed when its last token was dispatched; 2, also of run 0, ends on a stop
    string found as the run lands (aborted after the finishes), and run 1's 4 was freed at
    its launch. Finished sequences leave the state, so the predictor learns from what
    `landed` is handed: 0 and 1, with their first predictions, and nothing else."""
    state = SchedulerState(device_kv_tokens=10_000, max_device_seqs=64)
    state.add(*(SeqInfo(i, 10, 3) for i in range(8)))
    policy = make_policy("tdpipe", pipeline_depth=2, predictor=Recording(), finish_ratio=1.0,
                         max_prefill_tokens=80)
    prefill = policy.schedule(state)
    state.launch(prefill)
    state.apply(prefill)
    policy.phase = "decode"
    runs = launch_round(policy, state, 2)
    assert [[s.seq_id for s in r.decode] for r in runs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for run in runs:  # applied at dispatch, as the engine's executor does
        state.apply(run)
    freed = state.finish([runs[0].decode[1].seq_id, runs[1].decode[0].seq_id])
    finished = state.finish([runs[0].decode[0].seq_id]) + freed[:1]
    state.abort(runs[0].decode[2].seq_id)
    policy.landed(runs[0], finished, state)
    assert policy.predictor.seen == [0, 1]
    assert list(policy.predictions) == [(3, 2), (3, 2)]  # predicted 3 (max), ended at 2
    assert state.num_finished == 4 and policy._phase_done == 2


def test_learned_predictor_uses_buckets_then_global_mean():
    pred = Learned(prior=100, min_count=2)
    assert pred.predict(SeqInfo("x", 10, 1000)) == 100
    for prompt, out in [(10, 40), (12, 60), (300, 500)]:
        seq = SeqInfo("done", prompt, 1000)
        seq.generated = out
        pred.observe(seq)
    assert pred.predict(SeqInfo("a", 9, 1000)) == 50  # bucket of 8-15: (40 + 60) / 2
    assert pred.predict(SeqInfo("b", 400, 1000)) == 200  # 1 in its bucket: global mean
    assert pred.predict(SeqInfo("c", 9, 30)) == 30  # never past max_output_len


def test_accumulated_error_is_the_relative_error_of_group_sums():
    pairs = [(10, 20), (30, 20), (10, 10), (10, 30)]
    assert accumulated_error(pairs, 1) == pytest.approx((0.5 + 0.5 + 0 + 2 / 3) / 4)
    assert accumulated_error(pairs, 2) == pytest.approx((0 + 0.5) / 2)


@pytest.mark.parametrize("options", [
    {"predictor": "learned", "timing": LinearTiming()},
    {"predictor": "oracle", "finish_ratio": 0.5},
    {"predictor": None, "finish_ratio": 0.3, "work_stealing": False},
])
@pytest.mark.parametrize("seed", range(3))
def test_every_request_finishes_once_under_pipelining(options, seed):
    seqs = make_seqs(40, seed)
    policy = make_policy("tdpipe", pipeline_depth=4, max_prefill_tokens=64, **options)
    state, trace = run_pipelined(policy, seqs, device_kv=240, slots=16, depth=4, unit=4)
    assert sorted(trace.finished) == list(range(40))
    assert all(s.location is Location.FINISHED and s.generated == s.max_output_len
               for s in seqs)
    assert trace.max_device_used <= 240 and state.device_kv.used == 0
    assert policy.switches >= 2  # prefill -> decode -> prefill at least once
    # Temporal disaggregation: no micro-batch mixes prompts and decode tokens.
    assert not any(decode and prefill for decode, prefill in trace.launched)


def test_a_prompt_over_the_occupancy_ratio_runs_alone_on_an_empty_store():
    """Without a predictor a 950-token prompt on a 1000-token store never passes the 0.9
    occupancy rule; with nothing running it is admitted alone (it fits the store) instead of
    the policy stalling, and the short prompts behind it run after it."""
    seqs = [SeqInfo(0, 950, 40)] + [SeqInfo(i, 20, 10) for i in range(1, 5)]
    policy = make_policy("tdpipe", pipeline_depth=2, max_prefill_tokens=2000, predictor=None,
                         occupancy=0.9, finish_ratio=0.5)
    state, trace = run_pipelined(policy, seqs, device_kv=1000, slots=8, depth=2, unit=1)
    assert sorted(trace.finished) == list(range(5))
    assert trace.max_device_used <= 1000


def test_a_prompt_over_the_occupancy_ratio_runs_on_a_store_of_whole_blocks():
    """1000 tokens in blocks of 16 are 62 blocks (992 tokens): measured in the store's tokens
    the empty store looked 8 tokens full, so a 950-token prompt (over the 0.9 ratio) was never
    admitted and the policy stalled with nothing running. Every request must be served."""
    seqs = [SeqInfo(0, 950, 40)] + [SeqInfo(i, 20, 10) for i in range(1, 5)]
    policy = make_policy("tdpipe", pipeline_depth=2, max_prefill_tokens=2000, predictor=None,
                         occupancy=0.9, finish_ratio=0.5)
    state, trace = run_pipelined(policy, seqs, device_kv=1000, slots=8, depth=2, unit=16)
    assert sorted(trace.finished) == list(range(5))
    assert trace.max_device_used <= 992


def test_no_predictor_leaves_room_for_the_running_sequences_to_grow():
    """A 4-block store (blocks of 16), two micro-batches in flight: 10% headroom is less than
    a block, so counting only the blocks held, a recomputed prompt was admitted into the room
    the running sequence needs at its next step, preempted as the newest at once, admitted
    again, and so on for ever. Counting the next step's growth, every request finishes."""
    seqs = [SeqInfo(i, p, o) for i, (p, o) in enumerate([(2, 17), (14, 20), (14, 4), (56, 1)])]
    policy = make_policy("tdpipe", pipeline_depth=2, max_prefill_tokens=16, predictor=None,
                         timing=LinearTiming())
    state = SchedulerState(64, 2, device_unit=16)
    state.add(*seqs)
    Driver(policy, state, TraceExecutor(Trace(), depth=2)).run(max_steps=5_000)
    assert all(s.location is Location.FINISHED for s in seqs)


def test_algorithm_1_forgets_a_sequence_that_finished_in_the_prefill_phase():
    """Oracle predictions: the first 90-token prompt generates 1 token, so it finishes with
    its prefill; the store (100 tokens) is then empty, and the second must be admitted (the
    phase's kvUsage, kept from before, counted the first for ever: nothing admitted, nothing
    to decode, a stall)."""
    seqs = [SeqInfo(0, 90, 1), SeqInfo(1, 90, 1)]
    policy = make_policy("tdpipe", pipeline_depth=1, predictor="oracle", finish_ratio=0.5,
                         max_prefill_tokens=100)
    state, trace = run_pipelined(policy, seqs, device_kv=100, slots=2, depth=1)
    assert sorted(trace.finished) == [0, 1]


def test_a_prompt_left_part_way_by_someone_else_goes_on():
    """A prompt whose first chunk the state cut short (the prefix cache's admission does,
    to pay for the blocks it revives) is on the device, idle, still in its prefill: its next
    chunk comes first, whoever cut it (nothing waits, nothing decodes: it was a stall)."""
    state = SchedulerState(device_kv_tokens=1000, max_device_seqs=4)
    seq = SeqInfo("a", 50, 5)
    state.add(seq)
    state.apply(Run(prefill=[(seq, 10)]))
    policy = make_policy("tdpipe", pipeline_depth=2, predictor="oracle", finish_ratio=0.5,
                         max_prefill_tokens=64)
    run = policy.schedule(state)
    assert run.prefill == [(seq, 40)] and policy.phase == "prefill"
