"""The engine's counters and step timeline: what `Engine.stats()` reports.

`EngineStats` is told what happened and counts it; it decides nothing:

  added(seq)              a request queued
  dispatched(step)        a ragged step went to the device (`step_builder.Step`)
  landed(runs, record)    a step's tokens are on the host: its seconds, split prefill / decode
  generated(n)            tokens appended (negative: cut back to a stop string)
  finished(reason)        a request ended ("stop", "length", "abort")
  switched / preempted    a layout switch, sequences evicted from the device
  note_host()             the host tier's occupancy, when it changed

It reads the gauges of the moment (queues, KV in use) from the scheduler state and the KV
manager, and the swap, compile, control-channel and prefix-cache counters from their owners
(the prefix cache's are the block pool's), as differences from what they were at `reset()`.
The step timeline is `timeline.py`'s.

What `snapshot()` (`Engine.stats()`) reports, JSON-serialisable; counters since the engine
started or `reset()` unless said otherwise:

  steps: steps dispatched; decode_steps: those with decode tokens; mean_decode_batch: decode
    tokens per step that had any; prefill_chunks: prompt pieces prefilled (a prompt split
    over k steps counts k); max_step_tokens: the most real tokens one step carried;
    padding_waste: the fraction of the steps' tokens that were bucket padding; fed_steps:
    steps that took some input token from the step before on the device (overlap);
    prefill_seconds / decode_seconds: step time split by each kind's share of the step's
    tokens.
  device_idle_fraction, decode_wall_seconds, decode_idle_seconds, host_seconds,
    host_ms_per_step: the step timeline's (`timeline.py`); step_latency: each step's
    dispatch-to-tokens-on-host seconds as histogram counts by kind ("prefill", "decode",
    "mixed") over step_latency_bounds.
  added_requests / prompt_tokens: requests queued and their prompts' tokens; finish_reasons:
    finished requests by reason ("stop", "length", "abort"); preemptions: sequences evicted
    from the device (parked, or outgrowing the pool).
  transitions: layout phase switches (prefill->decode plus decode->prefill); reshards /
    reshard_seconds: the ones that moved something, split into reshard_weights_seconds and
    reshard_kv_seconds (the blocks live sequences hold, reshard_kv_blocks of them, moved into
    the new layout's empty pool, whose making is counted too).
  compile_seconds, compiled_shapes: the runner's compilation (never reset); kernels: what runs
    the step (`Runner.kernel_choices`: the attention and each matmul's implementation by row
    count, as measured on this machine).
  swap_*: the host KV tier (swap_seconds is the engine thread's time in swap dispatch,
    inserts and waits; prefetch_seconds the prefetcher thread's, which overlaps decode);
    host_timeline: [seconds, host tier tokens] at each change; device_kv_peak /
    device_kv_capacity: tokens of the device KV pool (whole blocks) in use at most / in all;
    host_kv_peak / host_kv_capacity: the host tier's, in tokens.
  control_messages, control_bytes, control_seconds (several processes only): the leader's
    calls sent to each follower, their pickled bytes and the seconds sending.
  prefix_cache_queried_tokens / prefix_cache_hit_tokens: context tokens looked up in the
    prefix cache as sequences entered the device (a recomputed one again) / found cached
    there (whole blocks), prefix_cache_hit_rate the second over the first (0 with
    `prefix_caching` off), prefix_cache_device_hit_tokens / prefix_cache_host_hit_tokens:
    the hit tokens found in the device pool / copied back from the host tier,
    prefix_cache_evictions: cached blocks nobody held given out for new KV (each kept in the
    host tier where it has room: prefix_cache_host_stored_blocks),
    prefix_cache_host_evictions: blocks the host tier forgot, prefix_cache_host_bytes_out /
    _in: their bytes copied there / back. forked_samples / fork_copied_blocks: samples of
    n > 1 requests that shared their prompt's blocks / the partly filled blocks they copied.
  pipeline_stage_busy_seconds / pipeline_stage_idle_seconds: per layout phase, each pipeline
    stage's seconds running a micro-batch / none, over pipeline_wall_seconds (the ticks'
    time and the host's gaps between them while a micro-batch was in flight; on one stage
    the one stage's); pipeline_bubble_fraction: the stages' idle time over pp x the wall
    time, every layout (`runtime/flow.py` times the ticks).
  Gauges of the moment (not reset): waiting_requests, device_requests, host_requests
    (sequences queued, on the device, parked in the host tier), device_kv_used and
    host_kv_used (tokens).
"""

from __future__ import annotations

import time
from collections import deque

from jaxpipe.engine.timeline import StepRecord, Timeline
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.scheduler import Run, Sequence

_COUNTERS = ("prefill_seconds", "decode_seconds", "steps", "decode_steps", "prefill_tokens",
             "prefill_chunks", "decode_tokens", "step_tokens", "step_tokens_padded",
             "max_step_tokens", "generated_tokens", "fed_steps", "finished_requests", "to_decode",
             "to_prefill", "reshards", "reshard_seconds", "reshard_weights_seconds",
             "reshard_kv_seconds", "reshard_kv_blocks", "preemptions", "added_requests",
             "prompt_tokens")


class EngineStats:
    """Counters since the engine started or `reset()`, the step timeline and the host tier's
    occupancy timeline, over one runner, scheduler state and KV manager."""

    def __init__(self, runner, state, kv):
        self.runner, self.state, self.kv = runner, state, kv
        self.reset()

    def reset(self) -> None:
        """Zero every counter (the compile counters are the runner's own) and start a new
        timeline. The device and host KV peaks restart from what is in use now."""
        self.counts = {k: 0.0 if k.endswith("seconds") else 0 for k in _COUNTERS}
        self.finish_reasons: dict[str, int] = {}
        # what the counters kept by their owners were at reset (`_since_reset`)
        self._base = {**self._swap_totals(), **self._prefix_cache(),
                      **self.runner.control_stats()}
        self._stage_base = self.runner.ticks.stage_times()
        self.state.device_kv.reset_peak()
        self.state.host_kv.reset_peak()
        self._t0 = self._last_fetch = time.perf_counter()
        self.timeline = Timeline()
        self._host_timeline: deque = deque([(0.0, self.state.host_kv.used)], maxlen=100_000)

    # ---- what happened -------------------------------------------------------------------------

    def added(self, seq: Sequence) -> None:
        self.counts["added_requests"] += 1
        self.counts["prompt_tokens"] += len(seq.prompt_token_ids)

    def dispatched(self, step) -> None:
        """A built step (`step_builder.Step`) went to the device (its seconds are counted
        when it lands)."""
        c, run = self.counts, step.run
        c["steps"] += 1
        c["prefill_chunks"] += len(run.prefill)
        c["prefill_tokens"] += run.prefill_tokens
        c["decode_tokens"] += len(run.decode)
        c["decode_steps"] += bool(run.decode)
        c["step_tokens"] += step.tokens
        c["step_tokens_padded"] += step.padded
        c["max_step_tokens"] = max(c["max_step_tokens"], step.tokens)
        c["fed_steps"] += step.feeds

    def landed(self, runs: list[Run], record: StepRecord) -> None:
        """A step's tokens reached the host: its seconds (since it started or the step before
        landed, whichever is later), split between prefill and decode by their share of its
        tokens."""
        seconds = record.fetched - max(record.dispatch, self._last_fetch)
        self._last_fetch = record.fetched
        prefill = sum(r.prefill_tokens for r in runs)
        decoded = sum(len(r.decode) for r in runs)
        share = prefill / (prefill + decoded) if prefill + decoded else 0.0
        self.counts["prefill_seconds"] += seconds * share
        self.counts["decode_seconds"] += seconds * (1 - share)

    def generated(self, n: int) -> None:
        self.counts["generated_tokens"] += n

    def finished(self, reason: str) -> None:
        self.counts["finished_requests"] += 1
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def switched(self, phase: str, moved) -> None:
        """A switch to `phase`'s layout; `moved`: what `Runner.set_phase` moved, or None."""
        if phase != self.state.phase.value:
            self.counts[f"to_{phase}"] += 1
        if moved is not None:
            self.counts["reshards"] += 1
            self.counts["reshard_seconds"] += moved.seconds
            self.counts["reshard_weights_seconds"] += moved.weights_seconds
            self.counts["reshard_kv_seconds"] += moved.kv_seconds
            self.counts["reshard_kv_blocks"] += moved.kv_blocks

    def preempted(self, n: int) -> None:
        self.counts["preemptions"] += n

    def note_host(self) -> None:
        """A point of the host tier's occupancy timeline, if it changed."""
        used = self.state.host_kv.used
        if self._host_timeline[-1][1] != used:
            self._host_timeline.append((round(time.perf_counter() - self._t0, 6), used))

    # ---- the report ----------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Counters since the engine started or `reset()`, and gauges of the moment
        (JSON-serialisable); the module docstring says what each key means."""
        s = dict(self.counts)
        s["transitions"] = s["to_decode"] + s["to_prefill"]
        s.update(self._compiled())
        s.update(_step_means(s))
        s.update(self._since_reset(self._swap_totals()))
        s.update(self._kv_occupancy())
        s["finish_reasons"] = dict(self.finish_reasons)
        s.update(self._gauges())
        s.update(self.timeline.stats())
        s.update(self._since_reset(self.runner.control_stats()))
        s.update(self._since_reset(self._prefix_cache()))
        s.update(_prefix_cache_rates(s))
        s.update(self._pipeline())
        return s

    def _pipeline(self) -> dict:
        """Per layout (phase) of the step's pipeline: each stage's busy and idle seconds and
        the pipeline's wall time since `reset()` (`runtime/flow.py` counts them), and the
        bubble fraction over every layout: the stages' time without a micro-batch over the
        stages' time (pp x wall)."""
        busy, idle, wall = {}, {}, {}
        for phase, t in self.runner.ticks.stage_times().items():
            base = self._stage_base.get(phase, {"busy": [0.0] * t["stages"], "wall": 0.0})
            wall[phase] = t["wall"] - base["wall"]
            busy[phase] = [b - b0 for b, b0 in zip(t["busy"], base["busy"], strict=True)]
            idle[phase] = [wall[phase] - b for b in busy[phase]]
        stage_seconds = sum(wall[p] * len(busy[p]) for p in wall)
        return {"pipeline_stage_busy_seconds": busy, "pipeline_stage_idle_seconds": idle,
                "pipeline_wall_seconds": wall,
                "pipeline_bubble_fraction": (sum(map(sum, idle.values())) / stage_seconds
                                             if stage_seconds else 0.0)}

    def _since_reset(self, totals: dict) -> dict:
        """Counters their owners keep since the engine started, as differences from `reset()`."""
        return {k: v - self._base[k] for k, v in totals.items()}

    def _compiled(self) -> dict:
        """The runner's compilation counters (never reset) and its kernel choices."""
        return {"compile_seconds": self.runner.compile_seconds,
                "compiled_shapes": len(self.runner.compiled),
                "kernels": self.runner.kernel_choices()}

    def _swap_totals(self) -> dict:
        """The host KV tier's traffic and the seconds spent on it (since the engine started)."""
        host, prefetcher = self.kv.host, self.kv.prefetcher
        return {"swap_out_bytes": host.bytes_out, "swap_in_bytes": host.bytes_in,
                "swap_seconds": self.kv.swap_seconds,
                "prefetch_seconds": prefetcher.seconds if prefetcher else 0.0}

    def _kv_occupancy(self) -> dict:
        """The device pool's and the host tier's sizes and peaks (tokens), and the host
        tier's occupancy timeline."""
        st = self.state
        return {"device_kv_capacity": self.runner.num_blocks * BLOCK,
                "device_kv_peak": st.device_kv.peak_blocks * BLOCK,
                "host_kv_capacity": st.host_kv.capacity, "host_kv_peak": st.host_kv.peak,
                "host_timeline": [list(p) for p in self._host_timeline]}

    def _prefix_cache(self) -> dict:
        """The block pool's prefix-cache counters (since the engine started)."""
        pool, host = self.state.device_kv.pool, self.state.host_kv.cache
        return {"prefix_cache_queried_tokens": pool.queried_tokens,
                "prefix_cache_hit_tokens": pool.hit_tokens,
                "prefix_cache_host_hit_tokens": pool.host_hit_tokens,
                "prefix_cache_evictions": pool.evictions,
                "prefix_cache_host_stored_blocks": host.stored_blocks if host else 0,
                "prefix_cache_host_evictions": host.evictions if host else 0,
                "prefix_cache_host_bytes_out": self.kv.prefix_bytes_out,
                "prefix_cache_host_bytes_in": self.kv.prefix_bytes_in,
                "forked_samples": self.state.device_kv.forked,
                "fork_copied_blocks": self.state.device_kv.fork_copies}

    def _gauges(self) -> dict:
        """What the engine holds now (not counters: `reset` leaves them)."""
        st = self.state
        return {"waiting_requests": len(st.waiting), "device_requests": len(st.device),
                "host_requests": len(st.host), "device_kv_used": st.device_kv.used,
                "host_kv_used": st.host_kv.used}


def _step_means(s: dict) -> dict:
    """Per-step figures of the counters `s`: decode batch size, padding share."""
    steps, padded = s["decode_steps"], s["step_tokens_padded"]
    return {"mean_decode_batch": s["decode_tokens"] / steps if steps else 0.0,
            "padding_waste": 1 - s["step_tokens"] / padded if padded else 0.0}


def _prefix_cache_rates(s: dict) -> dict:
    """The prefix cache's hit rate and its hits in the device pool, from the counters `s`."""
    queried, hits = s["prefix_cache_queried_tokens"], s["prefix_cache_hit_tokens"]
    return {"prefix_cache_hit_rate": hits / queried if queried else 0.0,
            "prefix_cache_device_hit_tokens": hits - s["prefix_cache_host_hit_tokens"]}
