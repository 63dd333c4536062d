"""A simulated executor: the real `jaxpipe.scheduler` policies, step times from the cost model.

`simulate(...)` builds a `SchedulerState` for one replica, adds every request of a workload and
runs the scheduler's one loop (`jaxpipe.scheduler.Driver`, as the engine does) over a
`SimExecutor`, which advances a clock by the cost model's time for each action:

- `Run`: one step on the current layout (prefill layout in the prefill phase, else decode),
  landing at once; completed prefills sent to the host tier are copied out on the host link in
  the background. `PipelinedSimExecutor` keeps up to pp micro-batches in flight instead,
  formed by one scheduler or (`virtual_engines`) by vLLM V0's pp schedulers, one each
  (virtual_engines.py).
- Host time (`HostCost`, hostcost.py): the host prepares each step before it starts and, with
  the host sampler, samples it when it lands; the single-step executor waits for both, the
  pipelined one overlaps them with the stages as far as its `in_flight` (or `token_safe`, the
  engine's flowing pipeline) allows.
- `Switch`: waits for the host link to drain, then loads the new weight shards; KV still on the
  devices is re-sharded through the host (out and back in).
- `SwapIn` / `Preempt(swap)`: KV copies on the host link, overlapping later steps; a step that
  decodes a swapped-in sequence starts no earlier than its copy arrives.

Every request runs to its output length (as with ignore_eos), so token counts are fixed by the
workload, and each is freed when the run with its last token is launched (as the engine frees
a sequence whose token in flight is certainly its last). The stats are the engine's (issue 4):
transitions, reshard/prefill/decode/swap seconds, swap bytes, mean decode batch, preemptions,
padding waste (0: the simulated GPU engine does not pad) and a host-tier occupancy timeline.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import MeshPreset
from jaxpipe.config.model import ModelConfig
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.hostcost import NO_HOST, HostCost
from jaxpipe.planner.planner import (
    HOST_KV_GB,
    MAX_NUM_SEQS,
    PREFILL_TOKENS_PER_MICROBATCH,
    host_kv_tokens,
    layout_name,
)
from jaxpipe.planner.virtual_engines import VirtualEngines, assign
from jaxpipe.planner.workloads import Workload
from jaxpipe.scheduler import (
    Driver,
    Kind,
    Phase,
    Preempt,
    Run,
    SchedulerState,
    SeqInfo,
    StepExecutor,
    SwapIn,
    Switch,
    make_policy,
)

PIPELINED_POLICIES = ("tdpipe", "throttle")  # policies that form one micro-batch per call
CHUNK_TOKENS_PER_MICROBATCH = 2048  # vLLM's max_num_batched_tokens for chunked prefill
TIMELINE_POINTS = 200  # host-occupancy samples kept in the result


@dataclass
class SimStats:
    """Counters of one simulated run (seconds, bytes, counts)."""

    transitions: int = 0
    reshard_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    swap_out_bytes: float = 0.0
    swap_in_bytes: float = 0.0
    swap_seconds: float = 0.0
    preemptions: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    tokens_generated: int = 0
    host_seconds: float = 0.0  # host work: preparing micro-batches and host sampling
    padding_waste: float = 0.0
    host_timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, tokens)

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


class SimExecutor(StepExecutor):
    """Carries out scheduler actions against a clock using one CostModel per phase; each
    step lands as soon as it is launched, the host's time for it on the critical path."""

    def __init__(self, prefill_cost: CostModel, decode_cost: CostModel,
                 host: HostCost = NO_HOST):
        self.cost = {Phase.PREFILL: prefill_cost, Phase.DECODE: decode_cost}
        self.host_cost = host
        self.clock = 0.0  # seconds since the start
        self.link = 0.0  # when the host link finishes its queued copies
        # sequence -> the earliest a step with it may start: its swapped-in KV there, or (pipelined,
        # token-safe) its token of the micro-batch before
        self.enter_after: dict[Hashable, float] = {}
        self.stats = SimStats()

    def scheduled(self, start: float, state: SchedulerState) -> None:
        self.record_host(state)  # the host tier as the previous action left it

    def launch(self, runs: list[Run], state: SchedulerState) -> list[Hashable]:
        """Advance the clock by the step; the handle is the ids it ends (its last tokens)."""
        (run,) = runs
        return self._run(run, state)

    def land(self, ended: list[Hashable], state: SchedulerState) -> list[Hashable]:
        return ended

    def execute(self, action, state: SchedulerState) -> None:
        """Advance the clock (or the host link) by a Switch / SwapIn / Preempt."""
        if action.kind is Kind.SWITCH:
            self._switch(action, state)
        elif action.kind is Kind.SWAP_IN:
            self._swap_in(action, state)
        else:
            self._preempt(action, state)

    def _run(self, action: Run, state: SchedulerState) -> list[Hashable]:
        cm = self.cost[state.phase]
        tokens = action.prefill_tokens + len(action.decode)
        pairs = sum(n * s.computed + n * (n + 1) / 2 for s, n in action.prefill)
        pairs += sum(s.computed + 1 for s in action.decode)
        kv = sum(s.computed + n for s, n in action.prefill)  # rows read + written
        kv += sum(s.computed + 1 for s in action.decode)
        sampling = action.sampling()
        host = self.host_cost.prepare(len(action.seqs)) + self.host_cost.host_sample(
            len(sampling))
        self.stats.host_seconds += host
        start = max([self.clock + host]
                    + [self.enter_after.pop(s.seq_id, 0.0) for s in action.decode])
        dt = cm.step_time(len(action.seqs), tokens, pairs, kv, dependent=bool(action.decode))
        dt += self.host_cost.device_sample(len(sampling))
        self.clock = start + dt
        if action.decode and len(action.decode) >= action.prefill_tokens:
            self.stats.decode_seconds += dt
        else:
            self.stats.prefill_seconds += dt
        if action.decode:
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(action.decode)
        self.stats.tokens_generated += len(sampling)
        if action.prefill_to_host:
            done = [s for s, n in action.prefill if n == s.to_prefill]
            self._copy(cm, sum(s.context_len for s in done), out=True)
        return [s.seq_id for s in sampling if s.generated + 1 >= s.max_output_len]

    def _copy(self, cm: CostModel, tokens: float, out: bool) -> float:
        """Queue a KV copy of `tokens` on the host link; return when it is done."""
        seconds = cm.swap_seconds(tokens)
        self.link = max(self.link, self.clock) + seconds
        self.stats.swap_seconds += seconds
        if out:
            self.stats.swap_out_bytes += cm.swap_bytes(tokens)
        else:
            self.stats.swap_in_bytes += cm.swap_bytes(tokens)
        return self.link

    def _switch(self, action: Switch, state: SchedulerState) -> None:
        src, dst = self.cost[state.phase], self.cost[Phase(action.phase)]
        start = max(self.clock, self.link)
        dt = src.reshard_seconds(dst.layout)
        if dt and state.device_kv.used:  # KV on the devices is re-sharded through the host
            dt += 2 * src.swap_seconds(state.device_kv.used)
        self.clock = start + dt
        self.stats.transitions += 1
        self.stats.reshard_seconds += dt

    def _swap_in(self, action: SwapIn, state: SchedulerState) -> None:
        cm = self.cost[state.phase]
        for seq in action.seqs:
            self.enter_after[seq.seq_id] = self._copy(cm, seq.computed, out=False)

    def _preempt(self, action: Preempt, state: SchedulerState) -> None:
        self.stats.preemptions += len(action.seqs)
        if action.mode == "swap":
            self._copy(self.cost[state.phase], sum(s.computed for s in action.seqs), out=True)

    def record_host(self, state: SchedulerState) -> None:
        timeline = self.stats.host_timeline
        if not timeline or timeline[-1][1] != state.host_kv.used:
            timeline.append((self.clock, state.host_kv.used))


@dataclass(eq=False)
class Flowing:
    """A simulated micro-batch in flight: when it leaves the last stage, the sequences it
    samples, the ids it ends, its launch number, and when its tokens are ready (on the device
    as it leaves, or on the host once the host sampler sampled them; None: not sampled yet)."""

    exit: float
    sampling: list
    ended: list
    index: int
    ready: float | None = None


class PipelinedSimExecutor(SimExecutor):
    """Micro-batches through `pp` stages with host-driven ticks, up to `in_flight` in flight
    while the host forms the next (each formed by the policy as one leaves; a sequence waits
    for its micro-batch to land): a micro-batch enters stage s when it left stage s-1 and
    stage s is free; each stage takes the cost model's `stage_time` for the micro-batch's
    tokens (the last stage also the device sampler's time). The clock is the scheduler's: it
    advances to a micro-batch's exit (and its host sampling) when that micro-batch lands.

    The host is one worker (`host`: when it is next free): it prepares each micro-batch
    before it enters stage 0 and, with the host sampler, samples each one that lands.
    `in_flight` pp - 1 (the engine's rule without overlap) forms k+1 only once k-pp+1 left the
    last stage, and (`HostCost.stages_wait`) every later stage prepares its own input before
    its forward (the engine's one tick program; vLLM's PP, SiPipe's intra-stage bubble): host
    time on the critical path of every stage. `in_flight` pp lands micro-batch k-pp and forms
    k+1 while the stages run k: host work is hidden while it is shorter than a stage, but free
    sequences may form an extra, smaller micro-batch (hostcost.py).

    `token_safe` (SiPipe's token-safe execution, the engine's rule with overlap: pp in flight,
    scheduler/loop.py): micro-batch k-pp+1 is released once k was launched (pp - 1 launched
    after it; or once the clock passed its exit, when no new one came), so its sequences may
    be in k+1, which the host prepares while the stages run k; a sequence enters stage 0 no
    earlier than its token of the micro-batch before is there (its exit, or with the host
    sampler its sampling, which the host does after preparing k+1, as the engine samples a
    host-sampled feeder just before it dispatches)."""

    chained = False  # a micro-batch's tokens are back only when it leaves the last stage

    def __init__(self, cost: CostModel, host: HostCost = NO_HOST, in_flight: int | None = None,
                 token_safe: bool = False):
        super().__init__(cost, cost, host)
        pp = cost.layout.pp
        self.stages = [0.0] * pp  # when each stage is next free
        self.in_flight = (pp if token_safe else pp - 1) if in_flight is None else in_flight
        if self.in_flight not in (pp - 1, pp) or (token_safe and self.in_flight != pp):
            accepted = (f"pp = {pp} (token-safe execution)" if token_safe else
                        f"pp - 1 = {pp - 1} (host on the critical path) or pp = {pp} (host "
                        f"overlapped)")
            raise ValueError(f"in_flight={in_flight}: accepted {accepted}")
        self.token_safe = token_safe
        self.flow_depth = pp  # a one-micro-batch policy's run is split over them
        self.busy_seconds = 0.0  # stage-seconds of work (for the pipeline utilisation)
        self.host = 0.0  # when the host is next free
        self.launched = 0  # micro-batches launched
        self._unsampled: list[Flowing] = []  # released, sampled before the next enters

    @property
    def host_blocking(self) -> bool:
        """Host work on the critical path (each stage prepares its input after its last
        forward) rather than overlapped with the stages."""
        return self.in_flight < len(self.stages) and self.host_cost.stages_wait

    def launch(self, runs: list[Run], state: SchedulerState) -> Flowing:
        """Prepare the micro-batch on the host (and sample the released micro-batches it may
        take tokens from), then queue it on the stages."""
        (run,) = runs
        dt = self._stage_time(run, state)
        sampling = run.sampling()
        prepare = self.host_cost.prepare(len(run.seqs))
        self.host = max(self.clock, self.host) + prepare
        self.stats.host_seconds += prepare
        while self._unsampled:
            self._sample(self._unsampled.pop(0))
        stall = prepare if self.host_blocking else 0.0
        last = dt + self.host_cost.device_sample(len(sampling))
        t = max([self.host] + [self.enter_after.pop(s.seq_id, 0.0) for s in run.decode])
        for i, free in enumerate(self.stages):
            work = last if i == len(self.stages) - 1 else dt
            t = max(t, free) + work + (stall if i else 0.0)
            self.stages[i] = t
        self.busy_seconds += dt * (len(self.stages) - 1) + last
        self.launched += 1
        ended = [s.seq_id for s in sampling if s.generated + 1 >= s.max_output_len]
        return Flowing(t, sampling, ended, self.launched - 1)

    def _stage_time(self, run: Run, state: SchedulerState) -> float:
        """The cost model's time of `run` on one stage; counted as prefill or decode."""
        cm = self.cost[state.phase]
        tokens = run.prefill_tokens + len(run.decode)
        pairs = sum(n * s.computed + n * (n + 1) / 2 for s, n in run.prefill)
        pairs += sum(s.computed + 1 for s in run.decode)
        kv = sum(s.computed + n for s, n in run.prefill) + sum(s.computed + 1 for s in run.decode)
        dt = cm.stage_time(tokens, pairs, kv, len(run.sampling()))
        if run.decode and len(run.decode) >= run.prefill_tokens:
            self.stats.decode_seconds += dt
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(run.decode)
        else:
            self.stats.prefill_seconds += dt
        return dt

    def left(self, handle: Flowing) -> bool:
        """Token-safe: released pp - 1 launches after it, or once the clock passed its exit."""
        return self.token_safe and (self.launched - handle.index >= len(self.stages)
                                    or handle.exit <= self.clock)

    def release(self, handle: Flowing, seqs: list[SeqInfo]) -> None:
        """A micro-batch decoding one of `handle`'s sequences enters no earlier than its
        tokens: it leaves the last stage at `exit`, and the host sampler samples it before the
        next micro-batch enters (that entry waits for the host anyway)."""
        self._unsampled.append(handle)
        for s in handle.sampling:
            self.enter_after[s.seq_id] = max(self.enter_after.get(s.seq_id, 0.0), handle.exit)

    def _sample(self, handle: Flowing) -> None:
        """Its tokens are ready when it left the last stage (the device sampler), or when the
        host sampled them after its earlier work."""
        seconds = self.host_cost.host_sample(len(handle.sampling))
        if not seconds:
            handle.ready = handle.exit
            return
        handle.ready = self.host = max(handle.exit, self.host) + seconds
        self.stats.host_seconds += seconds

    def land(self, handle: Flowing, state: SchedulerState) -> list[Hashable]:
        """The micro-batch left the last stage at `exit`; its tokens are sampled then, unless
        they were when the next one entered."""
        if handle in self._unsampled:
            self._unsampled.remove(handle)
        if handle.ready is None:
            self._sample(handle)
        self.clock = max(self.clock, handle.ready)
        self.stats.tokens_generated += len(handle.sampling)
        return handle.ended


@dataclass(frozen=True)
class CostTiming:
    """TD-Pipe's `PhaseTiming` from the cost model: one micro-batch through one stage, decode
    sequences at `context` tokens, prefill prompts of `prompt` tokens."""

    cost: CostModel
    context: float
    prompt: float
    peak_batch: int = MAX_NUM_SEQS

    def decode_seconds(self, batch: int) -> float:
        return self.cost.stage_time(batch, batch * self.context, batch * self.context, batch)

    def prefill_seconds(self, tokens: int) -> float:
        rows = max(1.0, tokens / self.prompt)
        return self.cost.stage_time(tokens, tokens * (self.prompt + 1) / 2, tokens, rows)


@dataclass
class SimResult:
    """End-to-end outcome of one simulated run."""

    policy: str
    prefill: str  # layout names, e.g. "pp8"
    decode: str
    seconds: float  # makespan
    prompt_tokens: int
    output_tokens: int
    finished: int
    stats: SimStats
    utilisation: float | None = None  # pipelined runs: stage busy time / (pp x makespan)
    policy_object: object = None  # the policy after the run (its counters, predictions)

    @property
    def throughput(self) -> float:
        """Prompt plus generated tokens per second."""
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def generation_throughput(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict:
        st = self.stats
        return {
            "policy": self.policy, "prefill": self.prefill, "decode": self.decode,
            "seconds": self.seconds, "throughput": self.throughput,
            "generation_throughput": self.generation_throughput, "finished": self.finished,
            "transitions": st.transitions, "reshard_seconds": st.reshard_seconds,
            "prefill_seconds": st.prefill_seconds, "decode_seconds": st.decode_seconds,
            "swap_out_bytes": st.swap_out_bytes, "swap_in_bytes": st.swap_in_bytes,
            "swap_seconds": st.swap_seconds, "mean_decode_batch": st.mean_decode_batch,
            "preemptions": st.preemptions, "padding_waste": st.padding_waste,
            "tokens_generated": st.tokens_generated, "host_seconds": st.host_seconds,
            "utilisation": self.utilisation,
            "host_timeline": _downsample(st.host_timeline),
        }


def _downsample(timeline: list, points: int = TIMELINE_POINTS) -> list:
    step = max(1, len(timeline) // points)
    return [[round(t, 4), n] for t, n in timeline[::step]]


def simulate(model: ModelConfig, mesh: MeshPreset, workload: Workload, policy: str,
             prefill: Layout, decode: Layout | None = None, host_kv_gb: float = HOST_KV_GB,
             pipelined: bool = False, host_cost: HostCost = NO_HOST,
             in_flight: int | None = None, virtual_engines: bool = False,
             token_safe: bool = False, **policy_options) -> SimResult:
    """Serve `workload` with `policy` on `prefill` (and `decode`, default the same) layouts.

    `pipelined`: micro-batches with host-driven ticks on one layout (`PipelinedSimExecutor`:
    up to pp in flight, each formed by the policy as one leaves), as TD-Pipe
    and gLLM run; `tdpipe` and `throttle` always run so. Otherwise a step is all pp
    micro-batches at once (`CostModel.step_time`), as the engine's in-program ticks run.
    `prefill_first` on a single layout defaults to chunked prefill (the paper's vLLM baseline).
    `host_cost`: the host's time per micro-batch (hostcost.py; default none); `in_flight`:
    the pipelined executor's micro-batches in flight while the next is formed (pp - 1, the
    default: host work on the critical path; pp: overlapped). `token_safe`: the engine's
    flowing pipeline (SiPipe's token-safe execution, `PipelinedSimExecutor`): pp in flight,
    a micro-batch's sequences join the next one once it left the last stage.
    `virtual_engines`: vLLM V0's pipeline parallelism (virtual_engines.py): pp schedulers,
    each with 1/pp of the KV and its own requests, one micro-batch in flight each (pipelined
    runs of a one-micro-batch policy only; `policy_object` is then the list of policies).
    Raises ValueError if a layout (or a virtual engine's share of it) cannot hold the weights
    plus the longest request."""

    decode = decode or prefill
    pipelined = pipelined or policy in PIPELINED_POLICIES
    if pipelined and prefill != decode:
        raise ValueError(f"a pipelined run uses one layout; got {prefill} and {decode}")
    if virtual_engines and (not pipelined or policy in PIPELINED_POLICIES):
        raise ValueError(f"virtual_engines: vLLM's pipelined baseline (pipelined=True, a "
                         f"policy other than {PIPELINED_POLICIES}); got {policy!r}, "
                         f"pipelined={pipelined}")
    cost_p, cost_d = (CostModel(model, mesh.hardware, x) for x in (prefill, decode))
    engines = prefill.pp if virtual_engines else 1
    states = make_states(model, workload, cost_p, cost_d, host_kv_gb, engines)
    opts = _policy_options(policy, prefill, decode, policy_options, pipelined)
    if policy == "tdpipe" and opts.get("finish_ratio") is None:
        opts.setdefault("timing", CostTiming(cost_p, workload.mean_prompt
                                             + workload.mean_output / 2, workload.mean_prompt))
    policies = [make_policy(policy, **opts) for _ in states]
    if token_safe and (not pipelined or virtual_engines):
        raise ValueError(f"token_safe: the engine's flowing pipeline (pipelined=True, one "
                         f"scheduler); got pipelined={pipelined}, "
                         f"virtual_engines={virtual_engines}")
    executor = (PipelinedSimExecutor(cost_p, host_cost, in_flight, token_safe) if pipelined
                else SimExecutor(cost_p, cost_d, host_cost))
    if virtual_engines:
        VirtualEngines(policies, states, executor).run()
    else:
        Driver(policies[0], states[0], executor).run()
    executor.record_host(states[0])
    seconds = max(executor.clock, executor.link)
    result = SimResult(policy, layout_name(prefill), layout_name(decode), seconds,
                       workload.total_prompt, workload.total_output,
                       sum(s.num_finished for s in states), executor.stats)
    if pipelined:
        result.utilisation = executor.busy_seconds / (prefill.pp * seconds)
    result.policy_object = policies if virtual_engines else policies[0]
    return result


def make_states(model: ModelConfig, w: Workload, cost_p: CostModel, cost_d: CostModel,
                 host_kv_gb: float, engines: int = 1) -> list[SchedulerState]:
    """One state holding every request (one scheduler: up to MAX_NUM_SEQS per micro-batch,
    pp of them), or `engines` virtual engines' states, each with 1/engines of both KV tiers
    and MAX_NUM_SEQS, the requests assigned as vLLM V0 does (virtual_engines.py)."""
    device_kv = min(cost_p.kv_capacity_tokens(), cost_d.kv_capacity_tokens()) // engines
    if device_kv < w.max_len:
        share = f" (1/{engines} each, vLLM's virtual engines)" if engines > 1 else ""
        raise ValueError(f"layouts {cost_p.layout} / {cost_d.layout} hold {device_kv} tokens of "
                         f"KV beside the weights{share}; the longest request needs {w.max_len}")
    max_seqs = MAX_NUM_SEQS * (cost_d.layout.pp if engines == 1 else 1)
    states = [SchedulerState(device_kv, max_seqs, host_kv_tokens(model, host_kv_gb) // engines)
              for _ in range(engines)]
    assign(states, [SeqInfo(i, p, o) for i, (p, o) in enumerate(w.requests)])
    return states


def _policy_options(policy: str, prefill: Layout, decode: Layout, options: dict,
                    pipelined: bool) -> dict:
    """Token budgets: per micro-batch when pipelined (each `schedule` forms one), else scaled
    by pipeline depth (one budget per micro-batch, as vLLM's virtual engines do); the
    chunked-prefill default of the vLLM baseline; the pipeline depth of the two
    micro-batch policies."""
    opts = dict(options)
    if policy != "seesaw":
        opts.setdefault("two_layouts", prefill != decode)
    if policy == "prefill_first":
        opts.setdefault("chunked", not opts["two_layouts"])
    if policy in PIPELINED_POLICIES:
        opts.setdefault("pipeline_depth", prefill.pp)
    per_mb = CHUNK_TOKENS_PER_MICROBATCH if opts.get("chunked") else PREFILL_TOKENS_PER_MICROBATCH
    opts.setdefault("max_prefill_tokens", per_mb * (1 if pipelined else prefill.pp))
    return opts
