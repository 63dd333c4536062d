"""A simulated executor: the real `jaxpipe.scheduler` policies, step times from the cost model.

`simulate(...)` builds a `SchedulerState` for one replica, adds every request of a workload and
runs `jaxpipe.scheduler.drive` with `SimExecutor.execute`, which advances a clock by the cost
model's time for each action:

- `Run`: one step on the current layout (prefill layout in the prefill phase, else decode);
  completed prefills sent to the host tier are copied out on the host link in the background.
- `Switch`: waits for the host link to drain, then loads the new weight shards; KV still on the
  devices is re-sharded through the host (out and back in).
- `SwapIn` / `Preempt(swap)`: KV copies on the host link, overlapping later steps; a step that
  decodes a swapped-in sequence starts no earlier than its copy lands.

Every request runs to its output length (as with ignore_eos), so token counts are fixed by the
workload. The stats are the engine's (issue 4): transitions, reshard/prefill/decode/swap seconds,
swap bytes, mean decode batch, preemptions, padding waste (0: the simulated GPU engine does not
pad) and a host-tier occupancy timeline.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from jaxpipe.config import ModelConfig
from jaxpipe.layout import Layout
from jaxpipe.meshes import MeshPreset
from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.planner import (
    HOST_KV_GB,
    MAX_NUM_SEQS,
    PREFILL_TOKENS_PER_MICROBATCH,
    host_kv_tokens,
)
from jaxpipe.planner.workloads import Workload
from jaxpipe.scheduler import (
    Kind,
    Phase,
    Preempt,
    Run,
    SchedulerState,
    SeqInfo,
    SwapIn,
    Switch,
    drive,
    make_policy,
)

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
    padding_waste: float = 0.0
    host_timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, tokens)

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


class SimExecutor:
    """Executes scheduler actions against a clock using one CostModel per phase."""

    def __init__(self, prefill_cost: CostModel, decode_cost: CostModel):
        self.cost = {Phase.PREFILL: prefill_cost, Phase.DECODE: decode_cost}
        self.clock = 0.0  # seconds since the start
        self.link = 0.0  # when the host link finishes its queued copies
        self.ready: dict[Hashable, float] = {}  # swapped-in sequence -> when its KV lands
        self.stats = SimStats()

    def execute(self, action, state: SchedulerState) -> list[Hashable]:
        """Advance the clock by `action`; return the ids of sequences that finished in it."""
        finished: list[Hashable] = []
        if action.kind is Kind.RUN:
            finished = self._run(action, state)
        elif action.kind is Kind.SWITCH:
            self._switch(action, state)
        elif action.kind is Kind.SWAP_IN:
            self._swap_in(action, state)
        else:
            self._preempt(action, state)
        return finished

    def _run(self, action: Run, state: SchedulerState) -> list[Hashable]:
        cm = self.cost[state.phase]
        tokens = action.prefill_tokens + len(action.decode)
        pairs = sum(n * s.computed + n * (n + 1) / 2 for s, n in action.prefill)
        pairs += sum(s.computed + 1 for s in action.decode)
        kv = sum(s.computed + n for s, n in action.prefill)  # rows read + written
        kv += sum(s.computed + 1 for s in action.decode)
        start = max([self.clock] + [self.ready.pop(s.seq_id, 0.0) for s in action.decode])
        dt = cm.step_time(len(action.seqs), tokens, pairs, kv, dependent=bool(action.decode))
        self.clock = start + dt
        if action.decode and len(action.decode) >= action.prefill_tokens:
            self.stats.decode_seconds += dt
        else:
            self.stats.prefill_seconds += dt
        if action.decode:
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(action.decode)
        sampling = action.sampling()
        self.stats.tokens_generated += len(sampling)
        if action.prefill_to_host:
            done = [s for s, n in action.prefill if n == s.to_prefill]
            self._copy(cm, sum(s.context_len for s in done), out=True)
        return [s.seq_id for s in sampling if s.generated + 1 >= s.max_output_len]

    def _copy(self, cm: CostModel, tokens: float, out: bool) -> float:
        """Queue a KV copy of `tokens` on the host link; return when it lands."""
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
        if dt and state.device_used:  # KV on the devices is re-sharded through the host
            dt += 2 * src.swap_seconds(state.device_used)
        self.clock = start + dt
        self.stats.transitions += 1
        self.stats.reshard_seconds += dt

    def _swap_in(self, action: SwapIn, state: SchedulerState) -> None:
        cm = self.cost[state.phase]
        for seq in action.seqs:
            self.ready[seq.seq_id] = self._copy(cm, seq.computed, out=False)

    def _preempt(self, action: Preempt, state: SchedulerState) -> None:
        self.stats.preemptions += len(action.seqs)
        if action.mode == "swap":
            self._copy(self.cost[state.phase], sum(s.computed for s in action.seqs), out=True)

    def record_host(self, state: SchedulerState) -> None:
        timeline = self.stats.host_timeline
        if not timeline or timeline[-1][1] != state.host_used:
            timeline.append((self.clock, state.host_used))


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
            "tokens_generated": st.tokens_generated,
            "host_timeline": _downsample(st.host_timeline),
        }


def _downsample(timeline: list, points: int = TIMELINE_POINTS) -> list:
    step = max(1, len(timeline) // points)
    return [[round(t, 4), n] for t, n in timeline[::step]]


def simulate(model: ModelConfig, mesh: MeshPreset, workload: Workload, policy: str,
             prefill: Layout, decode: Layout | None = None, host_kv_gb: float = HOST_KV_GB,
             **policy_options) -> SimResult:
    """Serve `workload` with `policy` on `prefill` (and `decode`, default the same) layouts.

    `prefill_first` on a single layout defaults to chunked prefill (the paper's vLLM baseline).
    Raises ValueError if a layout cannot hold the weights plus the longest request."""
    from jaxpipe.planner.planner import layout_name

    decode = decode or prefill
    cost_p, cost_d = (CostModel(model, mesh.hardware, x) for x in (prefill, decode))
    state = _make_state(model, workload, cost_p, cost_d, host_kv_gb)
    pol = make_policy(policy, **_policy_options(policy, prefill, decode, policy_options))
    executor = SimExecutor(cost_p, cost_d)

    def execute(action, st):
        executor.record_host(st)
        return executor.execute(action, st)

    drive(pol, state, execute)
    executor.record_host(state)
    seconds = max(executor.clock, executor.link)
    return SimResult(policy, layout_name(prefill), layout_name(decode), seconds,
                     workload.total_prompt, workload.total_output, len(state.finished),
                     executor.stats)


def _make_state(model: ModelConfig, w: Workload, cost_p: CostModel, cost_d: CostModel,
                host_kv_gb: float) -> SchedulerState:
    device_kv = min(cost_p.kv_capacity_tokens(), cost_d.kv_capacity_tokens())
    if device_kv < w.max_len:
        raise ValueError(f"layouts {cost_p.layout} / {cost_d.layout} hold {device_kv} tokens of "
                         f"KV beside the weights; the longest request needs {w.max_len}")
    state = SchedulerState(device_kv, MAX_NUM_SEQS * cost_d.layout.pp,
                           host_kv_tokens(model, host_kv_gb))
    state.add_all(SeqInfo(i, p, o) for i, (p, o) in enumerate(w.requests))
    return state


def _policy_options(policy: str, prefill: Layout, decode: Layout, options: dict) -> dict:
    """Token budgets scaled by pipeline depth (one budget per micro-batch, as vLLM's virtual
    engines do) and the chunked-prefill default of the vLLM baseline."""
    opts = dict(options)
    if policy != "seesaw":
        opts.setdefault("two_layouts", prefill != decode)
    if policy == "prefill_first":
        opts.setdefault("chunked", not opts["two_layouts"])
    per_mb = CHUNK_TOKENS_PER_MICROBATCH if opts.get("chunked") else PREFILL_TOKENS_PER_MICROBATCH
    opts.setdefault("max_prefill_tokens", per_mb * prefill.pp)
    return opts
