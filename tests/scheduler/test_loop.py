"""The one loop's rules (`Driver`), with hand-made policies and a recording executor: a run is
applied at launch and its sequences finish at land; a sequence whose token in flight is its
last is freed at launch; a chained executor's sequences may join the next step, a host-ticked
one's wait for their micro-batch, and where the executor says a micro-batch left the last
stage they join the next before it lands (token-safe execution), one that ends meanwhile
keeping its slot until the micro-batch it is already in leaves too; an action decided before a
landing loses the sequences that ended in it; a swap-in is recorded before the executor moves
the KV, a preemption after."""

from __future__ import annotations

from jaxpipe.scheduler import (
    Driver,
    Location,
    Policy,
    Preempt,
    Run,
    SchedulerState,
    SeqInfo,
    StepExecutor,
    SwapIn,
)


class Scripted(Policy):
    """Returns the actions `script(state)` makes, in turn; records what `landed` hears."""

    def __init__(self, script, depth: int = 1):
        super().__init__()
        self.script, self.depth, self.heard = script, depth, []

    def schedule(self, state):
        return self.script(state)

    def landed(self, run, finished, state):
        self.heard.append(([s.seq_id for s in run.seqs], [s.seq_id for s in finished]))


class Recorder(StepExecutor):
    """Notes what each call sees; a landing ends the ids in `ends` and those freed at launch
    (each once, as the engine's output processor does)."""

    def __init__(self, in_flight=0, chained=True, ends=()):
        self.in_flight, self.chained, self.ends = in_flight, chained, set(ends)
        self.seen, self.ended = [], set()

    def launch(self, runs, state):
        self.seen.append(("launch", [(s.seq_id, s.generated) for r in runs for s in r.seqs]))
        return [s.seq_id for r in runs for s in r.seqs]

    def free(self, handle, seqs):
        self.seen.append(("free", [s.seq_id for s in seqs]))
        self.ends.update(s.seq_id for s in seqs)

    def land(self, ids, state):
        self.seen.append(("land", ids))
        ended = [i for i in ids if i in self.ends and i not in self.ended]
        self.ended.update(ended)
        return ended

    def execute(self, action, state):
        self.seen.append((action.kind.value, [(s.seq_id, s.location) for s in action.seqs]))


class Flowing(Recorder):
    """A pipeline of `stages` (the engine's flowing executor): a step leaves the last stage
    in the launch of the (stages - 1)-th step after it; `stages` steps stay unlanded."""

    def __init__(self, stages: int, ends=()):
        super().__init__(in_flight=stages, chained=False, ends=ends)
        self.stages, self.launches = stages, 0

    def launch(self, runs, state):
        handle = {"ids": super().launch(runs, state), "n": self.launches,
                  "seqs": [s for r in runs for s in r.seqs]}
        self.launches += 1
        return handle

    def left(self, handle):
        return self.launches - 1 - handle["n"] >= self.stages - 1

    def release(self, handle, seqs):
        self.seen.append(("release", handle["ids"], [s.seq_id for s in seqs]))
        self.ends.update(s.seq_id for s in seqs)

    def land(self, handle, state):  # (its last token, as the output processor finds it)
        self.ends.update(s.seq_id for s in handle["seqs"] if s.generated >= s.max_output_len)
        return super().land(handle["ids"], state)


def one_idle(state):
    return Run(decode=state.idle()[:1]) if state.idle() else None


def decoding(n: int, output: int = 10, host: int = 0) -> tuple[SchedulerState, list[SeqInfo]]:
    state = SchedulerState(1000, 8, host)
    seqs = [SeqInfo(i, 4, output) for i in range(n)]
    state.add(*seqs)
    state.apply(Run(prefill=[(s, 4) for s in seqs]))  # each sampled its first token
    return state, seqs


def test_applied_at_launch_finished_at_land_with_a_step_in_flight():
    """Overlap: step 1 stays in flight while step 2 is formed from the same sequence (its
    token fed on the device), which sees step 1's token counted; step 1 lands after step 2
    launched, and the sequence it ends leaves the state then, not before."""
    state, (a,) = decoding(1)
    policy = Scripted(lambda st: Run(decode=st.idle()) if st.idle() else None)
    executor = Recorder(in_flight=1, ends={0})
    driver = Driver(policy, state, executor)
    driver.step()
    assert a.generated == 2 and not state.busy and len(driver.in_flight) == 1
    assert a.location is Location.DEVICE  # its end is learnt when the step lands
    driver.step()
    assert executor.seen == [("launch", [(0, 1)]), ("free", []), ("launch", [(0, 2)]),
                             ("free", []), ("land", [0])]
    assert a.location is Location.FINISHED and policy.heard == [([0], [0])]
    driver.step()  # the policy has nothing: the step in flight lands
    assert not driver.in_flight and policy.heard == [([0], [0]), ([0], [])]


def test_the_last_token_frees_at_launch_and_finishes_at_land():
    state, (a,) = decoding(1, output=2)
    policy = Scripted(lambda st: Run(decode=st.idle()) if st.idle() else None)
    executor = Recorder(in_flight=1)
    driver = Driver(policy, state, executor)
    driver.step()
    assert executor.seen[-1] == ("free", [0]) and a.location is Location.FINISHED
    assert not state.has_work() and policy.heard == []  # the policy hears it at land
    assert driver.run() == 1 and policy.heard == [([0], [0])]


def test_host_ticks_keep_a_micro_batch_busy_until_it_lands():
    state, (a, b) = decoding(2)
    policy = Scripted(lambda st: Run(decode=st.idle()[:1]) if st.idle() else None)
    driver = Driver(policy, state, Recorder(in_flight=1, chained=False))
    driver.step()
    assert a.generated == 2 and state.busy == {0}  # counted at launch, busy until it lands
    driver.step()
    assert state.busy == {1} and policy.heard == [([0], [])]
    assert [s.seq_id for s in state.idle()] == [0]


def test_an_action_decided_before_a_landing_loses_what_ended_in_it():
    """The policy preempts both sequences while a step in flight ends one of them: the
    step lands first, and the preemption takes only the other, recorded after the
    executor moved it (the executor sees it still on the device)."""
    state, (a, b) = decoding(2)
    actions = iter([Run(decode=[a, b]), Preempt([a, b], "recompute")])
    policy = Scripted(lambda st: next(actions, None))
    executor = Recorder(in_flight=1, ends={0})
    driver = Driver(policy, state, executor)
    driver.step()
    driver.step()
    assert executor.seen[-2:] == [("land", [0, 1]), ("preempt", [(1, Location.DEVICE)])]
    assert a.location is Location.FINISHED and b.location is Location.WAITING


def test_a_swap_in_is_recorded_before_the_executor_moves_it():
    state, (a,) = decoding(1, host=100)
    state.apply(Preempt([a], "swap"))
    driver = Driver(Scripted(lambda st: SwapIn([a])), state, executor := Recorder())
    driver.step()
    assert executor.seen == [("swap_in", [(0, Location.DEVICE)])]


def test_a_merged_step_keeps_to_its_depth_and_token_budget():
    """Micro-batches of 3 tokens each, up to depth 4 per step under a 7-token budget: two
    per step; the third, over the budget, is left unlaunched and formed again."""
    state, seqs = decoding(6)
    policy = Scripted(lambda st: Run(decode=st.idle()[:3]) if st.idle() else None, depth=4)
    executor = Recorder()
    executor.merge, executor.max_step_tokens = True, 7
    driver = Driver(policy, state, executor)
    driver.step()
    assert executor.seen[0] == ("launch", [(i, 1) for i in range(6)])
    assert not state.busy and all(s.generated == 2 for s in seqs)
    executor.max_step_tokens = 5
    driver.step()
    assert executor.seen[-3] == ("launch", [(i, 2) for i in range(3)])


def test_over_stages_a_one_micro_batch_run_is_split_into_shares():
    """Over 4 stages (3 in flight, host ticks), a depth-1 policy's run of 8 decodes goes as
    4 micro-batches of 2, each its own step; a share that returns (2 of the device's 8, one
    stage's share) goes whole. Every sequence is in exactly one micro-batch in flight."""
    state, seqs = decoding(8)
    policy = Scripted(lambda st: Run(decode=st.idle()) if st.idle() else None)
    executor = Recorder(in_flight=3, chained=False)
    executor.flow_depth = 4
    driver = Driver(policy, state, executor)
    driver.step()
    launches = [ids for what, ids in executor.seen if what == "launch"]
    assert [[i for i, _ in ids] for ids in launches] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert executor.seen[-1] == ("land", [0, 4]) and len(driver.in_flight) == 3
    driver.step()  # the two that landed: one share, not split again
    assert executor.seen[-3:] == [("launch", [(0, 2), (4, 2)]), ("free", []), ("land", [1, 5])]
    assert state.busy == {2, 6, 3, 7, 0, 4}


def test_a_run_under_two_shares_and_a_pipelined_policy_s_run_stay_whole():
    state, _ = decoding(8)
    executor = Recorder(in_flight=3, chained=False)
    executor.flow_depth = 4
    three = Scripted(lambda st: Run(decode=st.idle()[:3]) if st.idle() else None)
    Driver(three, state, executor).step()
    assert executor.seen[0] == ("launch", [(0, 1), (1, 1), (2, 1)])
    state, _ = decoding(8)
    executor = Recorder(in_flight=3, chained=False)
    executor.flow_depth = 4
    deep = Scripted(lambda st: Run(decode=st.idle()) if st.idle() else None, depth=4)
    Driver(deep, state, executor).step()
    assert executor.seen[0] == ("launch", [(i, 1) for i in range(8)])


def test_split_deals_decodes_round_robin_and_prompts_to_the_lightest_piece():
    a, b, c, d, e = (SeqInfo(i, 100, 10) for i in range(5))
    run = Run(prefill=[(a, 50), (b, 8), (c, 40)], decode=[d, e], prefill_to_host=True)
    pieces = run.split(3)
    assert [([s.seq_id for s, _ in p.prefill], [s.seq_id for s in p.decode]) for p in pieces] \
        == [([2], [3]), ([1], [4]), ([0], [])]  # 50 to the empty piece, 40 and 8 after
    assert all(p.prefill_to_host for p in pieces)
    assert [len(p.seqs) for p in run.split(9)] == [1] * 5  # no empty piece
    (whole,) = run.split(1)
    assert sorted(s.seq_id for s in whole.seqs) == [0, 1, 2, 3, 4]


def test_a_micro_batch_that_left_releases_its_sequences_before_it_lands():
    """Two stages, one sequence per micro-batch: micro-batch 0 (a) leaves as 1 (b) enters and
    is released; a enters again (its token fed on the device, counted) before 0 lands, and 0
    lands only as the next one leaves, while a is in flight."""
    state, (a, b) = decoding(2)
    executor = Flowing(stages=2)
    driver = Driver(Scripted(one_idle), state, executor)
    for _ in range(3):
        driver.step()
    assert [e for e in executor.seen if e[0] != "free"] == [
        ("launch", [(0, 1)]), ("launch", [(1, 1)]), ("release", [0], []),
        ("launch", [(0, 2)]), ("land", [0]), ("release", [1], [])]
    assert state.busy == {0} and [s.seq_id for s in state.idle()] == [1]
    assert a.generated == 3


def test_a_sequence_ended_while_in_a_later_micro_batch_keeps_its_slot_until_that_leaves():
    """a ends as micro-batch 0 lands, when it is already in micro-batch 2: it stays in the
    state (slot and blocks: micro-batch 2's later stages still write them) until 2 leaves, is
    never scheduled again, and the policy hears its end once, with 0's landing."""
    state, (a, b) = decoding(2)
    policy = Scripted(one_idle)
    driver = Driver(policy, state, Flowing(stages=2, ends={0}))
    for _ in range(3):
        driver.step()
    assert policy.heard == [([0], [0])]
    assert a.location is Location.DEVICE and a.slot is not None and 0 in state.busy
    driver.step()  # b enters; micro-batch 2 (a) leaves: a leaves the state
    assert a.location is Location.FINISHED and a.slot is None
    assert [s.seq_id for s in state.idle()] == [] and state.busy == {1}
    driver.run()
    assert policy.heard.count(([0], [0])) == 1 and not state.has_work()


def test_an_abort_waits_for_the_micro_batch_in_flight_but_not_for_an_idle_sequence():
    state, (a, b) = decoding(2)
    driver = Driver(Scripted(one_idle), state, Flowing(stages=2))
    driver.step()  # a in micro-batch 0, still in the pipeline; b idle
    driver.end(b.seq_id)
    driver.end(a.seq_id)
    assert b.location is Location.FINISHED
    assert a.location is Location.DEVICE and a.slot is not None
    driver.run()
    assert a.location is Location.FINISHED and not state.has_work()
