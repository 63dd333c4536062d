"""Doing what the scheduling policy asks: one action per engine step.

    action = policy.schedule(state)   # Run (prompt chunks + decode tokens) | Switch | SwapIn
                                      # | Preempt
    execute(action)                   # one ragged step, a re-shard or a KV move; tokens
                                      # appended, stop checks, finished slots freed
    state.apply(action, finished)     # the scheduler's bookkeeping (jaxpipe.scheduler)

The policy sees only token counts (`SchedulerState`); `KVManager` (jaxpipe/kv/) owns the
physical side: device slots, the host KV tier and the prefetcher. The executor also keeps the
engine's counters (`stats()`).
"""

from __future__ import annotations

import time
from collections import deque

import jax
import numpy as np

from jaxpipe import sampling, step_inputs, step_timing
from jaxpipe.buckets import Buckets
from jaxpipe.config import EngineConfig
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.kv.manager import KVManager
from jaxpipe.runner import Runner, SamplingPlan, StepOutput
from jaxpipe.sampling import SamplingParams
from jaxpipe.scheduler import (
    Action,
    Kind,
    Preempt,
    Run,
    SchedulerState,
    Sequence,
    make_policy,
)
from jaxpipe.scheduler.throttle import ThrottleKnobs
from jaxpipe.step_inputs import Piece

PIPELINED = ("tdpipe", "throttle")  # policies that form one micro-batch per schedule call


class Executor:
    """The scheduler state, its policy, the KV manager and the counters, over one runner."""

    def __init__(self, config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                 max_model_len: int):
        """The policy's actions carry the engine's `Sequence` records themselves."""
        self.config, self.runner, self.buckets = config, runner, buckets
        self.max_model_len = max_model_len
        self.state, self.policy, self.kv = _scheduling(config, runner, buckets, num_slots,
                                                       max_model_len)
        self.kv.on_insert = self._landed
        # (time, "step_start" | "step_end", decode rows): with `kv.host.events`, what overlapped.
        self.step_events: deque = deque(maxlen=100_000)
        self.reset_stats()

    def step(self) -> list[Sequence]:
        """Run the policy's next action; returns the sequences that got a token."""
        if getattr(self.policy, "depth", 1) > 1:
            return self._microbatch_step()
        action = self.policy.schedule(self.state)
        if action is None:
            return []
        stepped = self._execute(action)
        self._note_host()
        return stepped

    def _microbatch_step(self) -> list[Sequence]:
        """For the policies that form one micro-batch per call (tdpipe, throttle): up to
        `policy.depth` of them, launched one after another as a pipelined executor would,
        run as one step (the step's own micro-batches even out their tokens). A micro-batch
        that would overflow the step's token budget is dropped unlaunched; the policy forms
        it again next step."""
        runs: list[Run] = []
        action = None
        while len(runs) < self.policy.depth:
            action = self.policy.schedule(self.state)
            if not isinstance(action, Run):
                break
            if runs and _tokens(runs + [action]) > self.buckets.max_tokens:
                break
            self.state.launch(action)
            runs.append(action)
        if runs:
            return self._run(_merge(runs), runs)
        if action is None:
            return []
        return self._execute(action)

    def set_policy(self, name: str) -> None:
        self.policy = _policy(name, self.config, self.runner, self.buckets,
                              self.state.host_kv_tokens)

    @property
    def generated_tokens(self) -> int:
        return self._stats["generated_tokens"]

    def abort(self, seq: Sequence) -> None:
        self.state.abort(seq.request_id)
        self._finish(seq, "abort")
        self._note_host()

    def stats(self) -> dict:
        """Counters since the engine started or `reset_stats()` (JSON-serialisable).

        transitions: layout phase switches (prefill->decode plus decode->prefill); reshards /
        reshard_seconds: the ones that moved weights; swap_*: the host KV tier (swap_seconds is
        the engine thread's time in swap dispatch, inserts and waits; prefetch_seconds the
        prefetcher thread's, which overlaps decode); padding_waste: the fraction of the steps'
        tokens that were bucket padding; max_step_tokens: the most real tokens one step
        carried; prefill_chunks: prompt pieces prefilled (a prompt split over k steps counts
        k); prefill_seconds / decode_seconds: step time split by each kind's share of the
        step's tokens; mean_decode_batch: decode tokens per step that had any; host_timeline:
        [seconds, host tier tokens] at each change; device_kv_peak / device_kv_capacity:
        tokens of the device KV pool (whole blocks) in use at most / in all; preemptions:
        sequences evicted from the device (parked, or outgrowing the pool)."""
        s = dict(self._stats)
        host = self.kv.host
        s["transitions"] = s["to_decode"] + s["to_prefill"]
        s["compile_seconds"] = self.runner.compile_seconds
        s["compiled_shapes"] = len(self.runner.compiled)
        steps = s["decode_steps"]
        s["mean_decode_batch"] = s["decode_tokens"] / steps if steps else 0.0
        padded = s["step_tokens_padded"]
        s["padding_waste"] = 1 - s["step_tokens"] / padded if padded else 0.0
        s["swap_out_bytes"] = host.bytes_out - self._base["out"]
        s["swap_in_bytes"] = host.bytes_in - self._base["in"]
        s["swap_seconds"] = self.kv.swap_seconds - self._base["swap"]
        prefetch = self.kv.prefetcher.seconds if self.kv.prefetcher else 0.0
        s["prefetch_seconds"] = prefetch - self._base["prefetch"]
        s["device_kv_capacity"] = self.runner.num_blocks * BLOCK
        s["device_kv_peak"] = self.state.peak_blocks * BLOCK
        s["host_kv_capacity"] = host.capacity
        s["host_kv_peak"] = host.peak
        s["host_timeline"] = [list(p) for p in self._timeline]
        return s

    def reset_stats(self) -> None:
        """Zero every counter of `stats()` (the compile counters are the runner's own)."""
        self._stats = _new_stats()
        host = self.kv.host
        self._base = {"out": host.bytes_out, "in": host.bytes_in, "swap": self.kv.swap_seconds,
                      "prefetch": self.kv.prefetcher.seconds if self.kv.prefetcher else 0.0}
        host.peak = host.used
        self.state.peak_blocks = self.state.num_blocks - self.state.free_blocks
        self._t0 = time.perf_counter()
        self._timeline: deque = deque([(0.0, host.used)], maxlen=100_000)

    # ---- one step -----------------------------------------------------------------------------

    def _execute(self, action: Action) -> list[Sequence]:
        """Do `action` and tell the scheduler state what was done."""
        if action.kind is Kind.RUN:
            return self._run(action)
        if action.kind is Kind.SWITCH:
            self._switch(action.phase)
        elif action.kind is Kind.SWAP_IN:
            for info in action.seqs:
                self.kv.swap_in(info)
        else:
            self._preempt(action)
        self.state.apply(action)
        return []

    def _switch(self, phase: str) -> None:
        """Move weights and KV into the layout of `phase` ("prefill" | "decode")."""
        if phase != self.state.phase.value:
            self._stats[f"to_{phase}"] += 1
        seconds = self.runner.set_phase(phase)
        if seconds is not None:
            self._stats["reshards"] += 1
            self._stats["reshard_seconds"] += seconds

    def _preempt(self, action: Preempt) -> None:
        """Evict device sequences: KV to the host tier ("swap") or dropped ("recompute": the
        prompt and outputs so far are prefilled again later)."""
        for seq in action.seqs:
            if action.mode == "swap":
                self.kv.swap_out(seq, seq.computed)
            else:
                self.kv.drop(seq)
        self._stats["preemptions"] += len(action.seqs)

    def _run(self, action: Run, runs: list[Run] | None = None) -> list[Sequence]:
        """One ragged step: every prompt chunk and decode token of `action` in one batch
        (`step_inputs.py`). Sequences still being swapped in join a later step (the
        prefetcher keeps working meanwhile). With `prefill_to_host` each completed prefill's
        KV then goes to the host tier (asynchronously: the next step overlaps the copies).
        `runs`: the launched micro-batches `action` merges, applied one by one."""
        decode = self._ready_decodes(action.decode)
        if runs and len(decode) < len(action.decode):  # launched runs cannot wait for KV
            raise RuntimeError("a micro-batch decodes sequences whose KV is not on the device")
        prefill = [self._prefill_piece(info, n) for info, n in action.prefill]
        completed = [seq for seq, _, done in prefill if done]
        pieces = [p for p in prefill if p[2]]
        pieces += [self._decode_piece(seq) for seq in decode]
        pieces += [p for p in prefill if not p[2]]  # sampled rows first
        sampled = [seq for seq, _, samples in pieces if samples]
        start = time.perf_counter()
        out = self._step([piece for _, piece, _ in pieces], sampled)
        self._count_step(action, len(decode), time.perf_counter() - start)
        self._postprocess(sampled, out)
        if action.prefill_to_host:
            for seq in completed:
                if not seq.is_finished:
                    self.kv.swap_out(seq, seq.num_tokens - 1)  # all but the token just sampled
        finished = {s.request_id for s in sampled if s.is_finished}
        ran = Run(prefill=action.prefill, decode=decode, prefill_to_host=action.prefill_to_host)
        for run in runs or [ran]:
            ended = {s.request_id for s in run.seqs} & finished
            self.state.apply(run, ended)
            self.policy.landed(run, ended, self.state)
        return sampled

    def _ready_decodes(self, infos: list[Sequence]) -> list[Sequence]:
        """The decode sequences whose KV is in the device pool (waits for a swap-in only
        when none is)."""
        if not infos:
            return []
        self.kv.deliver()
        ready = [s for s in infos if self.kv.decodable(s)]
        if not ready and self.kv.pending:
            self.kv.deliver(block=True)
            ready = [s for s in infos if self.kv.decodable(s)]
        if not ready:
            raise RuntimeError(f"decode of {len(infos)} sequences, none of them on the device")
        return ready

    def _prefill_piece(self, seq: Sequence, n: int):
        """(seq, piece, samples) for the next `n` context tokens of `seq`'s prefill (a new
        sequence gets a slot, and its penalty state when it uses penalties)."""
        if seq.computed == 0:
            self.kv.allocate(seq)
            self._landed(seq)
        context = seq.prompt_token_ids + seq.output_token_ids
        start = seq.computed
        blocks = self.state.reserve(seq, start + n)
        self._stats["prefill_chunks"] += 1
        piece = Piece(context[start:start + n], start, list(blocks))
        return seq, piece, start + n == len(context)

    def _decode_piece(self, seq: Sequence):
        """(seq, piece, True): the last sampled token of `seq`, at its position."""
        blocks = self.state.reserve(seq, seq.num_tokens)
        return seq, Piece([seq.last_token], seq.num_tokens - 1, list(blocks)), True

    def _step(self, pieces: list[Piece], sampled: list[Sequence]) -> StepOutput:
        """Build the step's inputs for `pieces` (sampled rows first) and run it."""
        real = sum(len(p.tokens) for p in pieces)
        tokens = self.buckets.tokens(real)
        rows = self.buckets.rows(tokens)
        inputs = step_inputs.build(pieces, tokens, self.runner.microbatches(tokens), rows,
                                   self.runner.max_blocks)
        plan = self.row_plan(sampled, self.buckets.sample_rows(len(sampled)))
        self._stats["step_tokens"] += real
        self._stats["step_tokens_padded"] += tokens
        self._stats["max_step_tokens"] = max(self._stats["max_step_tokens"], real)
        return self.runner.step(inputs, np.array([s.slot for s in sampled], np.int32), plan)

    def _count_step(self, action: Run, decoded: int, seconds: float) -> None:
        """Step counters; a mixed step's seconds are split between prefill and decode by
        their share of its tokens."""
        prefill = action.prefill_tokens
        share = prefill / (prefill + decoded) if prefill + decoded else 0.0
        self._stats["steps"] += 1
        self._stats["prefill_tokens"] += prefill
        self._stats["prefill_seconds"] += seconds * share
        self._stats["decode_seconds"] += seconds * (1 - share)
        self._stats["decode_tokens"] += decoded
        self._stats["decode_steps"] += decoded > 0
        self.step_events.append((time.perf_counter() - seconds, "step_start", decoded))
        self.step_events.append((time.perf_counter(), "step_end", decoded))

    def _landed(self, seq: Sequence) -> None:
        """A sequence moved into a slot (prefill start, or swapped in): its penalty state
        follows it."""
        if sampling.uses_penalties([seq.params]):
            self.runner.restore_penalties(seq.slot, seq.prompt_token_ids, seq.output_token_ids)

    def _note_host(self) -> None:
        used = self.kv.host.used
        if self._timeline[-1][1] != used:
            self._timeline.append((round(time.perf_counter() - self._t0, 6), used))

    def row_plan(self, seqs: list[Sequence], rows: int) -> SamplingPlan:
        """Sampling inputs of `seqs`, padded with neutral rows to `rows`."""
        neutral = SamplingParams(temperature=0.0)
        pad = rows - len(seqs)
        params = [s.params for s in seqs] + [neutral] * pad
        seeds = [s.seed for s in seqs] + [0] * pad
        steps = [len(s.output_token_ids) for s in seqs] + [0] * pad
        banned = [s.stop.banned(len(s.output_token_ids)) for s in seqs] + [[]] * pad
        tensors = sampling.build_sampling_tensors(params, seeds, steps, banned, rows)
        mode = sampling.sampling_mode(s.params for s in seqs)
        penalties = sampling.uses_penalties(s.params for s in seqs)
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        return SamplingPlan(tensors, mode, penalties, max(wanted) if wanted else None)

    def _postprocess(self, seqs: list[Sequence], out: StepOutput) -> None:
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            token = int(out.tokens[i])
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                _record_logprobs(seq, out, i, token)
            reason = seq.stop.check(seq, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
        self._stats["generated_tokens"] += len(seqs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (the scheduler state is told by the caller) and free its KV."""
        self.kv.drop(seq)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._stats["finished_requests"] += 1


# ---- module helpers ---------------------------------------------------------------------------


def _record_logprobs(seq: Sequence, out: StepOutput, i: int, token: int) -> None:
    entry = {token: float(out.logprob[i])}
    n = seq.params.logprobs
    for tid, lp in zip(out.top_ids[i][:n], out.top_logprobs[i][:n], strict=True):
        entry.setdefault(int(tid), float(lp))
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry)


def _scheduling(config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                max_len: int) -> tuple[SchedulerState, object, KVManager]:
    """The scheduler state and policy, and the KV manager with its host tier."""
    pool_tokens = runner.num_blocks * BLOCK
    per_token = sum(x.nbytes for x in jax.tree.leaves(runner.cache)) // pool_tokens
    host_tokens = config.host_kv_tokens
    if host_tokens is None:
        host_tokens = int(config.host_kv_gb * 2**30 // per_token)
    # The host tier keeps each sequence rounded up to 1/16 of max_model_len (>= 16 tokens),
    # so its copy programs compile for at most 16 lengths.
    unit = -(-max(16, -(-max_len // 16)) // 16) * 16
    state = SchedulerState(pool_tokens, num_slots, host_tokens, host_unit=unit,
                           device_unit=BLOCK)
    policy = _policy(config.scheduler, config, runner, buckets, host_tokens)
    return state, policy, KVManager(runner, state, num_slots, host_tokens)


def _policy(name: str, config: EngineConfig, runner: Runner, buckets: Buckets,
            host_tokens: int):
    """A policy that switches layouts if the runner's two differ, with the step's token
    budget for prompt chunks. "auto": seesaw over two layouts and a host tier, else
    prefill_first (continuous batching: nothing to gain from phases on one layout).
    tdpipe and throttle form pp micro-batches per step on the prefill layout."""
    layouts = runner.layouts
    two = layouts["prefill"] != layouts["decode"]
    if name == "auto":
        name = "seesaw" if two and host_tokens > 0 else "prefill_first"
    budget = min(config.max_num_batched_tokens, buckets.max_tokens)
    if name not in PIPELINED:
        return make_policy(name, two_layouts=two, max_prefill_tokens=budget)
    depth = layouts["prefill"].pp
    opts = {"pipeline_depth": depth, "max_prefill_tokens": max(1, budget // depth)}
    if name == "throttle":
        opts["knobs"] = ThrottleKnobs(config.throttle_iterations, config.throttle_max_prefill,
                                      config.throttle_min_prefill, config.throttle_kv_thresh)
    else:
        opts["predictor"] = config.tdpipe_predictor
        opts["finish_ratio"] = config.tdpipe_finish_ratio
        if config.tdpipe_finish_ratio is None:
            opts["timing"] = step_timing.load_or_measure(runner, buckets, depth,
                                                         config.model, config.dtype)
    return make_policy(name, **opts)


def _tokens(runs: list[Run]) -> int:
    return sum(r.prefill_tokens + len(r.decode) for r in runs)


def _merge(runs: list[Run]) -> Run:
    """One step's worth of micro-batches as one Run."""
    return Run(prefill=[p for r in runs for p in r.prefill],
               decode=[s for r in runs for s in r.decode])


def _new_stats() -> dict:
    keys = ("prefill_seconds", "decode_seconds", "steps", "decode_steps", "prefill_tokens",
            "prefill_chunks", "decode_tokens", "step_tokens", "step_tokens_padded",
            "max_step_tokens", "generated_tokens", "finished_requests", "to_decode",
            "to_prefill", "reshards", "reshard_seconds", "preemptions")
    return {k: 0 if not k.endswith("seconds") else 0.0 for k in keys}
