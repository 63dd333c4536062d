"""The engine: requests in, tokens out. Validating requests, generate / chat / stream and
outputs live here; the model, memory and every part are built by builder.py, and `step()` is
the executor's (executor.py):

    action = policy.schedule(state)   # Run (prompt chunks + decode tokens) | Switch | SwapIn
                                      # | Preempt
    launch(runs) / execute(action)    # a ragged step dispatched (step_builder.py), or a
                                      # re-shard or a KV move
    land(flight)                      # tokens appended, stops checked (output_processor.py)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from jaxpipe.config.cluster import cluster_of
from jaxpipe.config.engine import POLICY_KNOBS, EngineConfig
from jaxpipe.config.meshes import load_mesh
from jaxpipe.engine import builder
from jaxpipe.engine.step_builder import sampling_inputs_for
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.request import validate as requests
from jaxpipe.request.outputs import Completion, RequestOutput, StreamDelta, token_delta
from jaxpipe.request.params import SamplingParams
from jaxpipe.request.stopping import StopChecker
from jaxpipe.runtime import distributed
from jaxpipe.runtime.synthetic_step import padding_inputs
from jaxpipe.scheduler import (
    Sequence,
)
from jaxpipe.scheduler.prefix_order import admission_order

log = logging.getLogger("jaxpipe")


class Engine:
    """Offline / batch LLM generation. See README for the full contract."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        """Load the model, size memory, build the runner and the executor (builder.py), and
        compile the steps (warm-up)."""
        self.config = config = config or EngineConfig(**overrides)
        self.mesh = load_mesh(config.mesh)
        self.cluster = cluster_of(config)
        if self.cluster is not None and not self.cluster.is_leader:
            raise ValueError(f"EngineConfig.process_id={config.process_id} is a follower: it "
                             "takes no requests; run jaxpipe.engine.builder.follow(config) "
                             "there (the CLIs do, given --process-id)")
        devices = builder.mesh_devices(self.mesh, self.cluster)  # before any other JAX use
        leader = distributed.Leader(self.cluster) if self.cluster is not None else None
        try:
            parts = builder.build(config, devices, leader)
        except BaseException as e:
            if leader is not None:  # the followers are waiting for the runner's sizes
                leader.send("abort", f"{type(e).__name__}: {e}")
                leader.close()
            raise
        self._take(parts)
        self._eos = frozenset(self.model_config.eos_token_ids)
        self._seeds = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self.closed = False
        self._detok_on = config.detok_worker  # set_detok_worker flips it
        if config.warmup:
            self.warmup()

    def _take(self, parts: builder.Parts) -> None:
        """The built parts, as the engine's attributes."""
        self.dtype, self.model_config, self.tokenizer = (parts.dtype, parts.model_config,
                                                         parts.tokenizer)
        self.max_model_len, self.layouts, self.kernels = (parts.max_model_len, parts.layouts,
                                                          parts.kernels)
        self.budget, self.max_num_seqs, self.num_blocks = (
            parts.sizes.budget, parts.sizes.max_num_seqs, parts.sizes.num_blocks)
        self.buckets, self.runner, self.executor = parts.buckets, parts.runner, parts.executor
        self.limits = requests.Limits(self.max_model_len, self.model_config.vocab_size)

    # ---- public API ---------------------------------------------------------------------------

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: Seq[int] | None = None, request_id: str | None = None,
                    ) -> str:
        """Queue one request; returns its id. Raises ValueError on bad input (nothing queued).
        Its stop strings are checked on the engine's thread, so every token `step` hands
        back is final (`generate` and `stream` use the detokenizer worker instead)."""
        self._check_open()
        ids = self._prompt_ids(prompt, prompt_token_ids, params)
        return self._add(prompt, params, ids, request_id, None)

    def _add(self, prompt, params, ids, request_id, worker, seed=None) -> str:
        """Queue one request: `ids` its prompt's token ids, checked (`_prompt_ids`); `seed`
        drawn already, for a request whose params give none."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}")
        requests.check_vocab(params, self.limits)
        max_tokens = requests.max_tokens(ids, params, self.limits)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = self._draw_seed()
        now = time.perf_counter()

        def sample(i: int) -> Sequence:  # sample i: its own seed stream (seed + i)
            return Sequence.create(request_id if i == 0 else ("sample", request_id, i), ids,
                                   params, (seed + i) % 2**32, max(max_tokens, 1), prompt=prompt,
                                   stop=StopChecker(self.tokenizer, ids, params, self._eos,
                                                    worker), arrival_time=now, index=i,
                                   reads_cache=params.prompt_logprobs is None)

        seq = sample(0)
        seq.fork_samples(params.n, sample)
        self.executor.constraints.attach(seq.group)  # RequestError if it does not compile
        self.executor.add(seq)
        self._requests[request_id] = seq
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; it finishes with finish_reason "abort"."""
        for seq in self._requests[request_id].group if request_id in self._requests else ():
            if not seq.is_finished:  # every sample (those not forked yet included)
                self.executor.abort(seq)

    def forget(self, request_id: str) -> None:
        """Forget a finished (or aborted) request so its memory is freed. For callers that drive
        `add_request` / `step` themselves, such as a server; `generate` and `stream` do this."""
        seq = self._requests.get(request_id)
        if seq is not None and seq.request_finished:
            del self._requests[request_id]

    def has_unfinished(self) -> bool:
        return self.executor.has_work()

    def step(self) -> list[Sequence]:
        """Do the scheduling policy's next action (see executor.py); returns the sequences
        that got a token."""
        self._check_open()
        return self.executor.step()

    def generate(self, prompts: str | Seq[str] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order."""
        prompts, token_lists = _normalise_prompts(prompts, prompt_token_ids)
        n = len(prompts) if prompts is not None else len(token_lists)
        prompts = prompts if prompts is not None else [None] * n
        token_lists = token_lists if token_lists is not None else [None] * n
        return self._generate_all(prompts, token_lists, _per_request(sampling_params, n), use_tqdm)

    def chat(self, conversations: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        self._need_tokenizer("chat")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True)
                   for c in conversations]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        params = _per_request(sampling_params, len(prompts))
        return self._generate_all(prompts, token_lists, params, use_tqdm)

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
               ) -> Iterator[StreamDelta]:
        """Yield the new tokens and text of one request as they are generated (n > 1: of each
        sample, `StreamDelta.index` saying whose; each sample's last delta has its finish)."""
        text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        self._check_open()
        rid = self._add(text, params, self._prompt_ids(text, token_ids, params), None,
                        self._detok_worker())
        seq = self._requests[rid]
        completions = [Completion(s, self.tokenizer, stream=True) for s in seq.group]
        try:
            while not seq.request_finished:
                self.step()
                for sample, completion in zip(seq.group, completions, strict=True):
                    if completion.finished or not sample.stop.settled(sample):
                        continue  # (the worker found a stop string: the next step ends it)
                    delta = token_delta(sample, len(completion.token_ids))
                    if delta.token_ids or sample.is_finished:
                        new_text = completion.add(delta)
                        yield StreamDelta(rid, delta.token_ids, new_text, delta.finish_reason,
                                          sample.index)
        finally:
            self.abort(rid)
            self._requests.pop(rid, None)

    def set_scheduler(self, name: str, **knobs) -> None:
        """Switch the scheduling policy of an idle engine (a name `EngineConfig.scheduler`
        accepts), e.g. to compare policies on the same loaded model. knobs: the policy's
        fields of `EngineConfig` (throttle_*, tdpipe_*) for this policy, validated as there;
        the others keep the engine's config."""
        self._check_idle("set_scheduler")
        if unknown := sorted(set(knobs) - set(POLICY_KNOBS)):
            raise ValueError(f"set_scheduler takes the policy knobs {POLICY_KNOBS}, "
                             f"got {unknown}")
        self.executor.set_policy(dataclasses.replace(self.config, scheduler=name, **knobs))

    def set_overlap(self, on: bool) -> None:
        """Overlap each step with the previous one's landing, or land each step before the
        next (`EngineConfig.overlap`, its initial value), on an idle engine."""
        self._check_idle("set_overlap")
        self.executor.set_overlap(on)

    def set_detok_worker(self, on: bool) -> None:
        """Check stop strings on the detokenizer worker or on the engine's thread
        (`EngineConfig.detok_worker`, its initial value) for the requests added from now."""
        self._detok_on = bool(on)

    def stats(self) -> dict:
        """Counters since the engine started or `reset_stats()` (JSON-serialisable); see
        `jaxpipe.engine.stats` for what each one means."""
        return self.executor.stats()

    def reset_stats(self) -> None:
        """Zero every counter of `stats()` (the compile counters are the runner's own)."""
        self.executor.reset_stats()

    def close(self) -> None:
        """Stop the engine's threads and free its memory: the weights, the device KV pool
        and the host KV tier. Unfinished requests are aborted. A closed engine refuses new
        work; closing twice is harmless. `with Engine(...) as engine:` closes on exit."""
        if self.closed:
            return
        for request_id in list(self._requests):
            self.abort(request_id)
        self.executor.close()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Engine is closed (Engine.close()); create a new one")

    def warmup(self) -> None:
        """Compile the step for every token bucket in the current phase's layout, and the LM
        head and greedy sampler for every number of sampled rows, so that the hot loop never
        stops to compile (JAX's persistent cache makes this seconds after the first run).
        A warm-up step is all padding: it writes no KV and no penalty state."""

        tokens, rows = self.buckets.step_tokens, self.buckets.sample_row_buckets()
        with tqdm(total=len(tokens) + len(rows), desc="jaxpipe: compiling", unit="shape",
                  disable=not self.config.show_progress) as bar:
            for t in tokens:
                self.runner.hidden(padding_inputs(self.runner, t))
                bar.update()
            for n in rows:  # the head and sampler read [max_rows, E]: any step feeds them
                sampling_inputs = sampling_inputs_for([], n)
                self.runner.step(padding_inputs(self.runner, tokens[0]),
                                 np.full(n, self.max_num_seqs, np.int32), sampling_inputs)
                bar.update()

    # ---- helpers ------------------------------------------------------------------------------

    def _generate_all(self, prompts, token_lists, params, use_tqdm) -> list[RequestOutput]:
        """Queue every request or none (every prompt is checked, once, before any is queued;
        a bad sampling param rolls back those queued before it), in the prefix cache's order
        when it is on (`_admission_order`), run them to completion and return their outputs
        in input order. Request ids and drawn seeds follow the input order whatever the
        queue's."""
        self._check_open()
        token_lists = [self._prompt_ids(p, t, sp)
                       for p, t, sp in zip(prompts, token_lists, params, strict=True)]
        order = self._admission_order(token_lists)
        rids = [str(next(self._ids)) for _ in params]
        seeds = [None if getattr(sp, "seed", None) is not None else self._draw_seed()
                 for sp in params]
        queued: list[str] = []
        try:
            for i in order:
                queued.append(self._add(prompts[i], params[i], token_lists[i], rids[i],
                                        self._detok_worker(), seeds[i]))
        except BaseException:
            for rid in queued:
                self.abort(rid)
                self._requests.pop(rid, None)
            raise
        self._drain(queued, self.config.show_progress if use_tqdm is None else use_tqdm)
        return [self.pop_output(i) for i in rids]

    def _admission_order(self, token_lists: list[list[int]]) -> list[int]:
        """The order to queue a list of prompts (token ids) in: with the prefix cache on,
        prompts sharing a prefix run close together and each shared prefix is computed a
        step ahead of its group (`prefix_order.admission_order`); else the input order."""
        if not self.config.prefix_caching or len(token_lists) < 2:
            return list(range(len(token_lists)))
        return admission_order(token_lists, BLOCK)

    def _draw_seed(self) -> int:
        """The next seed of the engine's stream, for a request whose params give none."""
        return int(self._seeds.integers(2**32))

    def _drain(self, ids: list[str], progress: bool) -> None:
        """Step until every request in `ids` has finished, with an optional progress bar."""

        pending = {i for i in ids}
        bar = tqdm(total=len(ids), desc="jaxpipe: generating", unit="req", disable=not progress)
        try:
            while pending:
                if not self.has_unfinished():
                    raise RuntimeError(f"requests {sorted(pending)[:5]} were lost by the scheduler")
                self.step()
                done = {i for i in pending if self._requests[i].request_finished}
                if done:
                    pending -= done
                    bar.update(len(done))
                    bar.set_postfix(tok=self.executor.generated_tokens, refresh=False)
        except BaseException:
            for rid in pending:  # never leave orphans behind in the engine
                self.abort(rid)
            raise
        finally:
            bar.close()

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request, which the engine then forgets (as `forget`).
        For callers that drive `add_request` / `step` themselves."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r} in the engine (never added, or its "
                           "output was already taken)")
        if not seq.request_finished:
            raise RuntimeError(f"request {request_id!r} has not finished; step() until it has")
        del self._requests[request_id]
        completions = []
        for sample in seq.group:  # index 0..n-1
            completions.append(Completion(sample, self.tokenizer))
            completions[-1].add(token_delta(sample))
        outputs = [c.completion_output(s.index) for c, s in zip(completions, seq.group,
                                                                   strict=True)]
        firsts = [s.first_token_time for s in seq.group if s.first_token_time is not None]
        metrics = {"arrival": seq.arrival_time, "first_token": min(firsts, default=None),
                   "finished": max(s.finish_time for s in seq.group)}
        return RequestOutput(request_id, seq.prompt, list(seq.prompt_token_ids), outputs, True,
                             metrics, *completions[0].prompt_output())

    def _prompt_ids(self, prompt, prompt_token_ids, params=None) -> list[int]:
        """Token ids win when both are given (chat passes its rendered text for the output).
        Checked by `request/validate.py`, the validator the server and batch jobs use too;
        only the last `params.truncate_prompt_tokens` are kept when it is set."""
        if prompt_token_ids is not None:
            kind, value = "token_ids", prompt_token_ids
        elif prompt is None:
            raise ValueError("give a prompt (text) or prompt_token_ids")
        else:
            kind, value = "text", prompt
        truncate = getattr(params, "truncate_prompt_tokens", None)
        return requests.prompt_token_ids(kind, value, self.tokenizer, self.limits, truncate)

    def _detok_worker(self):
        return self.executor.detok if self._detok_on else None

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished():
            raise RuntimeError(f"{what} needs an idle engine: requests are in flight")

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer; {what} need one "
                             "(use prompt_token_ids)")


# ---- module helpers ---------------------------------------------------------------------------


def _normalise_prompts(prompts, prompt_token_ids):
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts or prompt_token_ids")
    if prompts is not None:
        return ([prompts] if isinstance(prompts, str) else list(prompts)), None
    ids = list(prompt_token_ids)
    if ids and not isinstance(ids[0], (list, tuple, np.ndarray)):
        ids = [ids]  # one prompt given as a flat list of ints
    return None, ids


def _per_request(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts; give one, or one "
                         "per prompt")
    return params
