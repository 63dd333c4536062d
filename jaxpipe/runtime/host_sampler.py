"""The host sampler: `sampling.sample`'s choices made in NumPy on worker threads (SiPipe's CPU
sampling), for `EngineConfig(sampler="host")`.

The step program then ends at the LM head; the sampled rows' logits come to the host and are
split over `threads` workers (NumPy's array loops release the GIL). Processing order, filters
and arithmetic are the device sampler's, block for block: float32 throughout, exact top_k /
top_p thresholds (the 128 largest values from the blocks with the largest maxima, a full-row
pass only for a row that needs more), and inverse-CDF sampling over 256-token blocks with the
same per-row uniform (`fold_in(key(seed), step)`). A row's token is therefore the device
sampler's, except where a uniform falls within float32 summation error of a token's boundary.

Penalties are kept per slot as the token ids the sequence has seen (prompt and output) with
their output counts, updated with each sampled token and applied to those ids only: O(seen
ids) per row instead of the device sampler's dense [B, V] pass over a [slots, V] count table.
(SiPipe keeps a column-wise [V, B] table so that one token's update touches one contiguous
column; the sparse form touches only the ids a row has seen, and nothing else.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxpipe.request.params import GREEDY_EPS
from jaxpipe.runtime import sampling
from jaxpipe.runtime.sampling import SamplingTensors

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


class _Seen:
    """One slot's penalty state: ids seen (prompt or output), their output counts."""

    def __init__(self, prompt, output):
        ids = np.unique(np.concatenate([np.asarray(prompt, np.int64),
                                        np.asarray(output, np.int64)]))
        self.n = len(ids)
        self.ids = np.zeros(max(16, 2 * self.n), np.int64)
        self.ids[:self.n] = ids
        self.counts = np.zeros(len(self.ids), _F32)
        np.add.at(self.counts, np.searchsorted(ids, np.asarray(output, np.int64)), 1)
        self.index = {int(t): i for i, t in enumerate(ids)}

    def add(self, token: int) -> None:
        """Count one sampled token (a new id is appended; the arrays double when full)."""
        i = self.index.get(token)
        if i is None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.index[token] = self.n
            self.ids[i] = token
            self.n += 1
        self.counts[i] += 1

    def apply(self, row: np.ndarray, rp, fp, pp) -> None:
        """vLLM's repetition (prompt + output), frequency and presence penalties, in place on
        one row of logits (only the seen ids change; the device sampler's arithmetic)."""
        ids, counts = self.ids[:self.n], self.counts[:self.n]
        v = row[ids]
        v = np.where(v > 0, v / rp, v * rp)
        row[ids] = v - fp * counts - pp * (counts > 0).astype(_F32)


class HostSampler:
    """Per-slot penalty state and a thread pool that samples rows of host logits."""

    def __init__(self, num_slots: int, threads: int = 2):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.num_slots, self.threads = num_slots, threads
        self._seen: list[_Seen | None] = [None] * num_slots
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxpipe-sampler")
        self._cpu = jax.devices("cpu")[0]
        self._row_uniforms = jax.jit(sampling._row_uniforms)  # runs where its inputs are

    def restore(self, slot: int, prompt, output) -> None:
        """Set `slot`'s penalty state for the sequence that moved there."""
        self._seen[slot] = _Seen(prompt, output)

    def sample(self, logits: np.ndarray, slots: np.ndarray, t: SamplingTensors, mode: str,
               penalties: bool) -> np.ndarray:
        """Tokens [n] for host logits [n, V] of `slots` [n]; counts them into the slots'
        penalty state when `penalties`. `t` has at least n rows (the first n are used)."""
        n = len(slots)
        t = SamplingTensors(*(np.asarray(a)[:n] for a in t))
        u = None if mode == "greedy" else np.asarray(self._row_uniforms(
            *jax.device_put((t.seed, t.step), self._cpu)))
        bounds = np.linspace(0, n, min(self.threads, n) + 1).astype(int)
        parts = [self._pool.submit(self._rows, logits[a:b], slots[a:b], _rows_of(t, a, b),
                                   None if u is None else u[a:b], mode, penalties)
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        tokens = np.concatenate([p.result() for p in parts]) if parts else np.zeros(0, np.int32)
        if penalties:
            for slot, token in zip(slots, tokens, strict=True):
                if self._seen[slot] is not None:
                    self._seen[slot].add(int(token))
        return tokens

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _rows(self, logits, slots, t: SamplingTensors, u, mode: str, penalties: bool):
        x = np.array(logits, _F32)  # own copy: biases, bans and penalties are written into it
        apply_id_lists(x, t)
        if penalties:
            for i, slot in enumerate(slots):
                if self._seen[slot] is not None:
                    self._seen[slot].apply(x[i], t.repetition_penalty[i],
                                           t.frequency_penalty[i], t.presence_penalty[i])
        return sample_penalised(x, t, u, mode)


def apply_id_lists(x: np.ndarray, t: SamplingTensors) -> None:
    """The device sampler's first steps, in place on x [b, V] f32: a constrained row's
    bitmask (tokens it does not allow -inf), logit_bias added, every id outside a row's
    allowed list -inf (rows that list any), banned ids -inf."""
    if t.mask.shape[1]:
        bits = np.unpackbits(np.ascontiguousarray(t.mask).view(np.uint8), axis=-1,
                             bitorder="little")[:, :x.shape[1]]  # [b, <= V]
        x[:, :bits.shape[1]][bits == 0] = _NEG_INF
        x[:, bits.shape[1]:] = _NEG_INF
    rows, cols = np.nonzero(t.bias_ids >= 0)
    x[rows, t.bias_ids[rows, cols]] += t.bias[rows, cols]
    for r in np.flatnonzero(np.any(t.allowed >= 0, axis=-1)):
        ids = t.allowed[r][t.allowed[r] >= 0]
        kept = x[r, ids]
        x[r] = _NEG_INF
        x[r, ids] = kept
    rows, cols = np.nonzero(t.banned >= 0)
    x[rows, t.banned[rows, cols]] = _NEG_INF


def _rows_of(t: SamplingTensors, a: int, b: int) -> SamplingTensors:
    return SamplingTensors(*(x[a:b] for x in t))


def sample_penalised(x: np.ndarray, t: SamplingTensors, u, mode: str) -> np.ndarray:
    """`sampling.sample` from penalised logits x [b, V] f32 (banned ids already -inf) with
    uniforms u [b] (None in greedy mode). Returns [b] i32."""
    rows = np.arange(x.shape[0])
    greedy_tok = np.argmax(x, axis=-1)  # first index of the maximum, as the device's
    if mode == "greedy":
        return greedy_tok.astype(np.int32)
    mx = x[rows, greedy_tok]
    greedy = t.temperature < GREEDY_EPS
    temp = np.where(greedy, _F32(1), t.temperature).astype(_F32)
    m = np.where(np.isfinite(mx), mx / temp, _F32(0)).astype(_F32)
    with np.errstate(divide="ignore"):
        thr = (m + np.log(t.min_p)).astype(_F32)
    z = x / temp[:, None]  # [b, V]
    w = None
    if mode == "sorted":
        cand = _candidates(x, sampling._CANDIDATES) / temp[:, None]  # [b, C] descending
        thr = np.maximum(thr, _top_k_threshold(z, cand, np.where(greedy, 0, t.top_k)))
        top_p = np.where(greedy, _F32(1), t.top_p).astype(_F32)
        if np.any(top_p < 1):
            w = _weights(z, thr, m)
            thr = np.maximum(thr, _top_p_threshold(z, w, thr, m, cand, top_p))
    if w is None:
        w = _weights(z, thr, m)
    else:
        w[z < thr[:, None]] = 0
    tok = _inverse_cdf(w, u)
    return np.where(greedy, greedy_tok, tok).astype(np.int32)


def _weights(z, thr, m):
    """exp(z - m) where z >= thr, else 0 ([b, V]); exp runs on the kept tokens only."""
    kept = z >= thr[:, None]
    out = np.zeros(z.shape, _F32)
    np.subtract(z, m[:, None], out=out, where=kept)
    return np.exp(out, out=out, where=kept)


def _candidates(x, c: int):
    """The c largest values of each row of x [b, V], descending. Exact: they lie in the c
    groups with the largest maxima, for any split of the row into groups; the groups here are
    strided (x[j::n]), whose maxima NumPy takes with contiguous vector loops."""
    b, v = x.shape
    sub = sampling._SUB if v % sampling._SUB == 0 else v
    n = v // sub
    if n <= 4 * c:
        return -np.sort(-x, axis=-1)[:, :c]
    xs = x.reshape(b, sub, n)  # group j of a row: x[j], x[j + n], ..., x[j + (sub - 1) n]
    gid = np.argpartition(-xs.max(axis=1), c - 1, axis=-1)[:, :c]  # [b, c]
    picked = np.take_along_axis(xs, gid[:, None, :], axis=2).reshape(b, sub * c)
    return -np.sort(-picked, axis=-1)[:, :c]


def _top_k_threshold(z, cand, top_k):
    """k-th largest z per row ([b]; -inf where top_k is 0)."""
    v, c = z.shape[-1], cand.shape[-1]
    k = np.minimum(top_k, v)
    tau = np.take_along_axis(cand, np.clip(k - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    for r in np.flatnonzero(k > c):  # the k-th value is not among the candidates
        tau[r] = np.partition(z[r], v - k[r])[v - k[r]]
    return np.where(k > 0, tau, _NEG_INF).astype(_F32)


def _top_p_threshold(z, w, thr, m, cand, top_p):
    """The nucleus threshold in z units ([b]; -inf where top_p is 1): a token is kept iff the
    mass ranked strictly before it is < top_p of the kept mass (w: the weights so far)."""
    total = w.sum(axis=-1, dtype=_F32)
    target = (top_p * total).astype(_F32)
    with np.errstate(over="ignore"):
        q = np.where(cand >= thr[:, None], np.exp(cand - m[:, None]), _F32(0))
    incl = np.cumsum(q, axis=-1, dtype=_F32)
    excl = np.concatenate([np.zeros_like(incl[:, :1]), incl[:, :-1]], axis=-1)
    n_keep = np.maximum((excl < target[:, None]).sum(-1), 1)
    tau = np.take_along_axis(cand, (n_keep - 1)[:, None], axis=-1)[:, 0]
    slow = (incl[:, -1] < target) & (top_p < 1)
    for r in np.flatnonzero(slow):  # the nucleus is larger than the candidate set
        order = np.sort(w[r][w[r] > 0])[::-1]
        j = min(int(np.searchsorted(np.cumsum(order, dtype=_F32), target[r])), len(order) - 1)
        tau[r] = z[r][(w[r] >= order[j]) & (w[r] > 0)].min()
    return np.where(top_p < 1, tau, _NEG_INF).astype(_F32)


def _inverse_cdf(w, u):
    """One token per row with probability proportional to w [b, V] (>= 0), by inverse CDF
    with u [b]: block masses, then a cumulative sum inside the chosen block."""
    b, v = w.shape
    blk = sampling._block_size(v)
    nb = -(-v // blk)
    if nb * blk != v:
        w = np.pad(w, ((0, 0), (0, nb * blk - v)))
    wb = w.reshape(b, nb, blk)
    bcum = np.cumsum(wb.sum(axis=-1, dtype=_F32), axis=-1, dtype=_F32)  # [b, nb]
    target = ((1 - u) * bcum[:, -1]).astype(_F32)
    bid = np.minimum(np.argmax(bcum >= target[:, None], axis=-1), nb - 1)
    rows = np.arange(b)
    before = np.where(bid > 0, bcum[rows, np.maximum(bid - 1, 0)], _F32(0))
    inner = np.cumsum(wb[rows, bid], axis=-1, dtype=_F32)  # [b, blk]
    rest = np.minimum(target - before, inner[:, -1])
    j = np.minimum(np.argmax(inner >= rest[:, None], axis=-1), blk - 1)
    return bid * blk + j


def host_logprobs(logits: np.ndarray, tokens: np.ndarray, lse: np.ndarray):
    """Logprob [n] of each row's sampled token under the raw logits, given the row's
    log-sum-exp from the device (so the value is the device sampler's, bit for bit)."""
    return logits[np.arange(len(tokens)), tokens] - lse
