"""Doing what the scheduling policy asks: one action per engine step.

    action = policy.schedule(state)   # Run (prompt chunks + decode tokens) | Switch | SwapIn
                                      # | Preempt
    execute(action)                   # one ragged step, a re-shard or a KV move; tokens
                                      # appended, stop checks, finished slots freed
    state.apply(action, finished)     # the scheduler's bookkeeping (jaxpipe.scheduler)

The policy sees only token counts (`SchedulerState`, which also gives out the device blocks
and slots); `KVManager` (jaxpipe/kv/) moves the bytes: the host KV tier and the prefetcher.
The executor also keeps the engine's counters (`stats()`) and the step timeline
(`timeline.py`).

Overlap (`EngineConfig.overlap`): a Run is applied to the state when its step is dispatched,
and the step before it lands (tokens appended, stop checks) only after that, so the host's
work runs while the device computes; decode tokens not yet on the host are fed from the step
in flight on the device. Any other action waits for the step in flight to land first.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from jaxpipe import sampling, sizing, step_inputs, step_timing
from jaxpipe.buckets import Buckets
from jaxpipe.config import EngineConfig
from jaxpipe.distributed import MirroredRunner
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.kv.manager import KVManager
from jaxpipe.runner import Dispatched, HostSampled, Runner, SamplingPlan, StepOutput
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
from jaxpipe.scheduler.policy import launch_step
from jaxpipe.scheduler.throttle import ThrottleKnobs
from jaxpipe.step_inputs import Piece
from jaxpipe.stopping import DetokWorker
from jaxpipe.timeline import StepRecord, Timeline

PIPELINED = ("tdpipe", "throttle")  # policies that form one micro-batch per schedule call


class Executor:
    """The scheduler state, its policy, the KV manager and the counters, over one runner."""

    def __init__(self, config: EngineConfig, runner: Runner, buckets: Buckets, num_slots: int,
                 max_model_len: int, host_bytes: float):
        """The policy's actions carry the engine's `Sequence` records themselves.
        host_bytes: the host KV tier's budget (sizing.size; host_kv_tokens wins)."""
        self.config, self.runner, self.buckets = config, runner, buckets
        self.max_model_len = max_model_len
        self.state, self.policy, self.kv = _scheduling(config, runner, buckets, num_slots,
                                                       max_model_len, host_bytes)
        self.kv.on_insert = self._landed
        self.detok = DetokWorker()  # used by the requests added while config.detok_worker
        self._flight: Flight | None = None  # the step dispatched and not yet landed
        self._overlap = config.overlap  # set_overlap flips it on an idle engine
        self.reset_stats()

    @property
    def overlap(self) -> bool:
        """Whether a step is dispatched before the previous one's tokens are on the host
        (`EngineConfig.overlap`; the pipelined policies already keep pp micro-batches in
        each step and land every step before scheduling the next)."""
        return self._overlap and self.policy.depth == 1

    def set_overlap(self, on: bool) -> None:
        """Overlap steps from now on, or land each before the next (Engine.set_overlap)."""
        self._overlap = bool(on)

    def has_work(self) -> bool:
        """Whether a request is unfinished: in the scheduler state, or (already freed: its
        last token) in the step in flight."""
        flight = self._flight
        return self.state.has_work() or (
            flight is not None and any(not s.is_finished for s in flight.released))

    def step(self) -> list[Sequence]:
        """Run the policy's next action; returns the sequences that got a token (with
        overlap, those of the step before the one this call dispatched)."""
        if self.policy.depth > 1:
            return self._microbatch_step()
        start = time.perf_counter()
        action = self.policy.schedule(self.state)
        self.timeline.part("schedule", start)
        if action is not None and action.kind is Kind.RUN:
            return self._run(action)
        landed = self._land()  # everything else waits for the step in flight
        if action is not None:
            self._execute(_without_finished(action))
        self._note_host()
        return landed

    def _microbatch_step(self) -> list[Sequence]:
        """For the policies that form one micro-batch per call (tdpipe, throttle): up to
        `policy.depth` of them, launched one after another as a pipelined executor would,
        run as one step (the step's own micro-batches even out their tokens; see
        `launch_step` for the step's token budget)."""
        runs, action = launch_step(self.policy, self.state, self.buckets.max_tokens)
        if runs:
            return self._run(_merge(runs), runs)
        if action is None:
            return []
        return self._execute(action)

    def close(self) -> None:
        """Wait for the step in flight, stop the threads and free the device and host KV."""
        if self._flight is not None:
            self._flight.out.wait()
            self._flight = None
        self.kv.close()
        self.detok.close()
        self.runner.close()

    def set_policy(self, config: EngineConfig) -> None:
        """Schedule with `config`'s policy (its scheduler and knobs) from now on."""
        self.policy = _policy(config.scheduler, config, self.runner, self.buckets,
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
        reshard_seconds: the ones that moved something, split into reshard_weights_seconds and
        reshard_kv_seconds (the blocks live sequences hold, reshard_kv_blocks of them, moved
        into the new layout's empty pool, whose making is counted too); swap_*: the host KV tier
        (swap_seconds is the engine thread's time in swap dispatch, inserts and waits;
        prefetch_seconds the prefetcher thread's, which overlaps decode); padding_waste: the
        fraction of the steps' tokens that were bucket padding; max_step_tokens: the most real
        tokens one step carried; prefill_chunks: prompt pieces prefilled (a prompt split over k
        steps counts k); prefill_seconds / decode_seconds: step time split by each kind's share
        of the step's tokens; mean_decode_batch: decode tokens per step that had any;
        host_timeline: [seconds, host tier tokens] at each change; device_kv_peak /
        device_kv_capacity: tokens of the device KV pool (whole blocks) in use at most / in all;
        preemptions: sequences evicted from the device (parked, or outgrowing the pool);
        device_idle_fraction,
        decode_wall_seconds, decode_idle_seconds, host_seconds, host_ms_per_step: the step
        timeline's (`timeline.py`); fed_steps: steps that took some input token from the step
        before on the device (overlap); added_requests / prompt_tokens: requests queued and
        their prompts' tokens; finish_reasons: finished requests by reason ("stop",
        "length", "abort"); step_latency: each step's dispatch-to-tokens-on-host seconds as
        histogram counts by kind ("prefill", "decode", "mixed") over step_latency_bounds;
        kernels: what runs the step (`Runner.kernel_choices`: the attention and each matmul's
        implementation by row count, as measured on this machine);
        control_messages, control_bytes, control_seconds (several processes only): the
        leader's calls sent to each follower, their pickled bytes and the seconds sending.
        Gauges of the moment (not reset): waiting_requests, device_requests, host_requests
        (sequences queued, on the device, parked in the host tier), device_kv_used and
        host_kv_used (tokens)."""
        s = dict(self._stats)
        host = self.kv.host
        s["transitions"] = s["to_decode"] + s["to_prefill"]
        s["compile_seconds"] = self.runner.compile_seconds
        s["compiled_shapes"] = len(self.runner.compiled)
        s["kernels"] = self.runner.kernel_choices()
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
        s["host_kv_capacity"] = self.state.host_kv_tokens
        s["host_kv_peak"] = self.state.host_peak
        s["host_timeline"] = [list(p) for p in self._host_timeline]
        s["finish_reasons"] = dict(self._finish_reasons)
        s.update(self._gauges())
        s.update(self.timeline.stats())
        if isinstance(self.runner, MirroredRunner):
            s.update({k: v - self._base[k] for k, v in self.runner.leader.stats().items()})
        return s

    def _gauges(self) -> dict:
        """What the engine holds now (not counters: `reset_stats` leaves them)."""
        st = self.state
        return {"waiting_requests": len(st.waiting), "device_requests": len(st.device),
                "host_requests": len(st.host), "device_kv_used": st.device_used,
                "host_kv_used": st.host_used}

    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence."""
        self.state.add(seq)
        self._stats["added_requests"] += 1
        self._stats["prompt_tokens"] += len(seq.prompt_token_ids)

    def reset_stats(self) -> None:
        """Zero every counter of `stats()` (the compile counters are the runner's own)."""
        self._stats = _new_stats()
        self._finish_reasons: dict[str, int] = {}
        host = self.kv.host
        self._base = {"out": host.bytes_out, "in": host.bytes_in, "swap": self.kv.swap_seconds,
                      "prefetch": self.kv.prefetcher.seconds if self.kv.prefetcher else 0.0}
        if isinstance(self.runner, MirroredRunner):
            self._base.update(self.runner.leader.stats())
        self.state.host_peak = self.state.host_used
        self.state.peak_blocks = self.state.num_blocks - self.state.free_blocks
        self._t0 = self._last_fetch = time.perf_counter()
        self.timeline = Timeline()
        self._host_timeline: deque = deque([(0.0, self.state.host_used)], maxlen=100_000)

    # ---- one step -----------------------------------------------------------------------------

    def _execute(self, action: Action) -> list[Sequence]:
        """Do `action` and tell the scheduler state what was done."""
        if action.kind is Kind.RUN:
            return self._run(action)
        record = self.timeline.dispatch(action.kind.value, time.perf_counter())
        self.kv.flush()  # a switch moves only held blocks; swaps and preemptions reuse them
        if action.kind is Kind.SWAP_IN:
            self.state.apply(action)  # first: the state gives the blocks the KV goes into
            for info in action.seqs:
                self.kv.swap_in(info)
        else:
            if action.kind is Kind.SWITCH:
                self._switch(action.phase)
            else:
                self._preempt(action)
            self.state.apply(action)  # after: a preemption's KV is queued from its blocks
        self.timeline.done(record)
        return []

    def _switch(self, phase: str) -> None:
        """Move weights and KV into the layout of `phase` ("prefill" | "decode")."""
        if phase != self.state.phase.value:
            self._stats[f"to_{phase}"] += 1
        moved = self.runner.set_phase(phase, self.state.held_blocks())
        if moved is not None:
            self._stats["reshards"] += 1
            self._stats["reshard_seconds"] += moved.seconds
            self._stats["reshard_weights_seconds"] += moved.weights_seconds
            self._stats["reshard_kv_seconds"] += moved.kv_seconds
            self._stats["reshard_kv_blocks"] += moved.kv_blocks

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
        """Dispatch one ragged step (`_launch`), then land the step before it (overlap) or
        this one (no overlap). Returns the sequences that got a token in the landed step."""
        flight = self._launch(action, runs)
        landed = self._land(after=flight)
        self._flight = flight
        if not self.overlap:
            landed += self._land()
        self._note_host()
        return landed

    def _launch(self, action: Run, runs: list[Run] | None) -> Flight | None:
        """Build and dispatch one ragged step: every prompt chunk and decode token of
        `action` in one batch (`step_inputs.py`), and apply it to the scheduler state at
        once (a sequence's next token is then in flight; its stop is learnt when it lands).
        Decode tokens not yet on the host are fed from the step in flight, on the device.
        Sequences still being swapped in join a later step (the prefetcher keeps working
        meanwhile). With `prefill_to_host` each completed prefill's
        KV then goes to the host tier (asynchronously: later steps overlap the copies).
        A sequence whose token in this step is certainly its last is freed at once.
        `runs`: the launched micro-batches `action` merges, applied one by one."""
        start = time.perf_counter()
        decode = self._ready_decodes(action.decode)
        if runs and len(decode) < len(action.decode):  # launched runs cannot wait for KV
            raise RuntimeError("a micro-batch decodes sequences whose KV is not on the device")
        ran = Run(prefill=action.prefill, decode=decode, prefill_to_host=action.prefill_to_host)
        if not runs:
            self.state.launch(ran)  # the state gives the blocks the step writes
        prefill = [self._prefill_piece(info, n) for info, n in action.prefill]
        pieces = [p for p in prefill if p[2]]
        pieces += [self._decode_piece(seq) for seq in decode]
        pieces += [p for p in prefill if not p[2]]  # sampled rows first
        if not pieces:
            return None
        sampled = [seq for seq, _, samples in pieces if samples]
        inputs = self._inputs([piece for _, piece, _ in pieces])
        start = self.timeline.part("build", start)
        plan = self.row_plan(sampled, self.buckets.sample_rows(len(sampled)))
        start = self.timeline.part("sample", start)
        prev = self._flight.out if self._flight is not None else None
        feeds = any(p.feed >= 0 for _, p, _ in pieces)
        if feeds and isinstance(prev, HostSampled):  # its tokens are needed on the device:
            _, start = self._bring(self._flight)  # the device waits for the host sampler
        start = self._flush_swaps(start)
        out = self.runner.dispatch(inputs, np.array([s.slot for s in sampled], np.int32), plan,
                                   prev)
        record = self.timeline.dispatch("step", start, len(decode), action.prefill_tokens, out)
        self.timeline.part("dispatch", start, record)
        if action.prefill_to_host:
            for seq, piece, done in prefill:
                if done:  # all but the token being sampled
                    self.kv.swap_out(seq, piece.start + len(piece.tokens))
        for run in runs or [ran]:
            self.state.apply(run)
        last = [s for s in sampled if s.at_length(s.generated, self.max_model_len)]
        self._release(last)  # their token in flight is certainly their last
        self._count_step(ran)
        self._stats["fed_steps"] += feeds
        return Flight(runs or [ran], sampled, out, record, last)

    def _flush_swaps(self, start: float) -> float:
        """Read queued swap-outs out of the pool before this step reuses their blocks, once
        the step in flight (which wrote them) is done: the wait is the device's, timed as
        the timeline's, and swap_seconds only the reads. Returns now."""
        if not self.kv.outgoing:
            return start
        if self._flight is not None and self._flight.out is not None:
            self._flight.out.wait()
            self.timeline.finished(self._flight.record, start)
        self.kv.flush()
        return time.perf_counter()

    def _land(self, after: Flight | None = None) -> list[Sequence]:
        """Bring the step in flight's tokens to the host: append them, stop checks, free what
        finished (a sequence that finished or was aborted meanwhile gets no token from it).
        `after`: the step just dispatched, whose released sequences the state has freed
        already (one may end here, a step early, by EOS or a stop). Returns the sequences
        that got a token."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        record = flight.record
        out, start = self._bring(flight)
        live = [(i, s) for i, s in enumerate(flight.sampled) if not s.is_finished]
        self._postprocess(live, out)
        self.detok.commit()
        ended = {s.request_id for _, s in live if s.is_finished}
        freed = flight.released + (after.released if after is not None else [])
        self.state.finish(ended - {s.request_id for s in freed})
        matched = self._stop_string_matches()
        self._tell_policy(flight.runs, ended | {s.request_id for s in matched})
        self._count_seconds(flight.runs, record.fetched - max(record.dispatch, self._last_fetch))
        self._last_fetch = record.fetched
        self.timeline.part("postprocess", start, record)
        return [s for _, s in live] + [s for s in matched if s not in flight.rows]

    def _tell_policy(self, runs: list[Run], ended: set[str]) -> None:
        """Hand each landed run's sequences that ended as it landed (by their own token, or
        by a stop string the detokenizer worker found now) to the policy's `landed`: the
        state no longer holds them, and other finishes (aborts, a stop string of a
        sequence in no landed run) are no run's outcome."""
        for run in runs:
            self.policy.landed(run, [s for s in run.seqs if s.request_id in ended], self.state)

    def _release(self, seqs: list[Sequence]) -> None:
        """Free the slots and KV of sequences whose token in flight is their last, at once:
        the next step may admit others in their place, as it would had the token landed
        (device work runs in dispatch order, so the step in flight still reads their KV).
        They finish, with that token, when it lands."""
        self.state.finish(s.request_id for s in seqs)
        for seq in seqs:
            self.kv.drop(seq)

    def _bring(self, flight: Flight) -> tuple[StepOutput, float]:
        """Wait for the step in flight and bring its results to the host (a host-sampled
        step is sampled here, once). Returns (results, now)."""
        start = time.perf_counter()
        flight.out.wait()
        self.timeline.waited(flight.record, start)
        start = time.perf_counter()
        out = flight.out.fetch()
        return out, self.timeline.part("sample", start, flight.record)

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
        sequence's slot, the state's, gets its penalty state when it uses penalties)."""
        if seq.computed == 0:
            self._landed(seq)
        context = seq.prompt_token_ids + seq.output_token_ids
        start = seq.computed
        self._stats["prefill_chunks"] += 1
        piece = Piece(context[start:start + n], start, list(seq.blocks))
        return seq, piece, start + n == len(context)

    def _decode_piece(self, seq: Sequence):
        """(seq, piece, True): `seq`'s newest token at its position: from the host, or (its
        token still in flight) from the step in flight's sampled row on the device."""
        position = seq.context_len - 1
        blocks = list(seq.blocks)
        if len(seq.output_token_ids) == seq.generated:
            return seq, Piece([seq.last_token], position, blocks), True
        row = self._flight.rows.get(seq, -1) if self._flight is not None else -1
        if row < 0:
            raise RuntimeError(f"{seq.request_id!r}'s newest token is in no step in flight")
        return seq, Piece([0], position, blocks, feed=row), True

    def _inputs(self, pieces: list[Piece]):
        """The step's inputs for `pieces` (sampled rows first), in a token bucket."""
        real = sum(len(p.tokens) for p in pieces)
        tokens = self.buckets.tokens(real)
        self._stats["step_tokens"] += real
        self._stats["step_tokens_padded"] += tokens
        self._stats["max_step_tokens"] = max(self._stats["max_step_tokens"], real)
        return step_inputs.build(pieces, tokens, self.runner.microbatches(tokens),
                                 self.buckets.rows(tokens), self.runner.max_blocks)

    def _count_seconds(self, runs: list[Run], seconds: float) -> None:
        """A landed step's seconds (since it started or the step before landed, whichever
        is later), split between prefill and decode by their share of its tokens."""
        prefill = sum(r.prefill_tokens for r in runs)
        decoded = sum(len(r.decode) for r in runs)
        share = prefill / (prefill + decoded) if prefill + decoded else 0.0
        self._stats["prefill_seconds"] += seconds * share
        self._stats["decode_seconds"] += seconds * (1 - share)

    def _count_step(self, ran: Run) -> None:
        """Step counters (the step's seconds are counted when it lands)."""
        decoded = len(ran.decode)
        self._stats["steps"] += 1
        self._stats["prefill_tokens"] += ran.prefill_tokens
        self._stats["decode_tokens"] += decoded
        self._stats["decode_steps"] += decoded > 0

    def _landed(self, seq: Sequence) -> None:
        """A sequence moved into a slot (prefill start, or swapped in): its penalty state
        follows it."""
        if sampling.uses_penalties([seq.params]):
            self.runner.restore_penalties(seq.slot, seq.prompt_token_ids, seq.output_token_ids)

    def _note_host(self) -> None:
        used = self.state.host_used
        if self._host_timeline[-1][1] != used:
            self._host_timeline.append((round(time.perf_counter() - self._t0, 6), used))

    def row_plan(self, seqs: list[Sequence], rows: int) -> SamplingPlan:
        """Sampling inputs of `seqs`, padded with neutral rows to `rows`."""
        neutral = SamplingParams(temperature=0.0)
        pad = rows - len(seqs)
        params = [s.params for s in seqs] + [neutral] * pad
        seeds = [s.seed for s in seqs] + [0] * pad
        steps = [s.generated for s in seqs] + [0] * pad  # tokens sampled before (in flight too)
        banned = [s.stop.banned(s.generated) for s in seqs] + [[]] * pad
        tensors = sampling.build_sampling_tensors(params, seeds, steps, banned, rows)
        mode = sampling.sampling_mode(s.params for s in seqs)
        penalties = sampling.uses_penalties(s.params for s in seqs)
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        return SamplingPlan(tensors, mode, penalties, max(wanted) if wanted else None)

    def _postprocess(self, rows: list[tuple[int, Sequence]], out: StepOutput) -> None:
        """Append row i's token to its sequence for each (i, seq); logprobs, stop checks."""
        now = time.perf_counter()
        for i, seq in rows:
            token = int(out.tokens[i])
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                _record_logprobs(seq, out, i, token)
            reason = seq.stop.check(seq, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
        self._stats["generated_tokens"] += len(rows)

    def _stop_string_matches(self) -> list[Sequence]:
        """End the running requests whose stop string the detokenizer worker found (cut back
        to the token that completed it), wherever the scheduler has them; returns them."""
        ended = [seq for seq in self.detok.drain() if not seq.is_finished]
        for seq in ended:
            self._finish(seq, None)
            self.state.abort(seq.request_id)
        return ended

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        """End `seq` (the scheduler state is told by the caller) and free its KV. A stop
        string the worker found on an earlier token ends it there instead (`settle`)."""
        had = len(seq.output_token_ids)
        reason = seq.stop.settle(seq, reason)
        self._stats["generated_tokens"] -= had - len(seq.output_token_ids)
        self.kv.drop(seq)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._stats["finished_requests"] += 1
        self._finish_reasons[reason] = self._finish_reasons.get(reason, 0) + 1


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
                max_len: int, host_bytes: float) -> tuple[SchedulerState, object, KVManager]:
    """The scheduler state and policy, and the KV manager with its host tier."""
    pool_tokens = runner.num_blocks * BLOCK
    host_tokens = sizing.host_tokens(config, host_bytes, runner.cache, pool_tokens)
    # The host tier keeps each sequence in whole swap chunks (`Runner.kv_chunk`).
    state = SchedulerState(pool_tokens, num_slots, host_tokens, host_unit=runner.kv_chunk,
                           device_unit=BLOCK)
    policy = _policy(config.scheduler, config, runner, buckets, host_tokens)
    mirror = runner.leader.send if isinstance(runner, MirroredRunner) else None
    return state, policy, KVManager(runner, host_tokens > 0, mirror=mirror)


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


@dataclass
class Flight:
    """A dispatched step on its way: the runs it applied, its sampled sequences (row order),
    the runner's handle and its timeline record."""

    runs: list[Run]
    sampled: list[Sequence]
    out: Dispatched | HostSampled
    record: StepRecord
    released: list[Sequence]  # sampled sequences already freed: this token is their last

    def __post_init__(self):
        self.rows = {seq: i for i, seq in enumerate(self.sampled)}  # seq -> its sampled row


def _without_finished(action: Action) -> Action:
    """`action` decided before the step in flight landed, less the sequences that ended in
    it (a swap-in or preemption of a finished sequence is void)."""
    if action.kind in (Kind.SWAP_IN, Kind.PREEMPT):
        return dataclasses.replace(action, seqs=[s for s in action.seqs if not s.is_finished])
    return action


def _merge(runs: list[Run]) -> Run:
    """One step's worth of micro-batches as one Run."""
    return Run(prefill=[p for r in runs for p in r.prefill],
               decode=[s for r in runs for s in r.decode])


def _new_stats() -> dict:
    keys = ("prefill_seconds", "decode_seconds", "steps", "decode_steps", "prefill_tokens",
            "prefill_chunks", "decode_tokens", "step_tokens", "step_tokens_padded",
            "max_step_tokens", "generated_tokens", "fed_steps", "finished_requests", "to_decode",
            "to_prefill", "reshards", "reshard_seconds", "reshard_weights_seconds",
            "reshard_kv_seconds", "reshard_kv_blocks", "preemptions", "added_requests",
            "prompt_tokens")
    return {k: 0 if not k.endswith("seconds") else 0.0 for k in keys}
