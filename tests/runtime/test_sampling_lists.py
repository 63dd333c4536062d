"""logit_bias, allowed_token_ids and banned ids (bad words, min_tokens' stop ids) in the device
sampler (jaxpipe.runtime.sampling) and the host sampler (jaxpipe.runtime.host_sampler), against
a float64 NumPy reference of vLLM's order: bias added, ids outside the allowed list removed,
banned ids removed, then temperature and top_k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.request.params import SamplingParams
from jaxpipe.runtime.host_sampler import HostSampler
from jaxpipe.runtime.sampling import (
    build_sampling_tensors,
    processed_logprobs,
    sample,
    sampling_mode,
)

V = 97  # small prime vocabulary
_sample = jax.jit(sample, static_argnames=("mode", "penalties"))
_processed = jax.jit(processed_logprobs, static_argnames=("mode", "penalties"))


def ref_probs(logits, p: SamplingParams, banned=()):
    """The final distribution of one row, in float64, written apart from the samplers."""
    x = np.asarray(logits, np.float64).copy()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    if p.allowed_token_ids:
        keep = np.zeros(len(x), bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    x[list(banned)] = -np.inf
    if p.greedy:
        return np.eye(len(x))[np.argmax(x)]
    z = x / p.temperature
    if p.top_k:
        z[np.argsort(-z, kind="stable")[p.top_k:]] = -np.inf
    q = np.exp(z - z.max())
    return q / q.sum()


def logits_for(rows: int, seed: int, vocab: int = V) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 2).astype(np.float32)


def device(logits, params, banned=None, steps=None, seeds=None, processed=False):
    b = len(params)
    t = build_sampling_tensors(params, seeds or list(range(b)), steps or [0] * b,
                               banned or [[] for _ in range(b)], b)
    fn = _processed if processed else _sample
    return np.asarray(fn(jnp.asarray(logits), t, None, None, mode=sampling_mode(params),
                         penalties=False))


def host(logits, params, banned=None, steps=None, seeds=None):
    b = len(params)
    t = build_sampling_tensors(params, seeds or list(range(b)), steps or [0] * b,
                               banned or [[] for _ in range(b)], b)
    sampler = HostSampler(b, threads=2)
    try:
        return sampler.sample(logits, np.arange(b), t, sampling_mode(params), False)
    finally:
        sampler.close()


CASES = [  # (params, banned ids)
    (SamplingParams(temperature=0.8, logit_bias={3: 5.0, 10: -2.5, 96: 0.5}), []),
    (SamplingParams(temperature=1.2, top_k=5, logit_bias={"7": 100}), []),
    (SamplingParams(temperature=0.7, allowed_token_ids=[1, 5, 9, 40, 41, 90]), []),
    (SamplingParams(temperature=1.0, allowed_token_ids=[2, 3, 4], logit_bias={4: 1.5}), [3]),
    (SamplingParams(temperature=0.9), [0, 1, 2, 50]),
    (SamplingParams(temperature=1.1, top_k=3), []),  # a row using none of them
]


def test_processed_distribution_matches_the_reference():
    params = [p for p, _ in CASES]
    banned = [b for _, b in CASES]
    logits = logits_for(len(params), seed=1)
    lp = device(logits, params, banned, processed=True)
    for i, p in enumerate(params):
        ref = ref_probs(logits[i], p, banned[i])
        np.testing.assert_array_equal(np.isfinite(lp[i]), ref > 0, err_msg=f"row {i}")
        np.testing.assert_allclose(np.exp(lp[i]), ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("vocab", [V, 4096])
def test_host_sampler_picks_the_device_samplers_tokens(vocab):
    params = [p for p, _ in CASES for _ in range(3)]
    banned = [b for _, b in CASES for _ in range(3)]
    logits = logits_for(len(params), seed=vocab, vocab=vocab)
    for step in range(5):
        steps = [step] * len(params)
        np.testing.assert_array_equal(host(logits, params, banned, steps),
                                      device(logits, params, banned, steps))


def test_plus_100_bias_makes_a_token_the_argmax_and_minus_100_removes_one():
    logits = logits_for(4, seed=2)
    low = np.argsort(logits, -1)[:, 0]  # each row's least likely token
    top = np.argmax(logits, -1)
    forced = [SamplingParams(temperature=0, logit_bias={int(low[i]): 100}) for i in range(4)]
    removed = [SamplingParams(temperature=0, logit_bias={int(top[i]): -100}) for i in range(4)]
    second = np.argsort(-logits, -1)[:, 1]
    for sampler in (device, host):
        np.testing.assert_array_equal(sampler(logits, forced), low)
        np.testing.assert_array_equal(sampler(logits, removed), second)
    sampled = [SamplingParams(temperature=1.0, logit_bias={int(low[0]): 100})] * 64
    rows = np.repeat(logits[:1], 64, 0)
    assert (device(rows, sampled, seeds=list(range(64))) == low[0]).all()
    lp = device(rows[:1], [SamplingParams(logit_bias={int(top[0]): -100})], processed=True)
    assert lp[0, top[0]] < -90  # still finite: a bias is not a ban


def test_allowed_token_ids_are_the_only_ones_sampled_over_many_seeds():
    allowed = [4, 11, 12, 60, 95]
    n = 256
    logits = np.repeat(logits_for(1, seed=3), n, 0)
    logits[:, allowed] -= 3  # the allowed ids are unlikely without the mask
    seen = set()
    for params in (SamplingParams(temperature=1.5, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, top_k=2, allowed_token_ids=allowed)):
        for step in range(4):
            toks = device(logits, [params] * n, steps=[step] * n, seeds=list(range(n)))
            assert set(toks.tolist()) <= set(allowed)
            np.testing.assert_array_equal(
                host(logits, [params] * n, steps=[step] * n, seeds=list(range(n))), toks)
            seen |= set(toks.tolist())
    assert seen == set(allowed)  # and every allowed id can be drawn
    greedy = SamplingParams(temperature=0, allowed_token_ids=allowed)
    want = allowed[int(np.argmax(logits[0, allowed]))]
    assert device(logits[:2], [greedy, greedy]).tolist() == [want, want]


def test_banned_bad_word_ids_are_never_sampled():
    logits = logits_for(8, seed=4)
    banned = [list(map(int, np.argsort(-row)[:2])) for row in logits]  # each row's top two
    params = [SamplingParams(temperature=0.3)] * 8
    for step in range(10):
        for sampler in (device, host):
            toks = sampler(logits, params, banned, steps=[step] * 8)
            assert not any(t in b for t, b in zip(toks.tolist(), banned, strict=True))


def test_lists_are_packed_in_buckets_and_width_0_when_unused():
    t = build_sampling_tensors([SamplingParams()] * 2, [0, 0], [0, 0], [[], []], 4)
    assert t.bias_ids.shape == t.bias.shape == t.allowed.shape == (4, 0)
    p = SamplingParams(logit_bias={5: 1.5, 9: -2.0}, allowed_token_ids=list(range(9)))
    t = build_sampling_tensors([SamplingParams(), p], [0, 0], [0, 0], [[], []], 4)
    assert t.bias_ids.shape == (4, 8) and t.allowed.shape == (4, 16)
    np.testing.assert_array_equal(t.bias_ids[1, :3], [5, 9, -1])
    np.testing.assert_array_equal(t.bias[1, :2], np.float32([1.5, -2.0]))
    assert (t.bias_ids[[0, 2, 3]] == -1).all() and (t.allowed[0] == -1).all()
    np.testing.assert_array_equal(t.allowed[1, :10], list(range(9)) + [-1])
