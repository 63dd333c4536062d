"""Synthetic, seeded request-length workloads for planning and simulation (pure Python).

A `Workload` is a list of (prompt_len, output_len) pairs: every request runs to its output
length. The distributions are lognormals whose means match what the papers report; they are
stand-ins for the datasets (no text is involved, only lengths):

- `sharegpt`: ShareGPT conversations as in the vLLM paper (mean prompt 161, mean output 338
  tokens, long right tails), clipped to Llama-2's 4096-token context.
- `arxiv`: arxiv-summarization (Cohan et al. 2018: articles ~4.9k words, abstracts ~220 words
  ≈ 290 tokens). Articles are far longer than the context, so prompts are truncated to 3584
  tokens (most requests sit at the cap) and outputs capped at 512: long prompts, short outputs.
- `sharegpt-1k`: `sharegpt` with prompts capped below 1024 tokens (TD-Pipe's filter).
- `constant:IN:OUT`: every request has IN prompt and OUT output tokens (Fig. 13's setup).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

# (median, sigma, lo, hi) of each lognormal; mean = median * exp(sigma^2 / 2) before clipping.
SHAREGPT = {"prompt": (98, 1.0, 4, 2048), "output": (245, 0.8, 4, 2048)}
ARXIV = {"prompt": (6000, 0.6, 512, 3584), "output": (270, 0.4, 32, 512)}
# TD-Pipe's filter (§4.1): ShareGPT prompts shorter than 1024 tokens.
SHAREGPT_1K = {"prompt": (98, 1.0, 4, 1023), "output": SHAREGPT["output"]}
DISTRIBUTIONS = {"sharegpt": SHAREGPT, "arxiv": ARXIV, "sharegpt-1k": SHAREGPT_1K}
DEFAULT_NUM_REQUESTS = 1000


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt_len, output_len) pairs, with a name for tables."""

    name: str
    requests: tuple[tuple[int, int], ...]

    @property
    def total_prompt(self) -> int:
        return sum(p for p, _ in self.requests)

    @property
    def total_output(self) -> int:
        return sum(o for _, o in self.requests)

    @property
    def mean_prompt(self) -> float:
        return self.total_prompt / len(self.requests)

    @property
    def mean_output(self) -> float:
        return self.total_output / len(self.requests)

    @property
    def max_len(self) -> int:
        return max(p + o for p, o in self.requests)

    def describe(self) -> dict:
        """Mean / median / max of both lengths (JSON-serialisable)."""
        out = {"name": self.name, "num_requests": len(self.requests)}
        for i, what in enumerate(("prompt", "output")):
            lengths = [r[i] for r in self.requests]
            out[what] = {"mean": round(statistics.fmean(lengths), 1),
                         "median": statistics.median(lengths), "max": max(lengths)}
        return out


def constant(num_requests: int, prompt_len: int, output_len: int) -> Workload:
    """Every request: `prompt_len` in, `output_len` out."""
    if min(num_requests, prompt_len, output_len) < 1:
        raise ValueError(f"constant workload needs positive sizes, got n={num_requests}, "
                         f"prompt={prompt_len}, output={output_len}")
    name = f"constant:{prompt_len}:{output_len}"
    return Workload(name, ((prompt_len, output_len),) * num_requests)


def _draw(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    median, sigma, lo, hi = spec
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def synthetic(name: str, num_requests: int = DEFAULT_NUM_REQUESTS, seed: int = 0) -> Workload:
    """`num_requests` seeded draws from the `sharegpt` or `arxiv` length distribution."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown workload {name!r}; accepted: {sorted(DISTRIBUTIONS)} or "
                         "'constant:IN:OUT'")
    spec, rng = DISTRIBUTIONS[name], random.Random(seed)
    reqs = tuple((_draw(rng, spec["prompt"]), _draw(rng, spec["output"]))
                 for _ in range(num_requests))
    return Workload(name, reqs)


def make_workload(spec: str | Workload, num_requests: int = DEFAULT_NUM_REQUESTS,
                  seed: int = 0) -> Workload:
    """'sharegpt' | 'arxiv' | 'constant:IN:OUT' (or a Workload, returned as is)."""
    if isinstance(spec, Workload):
        return spec
    if isinstance(spec, str) and spec.startswith("constant:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"bad workload {spec!r}: write 'constant:IN:OUT', e.g. "
                             "'constant:3000:128'")
        return constant(num_requests, int(parts[1]), int(parts[2]))
    return synthetic(spec, num_requests, seed)
