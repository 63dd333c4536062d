"""Doing what the scheduling policy asks: one action per engine step.

    action = policy.schedule(state)   # Run (prefill | decode) | Switch | SwapIn | Preempt
    execute(action)                   # a jitted static-shape step, a re-shard or a KV move;
                                      # tokens appended, stop checks, finished slots freed
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

from jaxpipe import sampling
from jaxpipe.buckets import Buckets, round_up
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
    SeqInfo,
    Sequence,
    SequenceStatus,
    make_policy,
)


class Executor:
    """The scheduler state, its policy, the KV manager and the counters, over one runner."""

    def __init__(self, config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                 max_model_len: int, requests: dict[str, Sequence]):
        """`requests`: the engine's id -> Sequence map (shared, read here)."""
        self.config, self.runner, self.buckets = config, runner, buckets
        self.max_model_len = max_model_len
        self._requests = requests
        self.state, self.policy, self.kv = _scheduling(config, runner, buckets, num_slots,
                                                       max_model_len)
        self.kv.on_insert = self._landed
        # (time, "decode_start" | "decode_end", rows): with `kv.host.events`, what overlapped.
        self.step_events: deque = deque(maxlen=100_000)
        self.reset_stats()

    def step(self) -> list[Sequence]:
        """Run the policy's next action; returns the sequences that got a token."""
        action = self.policy.schedule(self.state)
        if action is None:
            return []
        stepped = self._execute(action)
        self._note_host()
        return stepped

    def set_policy(self, name: str) -> None:
        self.policy = _policy(name, self.config, self.runner, self.buckets)

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
        prefetcher thread's, which overlaps decode); padding_waste: the fraction of computed
        prefill tokens and decode rows that were padding; host_timeline: [seconds, host tier
        tokens] at each change; device_kv_peak / device_kv_capacity: tokens of the device KV
        pool (whole blocks) in use at most / in all; preemptions: sequences evicted from the
        device (parked, or outgrowing the pool)."""
        s = dict(self._stats)
        host = self.kv.host
        s["transitions"] = s["to_decode"] + s["to_prefill"]
        s["compile_seconds"] = self.runner.compile_seconds
        s["compiled_shapes"] = len(self.runner.compiled)
        steps = s["decode_steps"]
        s["mean_decode_batch"] = s["decode_rows_active"] / steps if steps else 0.0
        real = s["prefill_tokens"] + s["decode_rows_active"]
        padded = s["prefill_padded_tokens"] + s["decode_rows_padded"]
        s["padding_waste"] = 1 - real / padded if padded else 0.0
        s["swap_out_bytes"] = host.bytes_out - self._base["out"]
        s["swap_in_bytes"] = host.bytes_in - self._base["in"]
        s["swap_seconds"] = self.kv.swap_seconds - self._base["swap"]
        prefetch = self.kv.prefetcher.seconds if self.kv.prefetcher else 0.0
        s["prefetch_seconds"] = prefetch - self._base["prefetch"]
        s["device_kv_capacity"] = self.runner.num_blocks * BLOCK
        s["device_kv_peak"] = self.kv.peak_blocks * BLOCK
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
        self.kv.peak_blocks = self.kv.runner.num_blocks - self.kv.free_blocks
        self._t0 = time.perf_counter()
        self._timeline: deque = deque([(0.0, host.used)], maxlen=100_000)

    # ---- one step -----------------------------------------------------------------------------

    def _execute(self, action: Action) -> list[Sequence]:
        """Do `action` and tell the scheduler state what was done."""
        if action.kind is Kind.RUN:
            return self._run_prefill(action) if action.prefill else self._run_decode(action)
        if action.kind is Kind.SWITCH:
            self._switch(action.phase)
        elif action.kind is Kind.SWAP_IN:
            for info in action.seqs:
                self.kv.swap_in(self._requests[info.seq_id])
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
        for info in action.seqs:
            seq = self._requests[info.seq_id]
            if action.mode == "swap":
                self.kv.swap_out(seq, info.computed)
            else:
                self.kv.drop(seq)
                seq.status = SequenceStatus.WAITING
        self._stats["preemptions"] += len(action.seqs)

    def _run_prefill(self, action: Run) -> list[Sequence]:
        """Prefill whole contexts (prompt, plus outputs after a recompute) into free slots;
        with `prefill_to_host` each one's KV then goes to the host tier (asynchronously: the
        next prefill overlaps the copies) and its slot is free again."""
        seqs = []
        for info, tokens in action.prefill:
            if tokens != info.to_prefill:
                raise RuntimeError(f"chunked prefill ({tokens} of {info.to_prefill} tokens of "
                                   f"{info.seq_id!r}) is not supported by the engine")
            seqs.append(self._requests[info.seq_id])
        for seq in seqs:
            self.kv.allocate(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
        for group in self._prefill_groups(seqs):
            self._postprocess(group, self._timed("prefill", self._prefill, group))
        if action.prefill_to_host:
            for seq in seqs:
                if not seq.is_finished:
                    self.kv.swap_out(seq, seq.num_tokens - 1)  # all but the token just sampled
        self.state.apply(action, [s.request_id for s in seqs if s.is_finished])
        return seqs

    def _run_decode(self, action: Run) -> list[Sequence]:
        """Tokens for every sequence whose KV is in its slot — one, or several per call on a
        pipelined decode layout (`runner.decode_steps`); sequences still being swapped in join
        a later call (the prefetcher keeps working meanwhile)."""
        self.kv.deliver()
        seqs = self._decodable(action.decode)
        if not seqs and self.kv.pending:
            self.kv.deliver(block=True)
            seqs = self._decodable(action.decode)
        if not seqs:
            raise RuntimeError(f"decode of {len(action.decode)} sequences, none of them in a "
                               "device slot")
        steps = self._decode_steps(seqs)
        for seq in seqs:  # blocks for the positions this call writes (num_tokens - 1 on)
            self.kv.grow(seq, seq.num_tokens - 1 + steps)
        self.step_events.append((time.perf_counter(), "decode_start", len(seqs)))
        out = self._timed("decode", lambda group: self._decode(group, steps), seqs)
        self.step_events.append((time.perf_counter(), "decode_end", len(seqs)))
        for j in range(steps):  # tokens past a sequence's end are dropped
            live = [i for i, s in enumerate(seqs) if not s.is_finished]
            if not live:
                break
            group = [seqs[i] for i in live]
            ran = Run(decode=[self.state.device[s.request_id] for s in group])
            self._postprocess(group, _step_rows(out, j, live, steps))
            self._stats["decode_rows_active"] += len(group)
            self.state.apply(ran, [s.request_id for s in group if s.is_finished])
        self._stats["decode_steps"] += steps - 1  # _timed counted one: count tokens
        self._stats["decode_calls"] += 1
        return seqs

    def _decode_steps(self, seqs: list[Sequence]) -> int:
        """Tokens per decode call: the runner's `decode_steps`, no more than any sequence can
        still use, fewer if a ban (min_tokens) would lift inside the call (the banned ids
        are fixed for a call), and no more than the free KV blocks let every sequence write
        (the scheduler leaves room for one)."""
        steps = min(self.runner.decode_steps,
                    max(s.max_tokens - len(s.output_token_ids) for s in seqs))
        for s in seqs:
            left = s.params.min_tokens - len(s.output_token_ids)
            if left > 0 and s.extra["stop"].banned(len(s.output_token_ids)):
                steps = min(steps, left)
        while steps > 1 and self._blocks_needed(seqs, steps) > self.kv.free_blocks:
            steps -= 1
        return max(steps, 1)

    def _blocks_needed(self, seqs: list[Sequence], steps: int) -> int:
        return sum(self.kv.blocks_needed(s, s.num_tokens - 1 + steps) for s in seqs)

    def _landed(self, seq: Sequence) -> None:
        """A sequence was swapped (back) into a slot: its penalty state follows it."""
        if sampling.uses_penalties([seq.params]):
            self.runner.restore_penalties(seq.slot, seq.prompt_token_ids, seq.output_token_ids)

    def _decodable(self, infos: list[SeqInfo]) -> list[Sequence]:
        seqs = [self._requests[info.seq_id] for info in infos]
        return [s for s in seqs if self.kv.decodable(s)]

    def _timed(self, kind: str, fn, seqs: list[Sequence]) -> StepOutput:
        start = time.perf_counter()
        out = fn(seqs)
        self._stats[f"{kind}_seconds"] += time.perf_counter() - start
        self._stats[f"{kind}_steps"] += 1
        return out

    def _prefill_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """`seqs` by context length in batches that fit a compiled prefill shape."""
        groups: list[list[Sequence]] = []
        for seq in sorted(seqs, key=lambda s: s.num_tokens):
            if groups and self.buckets.prefill_fits(len(groups[-1]) + 1, seq.num_tokens):
                groups[-1].append(seq)
            else:
                groups.append([seq])
        return groups

    def _prefill(self, seqs: list[Sequence]) -> StepOutput:
        contexts = [s.prompt_token_ids + s.output_token_ids for s in seqs]
        shape = self.buckets.prefill_shape(len(seqs), max(len(c) for c in contexts))
        self._stats["prefill_tokens"] += sum(len(c) for c in contexts)
        self._stats["prefill_padded_tokens"] += shape[0] * shape[1]
        plan = self._sampling_plan(seqs, shape[0])
        return self.runner.prefill(contexts, [s.slot for s in seqs], plan, shape,
                                   [s.prompt_len for s in seqs])

    def _decode(self, seqs: list[Sequence], steps: int) -> StepOutput:
        rows = round_up(max(s.slot for s in seqs) + 1, self.buckets.decode_batch)
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        by_row: list[Sequence | None] = [None] * rows
        for s in seqs:
            tokens[s.slot], positions[s.slot], by_row[s.slot] = s.last_token, s.num_tokens - 1, s
        active = np.array([s is not None for s in by_row])
        self._stats["decode_rows_padded"] += rows * steps
        out = self.runner.decode(tokens, positions, active, self._row_plan(by_row), steps)
        return _select_rows(out, [s.slot for s in seqs])

    def _note_host(self) -> None:
        used = self.kv.host.used
        if self._timeline[-1][1] != used:
            self._timeline.append((round(time.perf_counter() - self._t0, 6), used))

    def _sampling_plan(self, seqs: list[Sequence], rows: int) -> SamplingPlan:
        return self._row_plan(seqs + [None] * (rows - len(seqs)))

    def _row_plan(self, by_row: list[Sequence | None]) -> SamplingPlan:
        active = [s for s in by_row if s is not None]
        neutral = SamplingParams(temperature=0.0)
        params = [s.params if s else neutral for s in by_row]
        seeds = [s.seed if s else 0 for s in by_row]
        steps = [len(s.output_token_ids) if s else 0 for s in by_row]
        banned = [s.extra["stop"].banned(len(s.output_token_ids)) if s else [] for s in by_row]
        tensors = sampling.build_sampling_tensors(params, seeds, steps, banned, len(by_row))
        mode = sampling.sampling_mode(s.params for s in active)
        penalties = sampling.uses_penalties(s.params for s in active)
        wanted = [s.params.logprobs for s in active if s.params.logprobs is not None]
        num = max(wanted) if wanted else None
        return SamplingPlan(tensors, mode, penalties, num)

    def _postprocess(self, seqs: list[Sequence], out: StepOutput) -> None:
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            token = int(out.tokens[i])
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                _record_logprobs(seq, out, i, token)
            reason = seq.extra["stop"].check(seq, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
        self._stats["generated_tokens"] += len(seqs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (the scheduler state is told by the caller) and free its KV."""
        self.kv.drop(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._stats["finished_requests"] += 1


# ---- module helpers ---------------------------------------------------------------------------


def _select_rows(out: StepOutput, rows: list[int]) -> StepOutput:
    pick = np.asarray(rows)
    def take(a):
        return (None if a is None else a[pick])
    return StepOutput(out.tokens[pick], take(out.logprob), take(out.top_ids),
                      take(out.top_logprobs))


def _step_rows(out: StepOutput, step: int, rows: list[int], steps: int) -> StepOutput:
    """Rows `rows` of step `step` of a decode call's output ([n] per field for one step,
    [n, steps] with several)."""
    if steps > 1:
        def take(a):
            return None if a is None else a[:, step]
        out = StepOutput(out.tokens[:, step], take(out.logprob), take(out.top_ids),
                         take(out.top_logprobs))
    return _select_rows(out, rows)


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
    policy = _policy(config.scheduler, config, runner, buckets)
    return state, policy, KVManager(runner, num_slots, host_tokens, state.host_size)


def _policy(name: str, config: EngineConfig, runner: Runner, buckets: Buckets):
    """A policy that switches layouts if the runner's two differ and whose prefill batches
    fit the compiled shapes, grouped by padded length."""
    layouts = runner.layouts
    return make_policy(name, two_layouts=layouts.get("prefill") != layouts.get("decode"),
                       max_prefill_tokens=config.max_num_batched_tokens,
                       batch_fits=buckets.prefill_fits, length_bucket=buckets.prefill_length)


def _new_stats() -> dict:
    keys = ("prefill_seconds", "decode_seconds", "prefill_steps", "decode_steps", "decode_calls",
            "prefill_tokens", "prefill_padded_tokens", "decode_rows_active", "decode_rows_padded",
            "generated_tokens", "finished_requests", "to_decode", "to_prefill",
            "reshards", "reshard_seconds", "preemptions")
    return {k: 0 if not k.endswith("seconds") else 0.0 for k in keys}
