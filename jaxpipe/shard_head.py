"""The model's head inside a `shard_map` (manual over `pp` and `tp`): logits, sampling and
the embedding of the sampled token, for the multi-step pipelined decode (`pipeline.py`).

The embedding and LM head are split over `tp` along the vocab axis, so inside the map each
device holds V'/tp vocab rows (V' = padded vocab). Logits: this device's columns, then an
`all_gather` over tp, so every tp device of the last stage samples the same full row and
draws the same token. Embedding: a lookup in the local rows (zeros for ids another device
holds) summed over tp, exact since one device holds each id. Collectives run on every device
in every tick (a device whose stage has nothing to sample gathers zeros); the matmul, the
sampler and the lookup run only where `live`.

The sampling plan's static switches (mode, penalties, logprobs) become runtime values
(`SamplerSwitch`): one compiled decode program serves every plan, and each branch is
`sampling.sample` with those static arguments, so tokens equal the one-step path's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe import sampling
from jaxpipe.config import ModelConfig
from jaxpipe.model import llama
from jaxpipe.model.llama import HeadParams
from jaxpipe.sampling import SamplingTensors

# (mode, penalties) of each branch of the in-program sampler.
SAMPLERS = tuple((mode, pen) for mode in sampling.MODES for pen in (False, True))


class SamplerSwitch(NamedTuple):
    """A sampling plan's static choices as device scalars."""

    branch: jax.Array  # [] i32: index into SAMPLERS
    penalties: jax.Array  # [] bool: repetition / frequency / presence penalties on
    logprobs: jax.Array  # [] bool: compute logprobs (the top `top_logprobs` of them)


class Sampled(NamedTuple):
    """One micro-batch's sampling results (b rows)."""

    tokens: jax.Array  # [b] i32
    logprob: jax.Array  # [b] f32: logprob of each token (0 when logprobs are off)
    top_ids: jax.Array  # [b, NL] i32
    top_logprobs: jax.Array  # [b, NL] f32


def sampler_switch(mode: str, penalties: bool, num_logprobs: int | None) -> SamplerSwitch:
    """Host values of the switch for a plan's (mode, penalties, num_logprobs)."""
    return SamplerSwitch(np.int32(SAMPLERS.index((mode, bool(penalties)))),
                         np.bool_(penalties), np.bool_(num_logprobs is not None))


def top_logprobs(vocab: int) -> int:
    """NL: how many top logprobs the program always returns (callers slice what they asked)."""
    return min(sampling.MAX_LOGPROBS, vocab)


def embed_local(table, tokens):
    """tokens [b] i32 (global ids) -> [b, E] f32: the rows of this device's vocab shard
    table [V'/tp, E], zeros for ids another tp device holds (a psum over tp completes it).

    Call it inside a `lax.cond` branch of the decode loop: there XLA fuses the f32 convert
    that its CPU backend puts before a bf16 gather into the gather. At the loop's top level
    it hoists that convert out of the loop instead, converting the whole table once per call
    (SmolLM2, tp=4: a 28 MB f32 copy per device, ~90 ms each)."""
    rows = table.shape[0]
    local = tokens - lax.axis_index("tp") * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0).astype(jnp.float32)
    return jnp.where(mine[:, None], x, 0.0)


def vocab_logits(cfg: ModelConfig, head: HeadParams, x, live, tp: int, vocab: int):
    """Logits [b, vocab] f32 of the residual x [b, E]: the local vocab columns (computed only
    where `live`, zeros elsewhere), gathered over tp and cut to the real vocab."""
    cols = head.embed.shape[0] if head.lm_head is None else head.lm_head.shape[1]
    local = lax.cond(live, lambda: llama.logits(cfg, head, x),
                     lambda: jnp.zeros((x.shape[0], cols), jnp.float32))  # [b, V'/tp]
    full = lax.all_gather(local, "tp", axis=1, tiled=True) if tp > 1 else local
    return full[:, :vocab]


def next_token(cfg: ModelConfig, head: HeadParams, y, live, t: SamplingTensors,
               penalty_state, switch: SamplerSwitch, *, tp: int, vocab: int):
    """The last stage's work on one micro-batch: its residual y [b, E] -> (the embedding of
    the sampled tokens [b, E] f32, the micro-batch's next input; `Sampled`). Every device
    calls it (the collectives); logits, sampling and the lookup run only where `live`.
    penalty_state: see `sample`."""
    logits = vocab_logits(cfg, head, y, live, tp, vocab)

    def work():
        sampled = sample(logits, t, penalty_state, switch, top_logprobs(vocab))
        return embed_local(head.embed, sampled.tokens), sampled

    def rest():
        return jnp.zeros(y.shape, jnp.float32), idle(y.shape[0], vocab)

    x, sampled = lax.cond(live, work, rest)
    return (lax.psum(x, "tp") if tp > 1 else x), sampled


def _branch(mode: str, penalties: bool, penalty_state):
    def branch(logits, t):
        state = penalty_state() if penalties else (None, None)
        return sampling.sample(logits, t, *state, mode=mode, penalties=penalties)

    return branch


def sample(logits, t: SamplingTensors, penalty_state, switch: SamplerSwitch,
           num_top: int) -> Sampled:
    """Tokens for logits [b, V] as `sampling.sample` with the switch's mode and penalties,
    plus logprobs when switched on. penalty_state() -> (prompt_mask [b, V] bool,
    out_counts [b, V] i32) of these rows, called only in the branches with penalties (so
    that nothing of size [b, V] is read or built when they are off)."""
    branches = [_branch(mode, pen, penalty_state) for mode, pen in SAMPLERS]
    tokens = lax.switch(switch.branch, branches, logits, t)
    b = tokens.shape[0]

    def none():
        return (jnp.zeros(b, jnp.float32), jnp.zeros((b, num_top), jnp.int32),
                jnp.zeros((b, num_top), jnp.float32))

    lp = lax.cond(switch.logprobs,
                  lambda: sampling.compute_logprobs(logits, tokens, num_top), none)
    return Sampled(tokens, *lp)


def idle(b: int, vocab: int) -> Sampled:
    """Zeros in the shapes of `sample`'s result: what a device with nothing to sample keeps."""
    nl = top_logprobs(vocab)
    return Sampled(jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.float32),
                   jnp.zeros((b, nl), jnp.int32), jnp.zeros((b, nl), jnp.float32))
