"""llama.cpp peer: continuous batching over the benchmark workload, on the same GGUF, through
llama-cpp-python's bindings of llama.cpp's C API (built from source in the peers' environment).

llama-cpp-python's `Llama` object generates one sequence at a time, so this drives the C API
the way llama.cpp's own server does with continuous batching (`--cont-batching -np N`): one
context whose KV cache holds `max_seqs` sequences, each in a stream of its own, and a loop of
`llama_decode` calls, each a batch of every running sequence's next token plus prompt chunks of
newly admitted requests, up to `batch_tokens` tokens. A finished sequence's KV is removed
(`llama_memory_seq_rm`) and the next request takes its sequence id. Greedy (argmax of the
logits, in NumPy), EOS ignored: exactly output_len tokens per request. The GGUF's weights stay
in their quantized blocks, multiplied by llama.cpp's own kernels (its reason to be here: the
peer for `quantization="gguf"`).

The bookkeeping (`Batcher`) is plain Python, tested without llama.cpp; `llama_cpp` is imported
only inside the functions that call it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpipe_peers.protocol import Request, best_point, throughput

Log = Callable[[str], None]

_INSTALL_HINT = ("make bench-env (the peers' environment, from requirements/peers.lock; "
                 "llama-cpp-python builds llama.cpp from source there, with CMake)")
DEFAULT_BATCH_TOKENS = 2048  # llama.cpp's default n_batch


def require_llama_cpp() -> Any:
    """`llama_cpp`, or a message naming where it comes from."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeError(f"the llama.cpp peer needs llama-cpp-python, which is not "
                           f"importable ({exc}); {_INSTALL_HINT}") from exc
    return llama_cpp


@dataclass
class Running:
    """One admitted request: its llama.cpp sequence id and how far it has got."""

    request: Request
    seq_id: int
    fed: int = 0  # prompt tokens given to llama_decode
    generated: int = 0  # output tokens chosen
    last: int = -1  # the latest output token, the next to feed

    @property
    def decoding(self) -> bool:
        """Its prompt is in the cache and it has an output token to feed."""
        return self.fed == self.request.prompt_len and self.generated > 0


@dataclass(frozen=True)
class Entry:
    """One token of a `llama_decode` batch."""

    seq: Running
    token: int
    pos: int
    logits: bool  # the token whose logits choose the sequence's next output


@dataclass
class Batcher:
    """Continuous batching's bookkeeping: which requests run, and each step's tokens."""

    requests: Sequence[Request]
    max_seqs: int
    batch_tokens: int
    queue: deque = field(init=False)
    running: list[Running] = field(default_factory=list)
    free_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or self.batch_tokens < self.max_seqs:
            raise ValueError(f"need 1 <= max_seqs <= batch_tokens, got max_seqs="
                             f"{self.max_seqs}, batch_tokens={self.batch_tokens}")
        if any(r.output_len < 1 or r.prompt_len < 1 or r.samples != 1 for r in self.requests):
            raise ValueError("the llama.cpp peer runs greedy requests of >= 1 prompt and "
                             "output token (samples=1)")
        self.queue = deque(self.requests)
        self.free_ids = list(range(self.max_seqs - 1, -1, -1))

    @property
    def done(self) -> bool:
        """No request left to run."""
        return not self.queue and not self.running

    def plan(self) -> list[Entry]:
        """The next batch: each decoding sequence's last token, then prompt chunks (admitting
        requests while sequence ids are free) within `batch_tokens`."""
        entries = [Entry(s, s.last, s.request.prompt_len + s.generated - 1, True)
                   for s in self.running if s.decoding]
        while self.queue and self.free_ids:
            self.running.append(Running(self.queue.popleft(), self.free_ids.pop()))
        for s in self.running:
            room = self.batch_tokens - len(entries)
            if s.fed < s.request.prompt_len and room > 0:
                entries += self._chunk(s, room)
        return entries

    def _chunk(self, s: Running, room: int) -> list[Entry]:
        """Up to `room` of `s`'s next prompt tokens; the prompt's last one wants logits."""
        prompt, stop = s.request.prompt_token_ids, min(s.request.prompt_len, s.fed + room)
        out = [Entry(s, prompt[p], p, p == len(prompt) - 1) for p in range(s.fed, stop)]
        s.fed = stop
        return out

    def advance(self, chosen: Sequence[tuple[Running, int]]) -> list[Running]:
        """Record each (sequence, chosen token) of a step; return the sequences that finished
        (their ids free again)."""
        finished = []
        for s, token in chosen:
            s.generated, s.last = s.generated + 1, token
            if s.generated == s.request.output_len:
                finished.append(s)
        for s in finished:
            self.running.remove(s)
            self.free_ids.append(s.seq_id)
        return finished


def context_size(workload: Sequence[Request], max_seqs: int) -> int:
    """KV cells: `max_seqs` streams, each of the longest request's length rounded up to 256
    (llama.cpp's KV padding)."""
    longest = max(r.prompt_len + r.output_len for r in workload)
    return max_seqs * (-(-longest // 256) * 256)


class Context:
    """A llama.cpp model and context on a GGUF (loaded once per sweep point), freed on exit."""

    def __init__(self, model_path: Path, n_ctx: int, max_seqs: int, batch_tokens: int,
                 threads: int, unified: bool = False):
        llama = self.llama = require_llama_cpp()
        # llama-cpp-python forwards llama.cpp's log (every tensor, every context) to this logger
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama.llama_backend_init()
        mparams = llama.llama_model_default_params()
        self.model = llama.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = llama.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_seq_max = n_ctx, batch_tokens, max_seqs
        cparams.n_ubatch = min(batch_tokens, 512)  # llama.cpp's default micro-batch
        cparams.n_threads = cparams.n_threads_batch = threads
        # A stream per sequence (unified False): a unified pool makes every sequence's attention
        # span the cells of all of them (llama.h: "try to disable when n_seq_max > 1 ... when
        # the sequences do not share a large prefix").
        cparams.kv_unified = unified
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} cells")
        self.vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(batch_tokens, 0, 1)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)
        self.llama.llama_model_free(self.model)

    def decode(self, entries: Sequence[Entry]) -> list[int]:
        """Run one batch; the argmax token of each entry that wants logits, in order."""
        import numpy as np

        b = self.batch
        for i, e in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = e.token, e.pos, 1
            b.seq_id[i][0], b.logits[i] = e.seq.seq_id, int(e.logits)
        b.n_tokens = len(entries)
        status = self.llama.llama_decode(self.ctx, b)
        if status:
            raise RuntimeError(f"llama_decode returned {status} on a batch of {len(entries)} "
                               "tokens (1: no KV cells left)")
        wanted = sum(e.logits for e in entries)
        if not wanted:
            return []
        logits = np.ctypeslib.as_array(self.llama.llama_get_logits(self.ctx),
                                       shape=(wanted, self.vocab))
        return [int(t) for t in logits.argmax(axis=1)]

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's KV cells."""
        self.llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)


def generate(context: Context, requests: Sequence[Request], max_seqs: int,
             batch_tokens: int) -> int:
    """Serve `requests` to completion; return the number of llama_decode calls."""
    batcher, steps = Batcher(requests, max_seqs, batch_tokens), 0
    while not batcher.done:
        entries = batcher.plan()
        tokens = context.decode(entries)
        steps += 1
        chosen = list(zip([e.seq for e in entries if e.logits], tokens, strict=True))
        for s in batcher.advance(chosen):
            context.forget(s.seq_id)
    return steps


def run_llamacpp(model: Path, workload: Sequence[Request], warmup: Sequence[Request],
                 threads: int, max_seqs: int, batch_tokens: int) -> dict:
    """One sweep point: load, warm up on `warmup`, time the workload (load and warm-up
    excluded from throughput)."""
    start = time.perf_counter()
    n_ctx = context_size(list(workload) + list(warmup), max_seqs)
    with Context(model, n_ctx, max_seqs, batch_tokens, threads) as context:
        startup_s = time.perf_counter() - start
        start = time.perf_counter()
        if warmup:
            generate(context, warmup, max_seqs, batch_tokens)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        steps = generate(context, workload, max_seqs, batch_tokens)
        elapsed = time.perf_counter() - start
    result = throughput(workload, elapsed)
    result.update(engine="llamacpp", dtype=_file_type(model), batch_size=max_seqs,
                  max_num_batched_tokens=batch_tokens, threads=threads, n_ctx=n_ctx,
                  decode_calls=steps, startup_s=startup_s, warmup_s=warmup_s)
    return result


def _file_type(model: Path) -> str:
    """The GGUF's quantization as its name says it (e.g. Q4_1), else "gguf"."""
    parts = model.stem.split(".")
    return parts[-1] if len(parts) > 1 else "gguf"


def sweep_llamacpp(model: Path, workload: Sequence[Request], warmup: Sequence[Request],
                   threads: Sequence[int], max_seqs: Sequence[int],
                   batch_tokens: int = DEFAULT_BATCH_TOKENS, log: Log = print) -> dict:
    """`run_llamacpp` at each (threads, max_seqs); all points and the best."""
    points = []
    for n_threads in threads:
        for seqs in max_seqs:
            point = run_llamacpp(model, workload, warmup, n_threads, seqs, batch_tokens)
            log(f"[llamacpp] {n_threads} threads, {seqs} sequences: "
                f"{point['output_tok_s']:.1f} output tok/s over {point['num_requests']} "
                f"requests in {point['elapsed_s']:.1f}s ({point['decode_calls']} decode calls)")
            points.append(point)
    return {"points": points, "best": best_point(points)}


def run_job(job: dict, requests: Sequence[Request], warmup: Sequence[Request]) -> dict:
    """A job file's llama.cpp sweep (`jaxpipe_peers.__main__`)."""
    model = Path(job["model"])
    if model.suffix != ".gguf":
        raise ValueError(f"the llama.cpp peer runs a .gguf file, got {model}")
    return sweep_llamacpp(model, requests, warmup, job["threads"], job["max_seqs"],
                          job.get("batch_tokens", DEFAULT_BATCH_TOKENS),
                          log=lambda line: print(line, flush=True))
