"""How the next token is chosen on the device: the device sampler of a request's
`SamplingParams` (`request/params.py`: vLLM's fields, defaults and meanings, validated there).

The sampler is pure `jax.numpy` and jit-friendly: the host packs one row per
sequence into `SamplingTensors` (`build_sampling_tensors`), picks a static `mode`
(`sampling_mode`) and calls `sample`. This module knows nothing about scheduling.

Processing order (vLLM's): a constrained row's token bitmask (structured outputs: every token
its grammar does not allow -inf) -> logit_bias added -> allowed_token_ids (every other id -inf) ->
banned ids (stop ids before min_tokens, bad words) -> repetition / frequency / presence
penalties -> greedy rows take the argmax -> temperature -> min_p -> top_k -> top_p -> sample
from the renormalised distribution. logit_bias, allowed ids and banned ids are sparse per-row
lists of a static bucketed width (`banned_bucket`); a width of 0 (no row uses them) costs
nothing.

Implementation notes (CPU, B=64, V=49152: a full-vocabulary sort costs ~1 s, jnp.argmax ~20 ms,
and drawing V Gumbel numbers per row ~100 ms, so none of them is used):

* Modes are static and each does only the work it needs: "greedy" is an argmax (maxima of
  16-token blocks, then one block per row); "plain" adds temperature, min_p and one sampling
  pass; "sorted" (the name is vLLM's; nothing is sorted) adds top_k / top_p.
* Every filter keeps the highest-probability tokens, so the kept set of a row is
  {z >= thr} for one threshold thr per row (z = logits / temperature). "sorted" mode finds the
  top_k and top_p thresholds exactly from the 128 largest logits of each row (`_candidates`);
  a row whose k or nucleus is larger than that gets its threshold from an exact bisection over
  the float32 order of its whole row (<= 32 passes, run only when some row in the batch needs
  it). Tokens tied with the threshold are all kept.
* Sampling is by inverse CDF with one uniform per row, drawn from
  `fold_in(key(seed), step)`, with a two-level cumulative sum (block masses, then inside the
  chosen block); filtered tokens have mass 0 and can never be drawn.
* Everything is row-wise and which path a row takes depends only on that row, so a row's
  token depends only on its own logits, seed and step, not on its neighbours or the batch size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.request.params import GREEDY_EPS, SamplingParams, is_int

MODES = ("greedy", "plain", "sorted")
_CANDIDATES = 128  # largest logits per row from which "sorted" mode finds its thresholds
_BLOCK = 256  # block size of the two-level cumulative sum used for inverse-CDF sampling
_SUB = 16  # small blocks for the argmax and the candidate selection
_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Host side: batch packing
# ----------------------------------------------------------------------------------------------


class SamplingTensors(NamedTuple):
    """One row per sequence in the batch; all shapes [B] except the id lists [B, K]."""

    temperature: jax.Array  # f32, 0 = greedy row
    top_k: jax.Array  # i32, 0 = off
    top_p: jax.Array  # f32
    min_p: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    seed: jax.Array  # u32: per-request seed
    step: jax.Array  # i32: index of the token being sampled within the request's output
    banned: jax.Array  # [B, K] i32 ids forced to -inf this step (-1 = none)
    bias_ids: jax.Array  # [B, Kb] i32 logit_bias ids (-1 = none)
    bias: jax.Array  # [B, Kb] f32 logit_bias values added to those ids
    allowed: jax.Array  # [B, Ka] i32 allowed_token_ids (-1 = none; a row with none: all)
    mask: jax.Array  # [B, W] i32 token bitmask, bit j of word w: token 32 w + j allowed
    # (W = 0 when no row is constrained; an unconstrained row is all ones)


def banned_bucket(longest: int) -> int:
    """Static width K of `SamplingTensors`' id lists (banned, bias_ids, allowed): 0 when no
    row uses one (the sampler then skips the scatter, which copies the whole [B, V] logits),
    else a power of two >= max(longest, 8)."""
    return 0 if longest == 0 else max(8, 1 << (longest - 1).bit_length())


def _check_batch(params, seeds, steps, banned, batch_size: int):
    rows = len(params)
    if not len(seeds) == len(steps) == len(banned) == rows:
        raise ValueError(f"params, seeds, steps and banned must have the same length, got "
                         f"{rows}, {len(seeds)}, {len(steps)}, {len(banned)}")
    if rows > batch_size:
        raise ValueError(f"batch_size must be >= len(params)={rows}, got {batch_size}")
    for s in seeds:
        if not is_int(s) or not 0 <= s < 2**32:
            raise ValueError(f"seeds must be ints in [0, 2**32), got {s!r}")


def _pack_banned(banned: Sequence[Sequence[int]], batch_size: int) -> np.ndarray:
    """[batch_size, K] i32, -1 padded, K = `banned_bucket` of the longest list."""
    out = np.full((batch_size, banned_bucket(max(map(len, banned), default=0))), -1, np.int32)
    for i, ids in enumerate(banned):
        if any(not is_int(j) or j < 0 for j in ids):
            raise ValueError(f"banned ids must be ints >= 0, got {list(ids)!r} for row {i}")
        out[i, :len(ids)] = ids
    return out


def _pack_bias(params: Sequence[SamplingParams], batch_size: int):
    """(ids [batch_size, K] i32 -1 padded, values [batch_size, K] f32) of each row's
    logit_bias."""
    biases = [p.logit_bias or {} for p in params]
    ids = _pack_banned([list(b) for b in biases], batch_size)
    values = np.zeros(ids.shape, np.float32)
    for i, b in enumerate(biases):
        values[i, :len(b)] = list(b.values())
    return ids, values


def _pack_mask(mask: np.ndarray | None, batch_size: int) -> np.ndarray:
    """[batch_size, W] i32: the rows of `mask` [n, W], then all-ones (unconstrained) rows;
    [batch_size, 0] when no row is constrained (the sampler then skips the mask)."""
    if mask is None:
        return np.zeros((batch_size, 0), np.int32)
    out = np.full((batch_size, mask.shape[1]), -1, np.int32)
    out[:len(mask)] = mask
    return out


def build_sampling_tensors(params: Sequence[SamplingParams], seeds: Sequence[int],
                           steps: Sequence[int], banned: Sequence[Sequence[int]],
                           batch_size: int, mask: np.ndarray | None = None) -> SamplingTensors:
    """Pack per-row parameters into numpy arrays padded to `batch_size`.

    `seeds[i]` is row i's seed (the engine picks one when `params[i].seed` is None), `steps[i]`
    the index of the token being sampled in that request's output, `banned[i]` the token ids
    forbidden this step. logit_bias and allowed_token_ids come from `params`. `mask`: the
    rows' token bitmasks [len(params), W] (all ones for an unconstrained row), or None when no
    row is constrained. Padding rows are greedy and neutral.
    """
    _check_batch(params, seeds, steps, banned, batch_size)
    bias_ids, bias = _pack_bias(params, batch_size)

    def col(values, fill, dtype):
        out = np.full(batch_size, fill, dtype)
        out[:len(values)] = values
        return out

    return SamplingTensors(
        temperature=col([0.0 if p.greedy else p.temperature for p in params], 0.0, np.float32),
        top_k=col([p.top_k for p in params], 0, np.int32),
        top_p=col([p.top_p for p in params], 1.0, np.float32),
        min_p=col([p.min_p for p in params], 0.0, np.float32),
        repetition_penalty=col([p.repetition_penalty for p in params], 1.0, np.float32),
        presence_penalty=col([p.presence_penalty for p in params], 0.0, np.float32),
        frequency_penalty=col([p.frequency_penalty for p in params], 0.0, np.float32),
        seed=col(list(seeds), 0, np.uint32),
        step=col(list(steps), 0, np.int32),
        banned=_pack_banned(banned, batch_size),
        bias_ids=bias_ids,
        bias=bias,
        allowed=_pack_banned([p.allowed_token_ids or () for p in params], batch_size),
        mask=_pack_mask(mask, batch_size),
    )


def sampling_mode(params: Iterable[SamplingParams]) -> str:
    """Cheapest static mode that serves every row.

    "greedy" if all rows are greedy; "sorted" if any sampled row uses top_k or top_p < 1;
    else "plain" (temperature + min_p only). Greedy rows' top_k / top_p are ignored.
    """
    sampled = [p for p in params if not p.greedy]
    if not sampled:
        return "greedy"
    if any(p.top_k > 0 or p.top_p < 1.0 for p in sampled):
        return "sorted"
    return "plain"


def uses_penalties(params: Iterable[SamplingParams]) -> bool:
    """True if any row uses a repetition, presence or frequency penalty."""
    return any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
               or p.frequency_penalty != 0.0 for p in params)


# ----------------------------------------------------------------------------------------------
# Device side: logits processing
# ----------------------------------------------------------------------------------------------


def _apply_banned(x, banned):
    """x [B, V] with the ids in banned [B, K] (-1 = none) set to -inf."""
    if banned.shape[1] == 0:
        return x
    b, v = x.shape
    ids = jnp.where(banned >= 0, banned, v)  # [B, K]; out-of-range ids are dropped
    return x.at[jnp.arange(b)[:, None], ids].set(_NEG_INF, mode="drop")


def _apply_bias(x, ids, bias):
    """x [B, V] plus bias [B, K] at ids [B, K] (-1 = none)."""
    if ids.shape[1] == 0:
        return x
    b, v = x.shape
    ids = jnp.where(ids >= 0, ids, v)  # [B, K]; out-of-range ids are dropped
    return x.at[jnp.arange(b)[:, None], ids].add(bias, mode="drop")


def _apply_allowed(x, allowed):
    """x [B, V] with every id outside allowed [B, K] set to -inf, in the rows that list any
    (-1 = none)."""
    if allowed.shape[1] == 0:
        return x
    b, v = x.shape
    rows = jnp.arange(b)[:, None]
    kept = jnp.take_along_axis(x, jnp.clip(allowed, 0, v - 1), axis=-1)  # [B, K]
    masked = jnp.where(jnp.any(allowed >= 0, axis=-1, keepdims=True), _NEG_INF, x)  # [B, V]
    return masked.at[rows, jnp.where(allowed >= 0, allowed, v)].set(kept, mode="drop")


def _apply_mask(x, mask):
    """x [B, V] with every token a row's bitmask mask [B, W] does not allow set to -inf
    (tokens past 32 W are not allowed)."""
    if mask.shape[1] == 0:
        return x
    b, v = x.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(b, -1)[:, :v] != 0  # [B, min(V, 32 W)]
    if allowed.shape[1] < v:
        allowed = jnp.pad(allowed, ((0, 0), (0, v - allowed.shape[1])))
    return jnp.where(allowed, x, _NEG_INF)


def _apply_penalties(x, t: SamplingTensors, prompt_mask, output_counts):
    """vLLM's repetition (prompt + output), then frequency and presence (output) penalties."""
    counts = output_counts.astype(jnp.float32)  # [B, V]
    in_output = output_counts > 0  # [B, V]
    rp = t.repetition_penalty[:, None]  # [B, 1]
    x = jnp.where(prompt_mask | in_output, jnp.where(x > 0, x / rp, x * rp), x)
    return (x - t.frequency_penalty[:, None] * counts
            - t.presence_penalty[:, None] * in_output.astype(jnp.float32))


def _penalised_logits(logits, t: SamplingTensors, prompt_mask, output_counts, penalties: bool):
    """The bitmask, logit_bias, allowed ids, banned ids -> -inf, then penalties if
    `penalties`. Returns [B, V] f32."""
    x = _apply_mask(logits.astype(jnp.float32), t.mask)
    x = _apply_bias(x, t.bias_ids, t.bias)
    x = _apply_banned(_apply_allowed(x, t.allowed), t.banned)
    if penalties:
        x = _apply_penalties(x, t, prompt_mask, output_counts)
    return x


def _block_size(v: int) -> int:
    """Block width of the two-level (block, then within-block) row scans."""
    if v <= _BLOCK:
        return v
    for blk in (_BLOCK, _BLOCK // 2, _BLOCK // 4):
        if v % blk == 0:
            return blk
    return _BLOCK  # the row gets padded with -inf


def _blocked(x):
    """[B, V] -> [B, nb, blk], padded with -inf to a whole number of blocks."""
    b, v = x.shape
    blk = _block_size(v)
    nb = -(-v // blk)
    if nb * blk != v:
        x = jnp.pad(x, ((0, 0), (0, nb * blk - v)), constant_values=_NEG_INF)
    return x.reshape(b, nb, blk)


def _bc(row, ndim: int):
    """A per-row [B] array reshaped to broadcast against a [B, ...] array of rank ndim."""
    return row.reshape(row.shape + (1,) * (ndim - 1))


def _first_true(mask):
    """Index of the first True along the last axis ([..., n] -> [...] i32; n if none).
    f32 reductions vectorise far better than int ones on CPU; exact for n < 2**24."""
    n = mask.shape[-1]
    return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.float32), float(n)), -1).astype(
        jnp.int32)


def _take_block(xb, bid):
    """Block bid [B] of each row of xb [B, nb, blk] -> [B, blk]."""
    return jnp.take_along_axis(xb, bid[:, None, None], axis=1)[:, 0]


def _take(a, idx):
    """a[row, idx[row]] for a [B, n], idx [B] -> [B]."""
    return jnp.take_along_axis(a, idx[:, None], axis=-1)[:, 0]


def _sub_blocks(x):
    """[B, V] -> [B, V // 16, 16] (or [B, 1, V] when 16 does not divide V): the small blocks
    whose maxima drive the argmax and the candidate selection."""
    b, v = x.shape
    sub = _SUB if v % _SUB == 0 else v
    return x.reshape(b, v // sub, sub)


def _greedy(x):
    """First index of the row maximum of x [B, V] and that maximum ([B] each): one pass for
    the maxima of small blocks, then a scan of one block per row."""
    xs = _sub_blocks(x)  # [B, n, sub]
    _, n, sub = xs.shape
    bmax = jnp.max(xs, axis=-1)  # [B, n]
    mx = jnp.max(bmax, axis=-1)  # [B]
    bid = jnp.minimum(_first_true(bmax == mx[:, None]), n - 1)  # [B]
    j = jnp.minimum(_first_true(_take_block(xs, bid) == mx[:, None]), sub - 1)  # [B]
    return bid * sub + j, mx


def _candidates(x, c: int):
    """The c largest values of each row of x [B, V], descending ([B, c]).

    Exact, and cheaper than lax.top_k on the whole row: the c largest values lie in the c
    small blocks with the largest maxima, so top_k runs on those blocks only."""
    xs = _sub_blocks(x)  # [B, n, sub]
    b, n, sub = xs.shape
    if n <= 4 * c:
        return jax.lax.top_k(x, min(c, x.shape[-1]))[0]
    _, bid = jax.lax.top_k(jnp.max(xs, axis=-1), c)  # [B, c] blocks with the largest maxima
    picked = jnp.take_along_axis(xs, bid[:, :, None], axis=1).reshape(b, c * sub)
    return jax.lax.top_k(picked, c)[0]


def _weights(xs, temp, thr, m):
    """Unnormalised probs exp(z - m) where z = xs / temp >= thr, else 0. xs [B, ...]; temp,
    thr, m [B]. Recomputed from the logits wherever needed rather than kept around."""
    z = xs / _bc(temp, xs.ndim)
    return jnp.where(z >= _bc(thr, xs.ndim), jnp.exp(z - _bc(m, xs.ndim)), 0.0)


def _f32_to_key(x):
    """Order-preserving map float32 -> uint32 (for bisection over float values)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _key_to_f32(k):
    """Inverse of `_f32_to_key`."""
    b = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _bisect_max(lo, hi, pred):
    """Largest float v in [lo, hi] (per row, [B]) with pred(v) true, given pred(lo) is true
    and pred is monotone (true then false). Exact: bisects the float32 order, at most 32
    steps, until every row's bracket is closed (rows given lo == hi cost nothing)."""

    def body(carry):
        lo_k, hi_k = carry
        gap = hi_k - lo_k
        mid = lo_k + (gap >> 1) + (gap & 1)  # ceil midpoint, no uint32 overflow
        ok = pred(_key_to_f32(mid)) | (gap == 0)  # [B] bool
        return jnp.where(ok, mid, lo_k), jnp.where(ok, hi_k, mid - 1)

    keys = (_f32_to_key(lo), _f32_to_key(jnp.maximum(hi, lo)))
    lo_k, _ = jax.lax.while_loop(lambda c: jnp.any(c[0] < c[1]), body, keys)
    return _key_to_f32(lo_k)


def _kth_largest_full(x, temp, k, hi, slow):
    """k-th largest z = x / temp of the `slow` rows (x [B, V], k [B] >= 1, hi [B] an upper
    bound), by bisection over the whole row. Slow path for k larger than the candidate set."""

    def at_least_k(tau):
        return jnp.sum((x / temp[:, None] >= tau[:, None]).astype(jnp.float32), axis=-1) >= k

    lo = jnp.where(slow, _NEG_INF, hi)  # [B]
    return _bisect_max(lo, hi, at_least_k)


def _top_k_threshold(x, temp, cand, top_k):
    """Per-row top-k threshold in z = x / temp units ([B]; -inf when off): the k-th largest z.
    cand [B, C]: the C largest z of each row, descending."""
    v, c = x.shape[-1], cand.shape[-1]
    k = jnp.minimum(top_k, v)  # [B]
    tau = _take(cand, jnp.clip(k - 1, 0, c - 1))  # [B]
    if c < v:
        slow = k > c  # [B]: the k-th value is not among the candidates
        tau = jax.lax.cond(jnp.any(slow), lambda: jnp.where(slow, _kth_largest_full(
            x, temp, jnp.maximum(k, 1), cand[:, -1], slow), tau), lambda: tau)
    return jnp.where(k > 0, tau, _NEG_INF)


def _nucleus_full(x, temp, thr, m, target, lo, hi):
    """z threshold of the nucleus (see `_top_p_threshold`) by bisection over the probabilities
    of the whole row, within the bracket [lo, hi] ([B], unnormalised probs). Slow path for
    nuclei larger than the candidate set."""
    w = _weights(x, temp, thr, m)  # [B, V], stored once: each bisection step reads only w
    pi = _bisect_max(lo, hi, lambda pi: jnp.sum(
        jnp.where(w >= pi[:, None], w, 0.0), axis=-1) >= target)  # [B] smallest kept prob
    kept = (w >= pi[:, None]) & (w > 0)  # [B, V]
    return jnp.min(jnp.where(kept, x / temp[:, None], jnp.inf), axis=-1)


def _top_p_threshold(x, temp, thr, m, cand, top_p):
    """Per-row top-p threshold in z units ([B]; -inf when top_p == 1) over the tokens already
    kept (z >= thr). A token is kept iff the renormalised mass of the tokens ranked strictly
    before it is < top_p: the token crossing top_p is kept, and so is at least one token.
    Skipped (no pass over the logits) when no row uses top_p."""
    return jax.lax.cond(jnp.any(top_p < 1),
                        lambda: _nucleus_threshold(x, temp, thr, m, cand, top_p),
                        lambda: jnp.full_like(thr, _NEG_INF))


def _nucleus_threshold(x, temp, thr, m, cand, top_p):
    """`_top_p_threshold` for a batch where some row uses top_p."""
    v, c = x.shape[-1], cand.shape[-1]
    total = jnp.sum(_weights(x, temp, thr, m), axis=-1)  # [B]
    target = top_p * total  # [B]
    q = jnp.where(cand >= thr[:, None], jnp.exp(cand - m[:, None]), 0.0)  # [B, C]
    incl = jnp.cumsum(q, axis=-1)  # [B, C]
    excl = jnp.concatenate([jnp.zeros_like(incl[:, :1]), incl[:, :-1]], axis=-1)  # [B, C]
    n_keep = jnp.maximum(jnp.sum((excl < target[:, None]).astype(jnp.float32), -1), 1)
    tau = _take(cand, n_keep.astype(jnp.int32) - 1)  # [B]
    if c < v:
        slow = (incl[:, -1] < target) & (top_p < 1)  # [B]: nucleus larger than candidates
        # The crossing token ranks after the candidates (prob <= q[:, -1]); the tokens from it
        # on (at most V) hold more than (1 - top_p) of the mass, so its prob exceeds this:
        lo = jnp.where(slow, 0.5 * (1 - top_p) * total / v, 0.0)  # [B]
        hi = jnp.where(slow, q[:, -1], 0.0)  # [B]
        tau = jax.lax.cond(jnp.any(slow), lambda: jnp.where(
            slow, _nucleus_full(x, temp, thr, m, target, lo, hi), tau), lambda: tau)
    return jnp.where(top_p < 1, tau, _NEG_INF)


def _thresholds(x, t: SamplingTensors, mx, mode: str):
    """Per-row (temperature, keep threshold, max) in z = x / temperature units, all [B].

    Row r keeps token j iff z[r, j] >= thr[r]: min_p, top_k and top_p each give a lower bound
    on the kept z (they keep the highest-probability tokens), so their combination is the max
    of the bounds, each computed on the distribution left by the previous filters (vLLM's
    order). x [B, V] penalised logits; mx [B] row maxima of x. Greedy rows use temperature 1
    and no top_k / top_p (their token is the argmax anyway)."""
    greedy = t.temperature < GREEDY_EPS  # [B]
    temp = jnp.where(greedy, 1.0, t.temperature)  # [B]
    m = jnp.where(jnp.isfinite(mx), mx / temp, 0.0)  # [B] max z (division is monotone)
    thr = m + jnp.log(t.min_p)  # [B] min_p: p < min_p * p_max <=> z < m + log(min_p)
    if mode == "sorted":
        cand = _candidates(x, _CANDIDATES) / temp[:, None]  # [B, C] largest z, descending
        top_k = jnp.where(greedy, 0, t.top_k)
        thr = jnp.maximum(thr, _top_k_threshold(x, temp, cand, top_k))
        top_p = jnp.where(greedy, 1.0, t.top_p)
        thr = jnp.maximum(thr, _top_p_threshold(x, temp, thr, m, cand, top_p))
    return temp, thr, m


def _row_uniforms(seed, step):
    """One U[0, 1) per row from fold_in(key(seed), step); seed u32 [B], step i32 [B]."""

    def one(s, i):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(s), i), (), jnp.float32)

    return jax.vmap(one)(seed, step)


def _inverse_cdf(xb, temp, thr, m, u):
    """Sample one token per row of blocked logits xb [B, nb, blk] from the kept tokens
    (z = xb / temp >= thr) with probs proportional to exp(z - m), by inverse CDF with u [B]
    in [0, 1). One pass for block masses, then a cumsum of the chosen block only. A token
    with zero probability (filtered or padding) can never be returned."""
    _, nb, blk = xb.shape
    bsum = jnp.sum(_weights(xb, temp, thr, m), axis=-1)  # [B, nb]
    bcum = jnp.cumsum(bsum, axis=-1)  # [B, nb]
    target = (1.0 - u) * bcum[:, -1]  # [B] in (0, total]
    bid = jnp.minimum(_first_true(bcum >= target[:, None]), nb - 1)  # [B]
    before = jnp.where(bid > 0, _take(bcum, jnp.maximum(bid - 1, 0)), 0.0)  # [B]
    inner = jnp.cumsum(_weights(_take_block(xb, bid), temp, thr, m), axis=-1)  # [B, blk]
    rest = jnp.minimum(target - before, inner[:, -1])  # [B] in (0, mass of the block]
    j = jnp.minimum(_first_true(inner >= rest[:, None]), blk - 1)  # [B]
    return bid * blk + j


def _check_mode(mode: str):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def sample(logits, t: SamplingTensors, prompt_mask, output_counts, *, mode: str,
           penalties: bool) -> jax.Array:
    """Choose the next token of every row. Returns [B] i32.

    logits [B, V] f32 (raw); prompt_mask [B, V] bool (token occurs in the prompt);
    output_counts [B, V] i32 (occurrences in this request's output so far). Both may be None
    when `penalties` is False. `mode` (see `sampling_mode`) and `penalties` are static:
    "plain" ignores top_k / top_p. A row's token depends only on its own logits, seed and step.
    """
    _check_mode(mode)
    x = _penalised_logits(logits, t, prompt_mask, output_counts, penalties)  # [B, V]
    xb = _blocked(x)  # [B, nb, blk]
    xp = xb.reshape(x.shape[0], -1)  # [B, V'] (V' >= V: padded with -inf)
    greedy_tok, mx = _greedy(xp)  # [B], [B]
    if mode == "greedy":
        return greedy_tok
    temp, thr, m = _thresholds(xp, t, mx, mode)  # [B] each
    tok = _inverse_cdf(xb, temp, thr, m, _row_uniforms(t.seed, t.step))  # [B]
    return jnp.where(t.temperature < GREEDY_EPS, greedy_tok, tok)


def processed_logprobs(logits, t: SamplingTensors, prompt_mask, output_counts, *, mode: str,
                       penalties: bool) -> jax.Array:
    """Log-probs [B, V] of the distribution `sample` draws from (after every processing step;
    -inf for filtered tokens). Greedy rows are one-hot on their argmax. For tests/debugging."""
    _check_mode(mode)
    x = _penalised_logits(logits, t, prompt_mask, output_counts, penalties)  # [B, V]
    xp = _blocked(x).reshape(x.shape[0], -1)  # [B, V'] the layout `sample` works on
    greedy_tok, mx = _greedy(xp)
    one_hot = jnp.where(jnp.arange(x.shape[-1]) == greedy_tok[:, None], 0.0, _NEG_INF)
    if mode == "greedy":
        return one_hot
    temp, thr, _ = _thresholds(xp, t, mx, mode)
    z = x / temp[:, None]  # [B, V]
    z = jnp.where(z >= thr[:, None], z, _NEG_INF)
    lp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)  # [B, V]
    return jnp.where((t.temperature < GREEDY_EPS)[:, None], one_hot, lp)


def logprob_parts(logits, num: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the logprobs of a step need besides the sampled token, from the RAW logits [B, V]:
    (log-sum-exp [B] f32, top ids [B, num] i32, top logprobs [B, num] f32); `num` is static
    and may be 0. The host sampler takes these from the device and the token's logprob is
    logits[token] - lse, as in `compute_logprobs`."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
    if num == 0:
        b = logits.shape[0]
        return lse, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    vals, ids = jax.lax.top_k(logits, num)  # [B, num]
    return lse, ids.astype(jnp.int32), vals - lse[:, None]


def compute_logprobs(logits, tokens, num: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probs under log_softmax of the RAW logits [B, V] (vLLM's default "raw_logprobs").

    Returns (logprob of tokens [B] f32, top ids [B, num] i32, top logprobs [B, num] f32);
    `num` is static and may be 0."""
    lse, top_ids, top_lp = logprob_parts(logits, num)
    tok = jnp.take_along_axis(logits.astype(jnp.float32), tokens.astype(jnp.int32)[:, None],
                              axis=-1)[:, 0] - lse
    return tok, top_ids, top_lp
