"""Tests of SamplingParams (jaxpipe.request.params) and the device sampler
(jaxpipe.runtime.sampling): parameter validation, the device sampler against an independent
NumPy reference, determinism / batch independence, and empirical distributions."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.request.params import SamplingParams
from jaxpipe.runtime.sampling import (
    SamplingTensors,
    _candidates,
    build_sampling_tensors,
    compute_logprobs,
    processed_logprobs,
    sample,
    sampling_mode,
    uses_penalties,
)

V = 97  # small prime vocabulary

_sample = jax.jit(sample, static_argnames=("mode", "penalties"))
_processed = jax.jit(processed_logprobs, static_argnames=("mode", "penalties"))
_logprobs = jax.jit(compute_logprobs, static_argnames=("num",))


# ----------------------------------------------------------------------------------------------
# NumPy reference (float64, sort based, written independently of the device code)
# ----------------------------------------------------------------------------------------------


def ref_probs(logits, p: SamplingParams, prompt_ids=(), counts=None, banned=()):
    """Final sampling distribution of one row, following vLLM's order."""
    x = np.asarray(logits, np.float64).copy()
    counts = np.zeros(len(x)) if counts is None else np.asarray(counts, np.float64)
    x[list(banned)] = -np.inf
    seen = counts > 0
    seen[list(prompt_ids)] = True
    rp = p.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if p.greedy:
        return np.eye(len(x))[np.argmax(x)]
    q, order = _ref_before_top_p(x, p)
    if p.top_p < 1:
        excl = np.cumsum(q[order]) - q[order]  # mass ranked strictly before each token
        q[order[excl >= p.top_p]] = 0.0
    return q / q.sum()


def _ref_before_top_p(x, p: SamplingParams):
    """Temperature, min_p and top_k on penalised logits x: (renormalised probs, rank order)."""
    probs = np.exp(x / p.temperature - np.max(x / p.temperature))
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    q = np.where(keep, probs, 0.0)
    return q / q.sum(), order


def nucleus_margin(logits, p: SamplingParams):
    """Distance of top_p from the nearest cumulative mass of the distribution top_p sees: the
    reference nucleus is only unambiguous (float32 vs float64) when this is not tiny."""
    q, order = _ref_before_top_p(np.asarray(logits, np.float64), p)
    return np.min(np.abs(np.cumsum(q[order]) - p.top_p))


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def tensors(params, seeds=None, steps=None, banned=None, batch_size=None):
    n = len(params)
    st = build_sampling_tensors(
        params,
        seeds if seeds is not None else list(range(n)),
        steps if steps is not None else [0] * n,
        banned if banned is not None else [[] for _ in range(n)],
        batch_size or n)
    return SamplingTensors(*(jnp.asarray(a) for a in st))


def penalty_inputs(batch, vocab, prompt_ids=None, counts=None):
    mask = np.zeros((batch, vocab), bool)
    cnt = np.zeros((batch, vocab), np.int32)
    for i in range(batch):
        if prompt_ids is not None:
            mask[i, list(prompt_ids[i])] = True
        if counts is not None:
            cnt[i] = counts[i]
    return jnp.asarray(mask), jnp.asarray(cnt)


def run(logits, params, *, mode=None, penalties=None, batch_size=None, **kw):
    """Sample one token per row of logits [b, V]; the batch is padded (zero logits, neutral
    rows) to batch_size, by default 8 so that most tests share one compiled shape."""
    mode = mode or sampling_mode(params)
    penalties = uses_penalties(params) if penalties is None else penalties
    b, v = np.shape(logits)
    size = batch_size or max(8, b)
    padded = np.zeros((size, v), np.float32)
    padded[:b] = logits
    pm, oc = penalty_inputs(size, v) if penalties else (None, None)
    st = tensors(params, batch_size=size, **kw)
    return np.asarray(_sample(jnp.asarray(padded), st, pm, oc, mode=mode,
                              penalties=penalties))[:b]


def fixed_logits(seed=0, batch=1, vocab=V, scale=2.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# SamplingParams
# ----------------------------------------------------------------------------------------------


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == ((), (), False, True)
    assert not p.greedy


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=[2, 7], temperature=0)
    assert p.top_k == 0 and p.stop == ("###",) and p.stop_token_ids == (2, 7)
    assert p.greedy and isinstance(p.temperature, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(seed=2**32 - 1, logprobs=20, top_p=1, min_p=1).seed == 2**32 - 1


@pytest.mark.parametrize("field,value", [
    ("n", 129), ("n", 0), ("n", 1.0),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", True),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("seed", -1), ("seed", 2**32), ("seed", 1.5), ("seed", True),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 3.0),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", None),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 3),
    ("ignore_eos", 1), ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0),
    ("skip_special_tokens", "yes"),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises((ValueError, TypeError), match=field) as info:
        SamplingParams(**{field: value})
    if field not in ("stop", "stop_token_ids") and not isinstance(value, list):
        assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_error_message_states_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_mode_and_penalty_selection():
    g, s = SamplingParams(temperature=0), SamplingParams()
    assert sampling_mode([g, g]) == "greedy" and sampling_mode([]) == "greedy"
    assert sampling_mode([g, s]) == "plain"
    assert sampling_mode([s, SamplingParams(min_p=0.1)]) == "plain"
    assert sampling_mode([s, SamplingParams(top_k=5)]) == "sorted"
    assert sampling_mode([s, SamplingParams(top_p=0.9)]) == "sorted"
    assert sampling_mode([SamplingParams(temperature=0, top_k=5), s]) == "plain"
    assert not uses_penalties([g, s])
    assert uses_penalties([s, SamplingParams(repetition_penalty=1.1)])
    assert uses_penalties([SamplingParams(presence_penalty=-0.5)])
    assert uses_penalties([SamplingParams(temperature=0, frequency_penalty=0.5)])


def test_build_sampling_tensors_pads_and_buckets():
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7), SamplingParams(
        temperature=1e-6, repetition_penalty=1.2)]
    st = build_sampling_tensors(params, [7, 2**32 - 1], [3, 0], [[1, 2], list(range(9))], 4)
    np.testing.assert_array_equal(st.temperature, np.float32([0.5, 0, 0, 0]))
    np.testing.assert_array_equal(st.top_k, [3, 0, 0, 0])
    np.testing.assert_array_equal(st.top_p, np.float32([0.9, 1, 1, 1]))
    np.testing.assert_array_equal(st.repetition_penalty, np.float32([1, 1.2, 1, 1]))
    np.testing.assert_array_equal(st.seed, np.uint32([7, 2**32 - 1, 0, 0]))
    np.testing.assert_array_equal(st.step, [3, 0, 0, 0])
    assert st.banned.shape == (4, 16) and st.banned.dtype == np.int32
    np.testing.assert_array_equal(st.banned[0, :3], [1, 2, -1])
    assert (st.banned[2:] == -1).all()
    assert build_sampling_tensors([], [], [], [], 2).banned.shape == (2, 0)  # none banned
    assert build_sampling_tensors([SamplingParams()], [0], [0], [[5]], 2).banned.shape == (2, 8)
    with pytest.raises(ValueError, match="batch_size"):
        build_sampling_tensors(params, [0, 0], [0, 0], [[], []], 1)
    with pytest.raises(ValueError, match="seeds"):
        build_sampling_tensors(params, [0, -1], [0, 0], [[], []], 2)
    with pytest.raises(ValueError, match="banned"):
        build_sampling_tensors(params, [0, 1], [0, 0], [[], [-3]], 2)


# ----------------------------------------------------------------------------------------------
# Device filtering against the reference
# ----------------------------------------------------------------------------------------------


def check_processed(logits, params, mode=None, prompt_ids=None, counts=None, banned=None):
    """processed_logprobs == log(reference distribution), row by row (kept set exactly)."""
    b, v = logits.shape
    mode = mode or sampling_mode(params)
    pm, oc = penalty_inputs(b, v, prompt_ids, counts)
    st = tensors(params, banned=banned)
    lp = np.asarray(_processed(jnp.asarray(logits), st, pm, oc, mode=mode, penalties=True))
    for i, p in enumerate(params):
        ref = ref_probs(logits[i], p, prompt_ids[i] if prompt_ids else (),
                        None if counts is None else counts[i], banned[i] if banned else ())
        np.testing.assert_array_equal(np.isfinite(lp[i]), ref > 0, err_msg=f"row {i}: {p}")
        np.testing.assert_allclose(np.exp(lp[i]), ref, rtol=2e-5, atol=1e-7)


FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=2.5, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(top_k=1),
    SamplingParams(top_k=200),  # larger than the vocabulary: keeps everything
    SamplingParams(temperature=0.9, top_p=0.5),
    SamplingParams(temperature=1.5, top_p=0.95),
    SamplingParams(top_p=0.01),  # only the most likely token survives
    SamplingParams(temperature=0.8, top_k=10, top_p=0.6),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.0, top_k=5),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=lambda p: (
    f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}"))
def test_filtering_matches_reference(params):
    logits = fixed_logits(seed=1, batch=3)
    for row in logits:
        assert params.greedy or params.top_p == 1 or nucleus_margin(row, params) > 1e-4
    check_processed(logits, [params] * 3)


def test_exact_kept_sets():
    logits = np.linspace(-3, 3, V).astype(np.float32)[None][:, ::-1].copy()  # token 0 largest
    st = tensors([SamplingParams(top_k=3)])
    lp = np.asarray(_processed(jnp.asarray(logits), st, None, None, mode="sorted",
                               penalties=False))
    assert np.flatnonzero(np.isfinite(lp[0])).tolist() == [0, 1, 2]
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    assert nucleus_margin(logits[0], SamplingParams(top_p=0.5)) > 1e-3
    n = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1  # first prefix reaching 0.5
    st = tensors([SamplingParams(top_p=0.5)])
    lp = np.asarray(_processed(jnp.asarray(logits), st, None, None, mode="sorted",
                               penalties=False))
    assert np.flatnonzero(np.isfinite(lp[0])).tolist() == list(range(n))
    st = tensors([SamplingParams(min_p=0.5)])  # keeps p >= 0.5 * p_max: z >= z_max - ln 2
    lp = np.asarray(_processed(jnp.asarray(logits), st, None, None, mode="plain",
                               penalties=False))
    expect = np.flatnonzero(logits[0] >= logits[0].max() - np.log(2)).tolist()
    assert np.flatnonzero(np.isfinite(lp[0])).tolist() == expect and len(expect) > 1


def test_penalty_arithmetic():
    logits = np.array([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0] + [0.0] * 7], np.float32)
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25)]
    counts = np.zeros((1, 13), np.int32)
    counts[0, 2], counts[0, 3] = 3, 1  # output tokens
    pm, oc = penalty_inputs(1, 13, [[0, 1]], counts)  # prompt tokens 0 and 1
    expect = logits[0].astype(np.float64)
    expect[:4] = [1.0, -4.0, 0.5 - 1.5 - 0.25, -2.0 - 0.5 - 0.25]
    lp = np.asarray(_processed(jnp.asarray(logits), tensors(params), pm, oc, mode="plain",
                               penalties=True))[0]
    ref = expect - np.log(np.exp(expect).sum())
    np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-6)
    check_processed(logits, params, prompt_ids=[[0, 1]], counts=counts)


def test_penalties_against_reference():
    rng = np.random.default_rng(5)
    logits = fixed_logits(seed=2, batch=4)
    prompts = [rng.choice(V, 10, replace=False) for _ in range(4)]
    counts = rng.integers(0, 3, (4, V)) * (rng.random((4, V)) < 0.2)
    params = [SamplingParams(repetition_penalty=1.3, top_k=20),
              SamplingParams(repetition_penalty=0.8, presence_penalty=1.0, temperature=0.5),
              SamplingParams(frequency_penalty=-0.7, presence_penalty=-1.5, top_p=0.9),
              SamplingParams(temperature=0, repetition_penalty=5.0, frequency_penalty=2.0)]
    check_processed(logits, params, prompt_ids=prompts, counts=counts)
    banned = [[int(np.argmax(logits[i]))] for i in range(4)]
    check_processed(logits, params, prompt_ids=prompts, counts=counts, banned=banned)


LARGE_CASES = [
    SamplingParams(temperature=0.9, top_k=300),  # k above the candidate count
    SamplingParams(temperature=1.2, top_p=0.95),  # nucleus above the candidates (flat rows)
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.001),
    SamplingParams(temperature=1.1, top_k=700, top_p=0.9),
]


@pytest.mark.parametrize("vocab", [16384, 10007])  # 10007: rows padded to whole blocks
def test_large_vocab_paths_match_reference(vocab):
    """Candidate selection and the exact bisection fallbacks, on flat and peaked rows."""
    logits = fixed_logits(seed=3, batch=2 * len(LARGE_CASES), vocab=vocab, scale=1.0)
    logits[1::2] *= 6  # each case on a flat row and on a peaked row
    params = [p for p in LARGE_CASES for _ in range(2)]
    for row, p in zip(logits, params, strict=True):
        assert p.top_p == 1 or nucleus_margin(row, p) > 1e-6
    check_processed(logits, params)
    toks = run(logits, params, seeds=list(range(len(params))))
    assert all(ref_probs(row, p)[t] > 0 for row, p, t in zip(logits, params, toks, strict=True))


# ----------------------------------------------------------------------------------------------
# Sampling behaviour
# ----------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = fixed_logits(seed=4, batch=6)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # tie: the first index wins
    params = [SamplingParams(temperature=0)] * 6
    np.testing.assert_array_equal(run(logits, params), np.argmax(logits, -1))
    mixed = params[:3] + [SamplingParams(top_k=5)] * 3  # greedy rows inside a sorted batch
    np.testing.assert_array_equal(run(logits, mixed)[:3], np.argmax(logits[:3], -1))
    np.testing.assert_array_equal(run(logits, [SamplingParams(temperature=1e-6)] * 6,
                                      mode="plain"), np.argmax(logits, -1))


def test_banned_ids_are_never_sampled():
    logits = fixed_logits(seed=5, batch=4)
    top = np.argsort(-logits, -1)[:, :3]  # ban each row's three most likely tokens
    banned = [list(map(int, r)) for r in top]
    greedy = run(logits, [SamplingParams(temperature=0)] * 4, banned=banned)
    np.testing.assert_array_equal(greedy, np.argsort(-logits, -1)[:, 3])
    for params in (SamplingParams(temperature=0.2), SamplingParams(top_k=4)):
        for step in range(30):
            toks = run(logits, [params] * 4, banned=banned, steps=[step] * 4)
            assert not any(toks[i] in banned[i] for i in range(4))


def test_same_row_same_token_whatever_the_batch():
    rng = np.random.default_rng(6)
    row = fixed_logits(seed=7)[0]
    p = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=123)
    others = [SamplingParams(temperature=0), SamplingParams(top_k=2),
              SamplingParams(temperature=3.0, top_p=0.3), SamplingParams(min_p=0.5),
              SamplingParams(repetition_penalty=1.5, top_k=300)]
    seen = set()
    for step in range(12):
        alone = run(row[None], [p], seeds=[123], steps=[step])[0]
        seen.add(int(alone))
        for batch, pos in ((3, 0), (5, 2), (9, 8)):
            logits = fixed_logits(seed=100 + step * 10 + batch, batch=batch)
            logits[pos] = row
            params = [others[int(j)] for j in rng.integers(0, len(others), batch)]
            params[pos] = p
            seeds = [int(s) for s in rng.integers(0, 2**32, batch)]
            seeds[pos] = 123
            steps = [int(s) for s in rng.integers(0, 50, batch)]
            steps[pos] = step
            banned = [[int(j) for j in rng.integers(0, V, 3)] for _ in range(batch)]
            banned[pos] = []
            toks = run(logits, params, seeds=seeds, steps=steps, banned=banned,
                       batch_size=batch + 3)
            assert toks[pos] == alone, (step, batch, pos)
    assert len(seen) > 3  # the row really is sampled, not decided by its argmax


def test_row_without_top_k_p_samples_the_same_in_plain_and_sorted_modes():
    logits = fixed_logits(seed=8, batch=2, scale=1.0)
    p = SamplingParams(temperature=0.8, min_p=0.02)
    for step in range(10):
        plain = run(logits[:1], [p], mode="plain", seeds=[9], steps=[step])[0]
        sorted_ = run(logits, [p, SamplingParams(top_k=3)], seeds=[9, 1], steps=[step, 0])[0]
        assert plain == sorted_


def test_seeds_and_steps_change_the_draw():
    logits = np.zeros((2, V), np.float32)  # uniform: any two draws collide with prob 1/V
    p = [SamplingParams()] * 2
    draws = np.array([run(logits, p, seeds=[1, 2], steps=[s, s]) for s in range(60)])
    assert np.mean(draws[:, 0] == draws[:, 1]) < 0.1  # different seeds
    assert len(set(draws[:, 0].tolist())) > 30  # different steps
    again = np.array([run(logits, p, seeds=[1, 2], steps=[s, s]) for s in range(60)])
    np.testing.assert_array_equal(draws, again)  # reproducible
    top = np.array([run(logits, p, seeds=[2**32 - 1, 0], steps=[s, s]) for s in range(10)])
    assert len(set(top[:, 0].tolist())) > 5  # the largest seed works too


def empirical(logits_row, params, draws, rows=500):
    """Token counts over `draws` samples: `rows` identical rows with distinct seeds, several
    steps each."""
    logits = np.repeat(logits_row[None], rows, 0)
    counts = np.zeros(len(logits_row), np.int64)
    for step in range(draws // rows):
        toks = run(logits, [params] * rows, seeds=list(range(rows)), steps=[step] * rows)
        counts += np.bincount(toks, minlength=len(logits_row))
    return counts


SMALL = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, -4.0, -8.0], np.float32)
SPREAD = np.full(1000, -3.0, np.float32)  # 1000 = padded to 4 blocks of 256
SPREAD[[3, 100, 255, 256, 511, 512, 700, 999]] = [2.0, 1.0, 1.5, 0.5, 2.2, 0.0, 1.2, 1.8]


@pytest.mark.parametrize("logits,params", [
    (SMALL, SamplingParams(temperature=0.7)),
    (SMALL, SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.02)),
    (SPREAD, SamplingParams(temperature=0.9, top_k=7, top_p=0.97)),
], ids=["plain", "filtered", "blocks"])
def test_empirical_distribution_matches_reference(logits, params):
    ref = ref_probs(logits, params)
    n = 20000
    counts = empirical(logits, params, n)
    assert counts[ref == 0].sum() == 0  # filtered tokens never appear
    assert (ref > 0).sum() >= 4
    sel = ref * n >= 5
    chi2 = (((counts - n * ref)[sel]) ** 2 / (n * ref[sel])).sum()
    df = sel.sum() - 1
    assert chi2 < df + 6 * np.sqrt(2 * df) + 10, (chi2, df)  # loose: about 1e-6 false alarm
    assert np.max(np.abs(counts / n - ref)) < 0.02


def test_candidates_are_the_largest_values_even_with_ties():
    rng = np.random.default_rng(12)
    x = rng.integers(0, 6, (3, 16384)).astype(np.float32)  # heavy ties
    x[1] = rng.standard_normal(16384)
    x[2, :9000] = -np.inf
    got = np.asarray(jax.jit(lambda a: _candidates(a, 128))(jnp.asarray(x)))
    np.testing.assert_array_equal(got, -np.sort(-x, -1)[:, :128])


def test_sample_is_jittable_with_traced_params_and_deterministic():
    logits = jnp.asarray(fixed_logits(seed=9, batch=4))
    st = tensors([SamplingParams(top_k=k) for k in (1, 2, 3, 4)], seeds=[5] * 4)
    f = jax.jit(partial(sample, mode="sorted", penalties=False))
    a = f(logits, st, None, None)
    b = f(logits, st._replace(top_k=st.top_k[::-1]), None, None)
    assert a.dtype == jnp.int32 and a.shape == (4,)
    assert int(a[0]) == int(np.argmax(logits[0]))  # top_k=1 is the argmax
    assert int(b[3]) == int(np.argmax(logits[3]))  # new top_k values, same compiled function
    np.testing.assert_array_equal(a, f(logits, st, None, None))


def test_invalid_mode():
    with pytest.raises(ValueError, match="mode"):
        sample(jnp.zeros((1, V)), tensors([SamplingParams()]), None, None, mode="nucleus",
               penalties=False)


# ----------------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num", [0, 1, 5, 20])
def test_compute_logprobs_matches_log_softmax(num):
    logits = fixed_logits(seed=10, batch=3, scale=4.0)
    tokens = np.array([0, 50, 96], np.int32)
    tok, ids, top = map(np.asarray, _logprobs(jnp.asarray(logits), jnp.asarray(tokens), num))
    x = logits.astype(np.float64)
    ref = x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
               + x.max(-1, keepdims=True))
    np.testing.assert_allclose(tok, ref[np.arange(3), tokens], rtol=1e-5, atol=1e-5)
    assert ids.shape == top.shape == (3, num) and ids.dtype == np.int32
    order = np.argsort(-ref, -1)[:, :num]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_allclose(top, np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)
