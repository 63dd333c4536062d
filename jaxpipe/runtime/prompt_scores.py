"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): the LM head over the prompt
positions of the rows that ask, in the step that carries them.

Prompt token t's logprob comes from position t - 1's logits, so a chunk scores the tokens
after each of its positions: its last position scores the first token of the next chunk, and
the prompt's last position scores nothing (its logits sample the first output token). A step
carries a second, static set of gather indices (`PromptScore.index`, a power-of-two width,
absent when no row asks, so plain steps compile as before): the tick program keeps those
tokens' residuals after the rows' (`pipeline.tick_program`'s `score`), the runner's LM head
program runs on them, and `scores` takes the log-softmax in f32 and returns only small
arrays: each scored token's logprob and rank (1-based, vLLM's: one plus the tokens with a
higher logit) and the top `num` ids and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.runtime import sampling


@dataclass(frozen=True)
class PromptScore:
    """One step's prompt positions to score, and what each scores."""

    index: np.ndarray  # [S] i32: token indices in the step (S a power of two; padding: 0)
    target: np.ndarray  # [S] i32: the prompt token each position scores (the next one)
    count: int  # real entries (the first `count`)
    num: int  # top alternatives per position (static)


@dataclass
class PromptScores:
    """A step's prompt scores on the host, one row per real `PromptScore` entry."""

    logprob: np.ndarray  # [n] f32: the scored token's logprob
    rank: np.ndarray  # [n] i32: its rank (1: the most likely)
    top_ids: np.ndarray  # [n, num] i32
    top_logprobs: np.ndarray  # [n, num] f32


def positions(start: int, length: int, prompt_len: int) -> range:
    """The positions of a chunk [start, start + length) that score a prompt token (the one
    after each): those before the prompt's last position."""
    return range(start, min(start + length, prompt_len - 1))


def build(entries: list[tuple[int, int]], num: int) -> PromptScore | None:
    """The step's `PromptScore` from (token index, target token) pairs (None: none)."""
    if not entries:
        return None
    width = 1 << (len(entries) - 1).bit_length()
    index, target = np.zeros(width, np.int32), np.zeros(width, np.int32)
    index[:len(entries)], target[:len(entries)] = zip(*entries, strict=True)
    return PromptScore(index, target, len(entries), num)


@partial(jax.jit, static_argnames="num")
def scores(logits, target, *, num: int):
    """(logprob [S], rank [S], top ids [S, num], top logprobs [S, num]) of the `target`
    tokens under log_softmax (f32) of logits [S, V]."""
    logits = logits.astype(jnp.float32)
    lp, top_ids, top_lp = sampling.compute_logprobs(logits, target, num)
    mine = jnp.take_along_axis(logits, target[:, None], axis=-1)  # [S, 1]
    rank = jnp.sum(logits > mine, axis=-1, dtype=jnp.int32) + 1
    return lp, rank, top_ids, top_lp


def to_host(parts, count: int) -> PromptScores:
    """`scores`' device arrays as `PromptScores` of the first `count` entries."""
    return PromptScores(*(np.asarray(a)[:count] for a in parts))
