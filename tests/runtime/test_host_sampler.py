"""The host sampler (NumPy, worker threads) chooses the device sampler's tokens: every mode,
the large-vocabulary fallbacks, penalties kept incrementally per slot, banned ids; and its
token logprob is the device's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.request.params import SamplingParams
from jaxpipe.runtime.host_sampler import HostSampler, host_logprobs
from jaxpipe.runtime.sampling import (
    build_sampling_tensors,
    compute_logprobs,
    sample,
    sampling_mode,
    uses_penalties,
)

_sample = jax.jit(sample, static_argnames=("mode", "penalties"))

CASES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=5),
    SamplingParams(temperature=1.1, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.001),
    SamplingParams(temperature=0.9, top_k=300),  # k above the candidate count
    SamplingParams(temperature=1.2, top_p=0.97),  # nucleus above the candidates on flat rows
]
PENALISED = [
    SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.6),
    SamplingParams(temperature=0.9, repetition_penalty=0.8, presence_penalty=1.0, top_k=30),
    SamplingParams(temperature=1.0, frequency_penalty=-0.7, presence_penalty=-1.5, top_p=0.9),
]


def device_tokens(logits, params, seeds, steps, banned, prompts=None, outputs=None):
    b, v = logits.shape
    t = build_sampling_tensors(params, seeds, steps, banned, b)
    penalties = uses_penalties(params)
    pm = oc = None
    if penalties:
        pm, oc = np.zeros((b, v), bool), np.zeros((b, v), np.int32)
        for i in range(b):
            pm[i, prompts[i]] = True
            np.add.at(oc[i], outputs[i], 1)
    return np.asarray(_sample(jnp.asarray(logits), t, pm, oc, mode=sampling_mode(params),
                              penalties=penalties))


def host_tokens(sampler, logits, params, seeds, steps, banned):
    t = build_sampling_tensors(params, seeds, steps, banned, len(params))
    return sampler.sample(logits, np.arange(len(params)), t, sampling_mode(params),
                          uses_penalties(params))


def logits_for(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[1::2] *= 6  # flat and peaked rows
    return x


@pytest.mark.parametrize("vocab", [97, 4096, 10007])  # 10007: padded to whole blocks
def test_same_tokens_as_the_device_sampler(vocab):
    params = [p for p in CASES for _ in range(4)]
    logits = logits_for(len(params), vocab, seed=vocab)
    n = len(params)
    banned = [[int(np.argmax(logits[i]))] if i % 3 == 0 else [] for i in range(n)]
    seeds, steps = list(range(n)), [i % 5 for i in range(n)]
    sampler = HostSampler(n, threads=3)
    try:
        got = host_tokens(sampler, logits, params, seeds, steps, banned)
    finally:
        sampler.close()
    want = device_tokens(logits, params, seeds, steps, banned)
    np.testing.assert_array_equal(got, want)
    assert all(got[i] != banned[i][0] for i in range(n) if banned[i])


def test_penalties_follow_each_sampled_token():
    """Several steps of the same slots: the host's per-slot counts, updated with each token it
    sampled, give the tokens the device gives from dense counts of the same history."""
    vocab, n = 512, 6
    params = [PENALISED[i % len(PENALISED)] for i in range(n)]
    rng = np.random.default_rng(0)
    prompts = [list(rng.choice(vocab, 20, replace=False)) for _ in range(n)]
    outputs = [list(rng.integers(0, vocab, 3)) for _ in range(n)]
    sampler = HostSampler(n, threads=2)
    try:
        for slot in range(n):
            sampler.restore(slot, prompts[slot], outputs[slot])
        for step in range(6):
            logits = logits_for(n, vocab, seed=100 + step) * 0.5
            steps = [len(o) for o in outputs]
            want = device_tokens(logits, params, list(range(n)), steps, [[]] * n, prompts,
                                 outputs)
            got = host_tokens(sampler, logits, params, list(range(n)), steps, [[]] * n)
            np.testing.assert_array_equal(got, want)
            for o, token in zip(outputs, got, strict=True):
                o.append(int(token))
    finally:
        sampler.close()
    assert any(len(set(o)) < len(o) for o in outputs)  # repeats happened: counts above 1


def test_token_logprob_is_the_devices():
    logits = logits_for(5, 300, seed=7)
    tokens = np.array([3, 17, 0, 299, 150], np.int32)
    want, _, _ = compute_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 0)
    lse = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    np.testing.assert_array_equal(host_logprobs(logits, tokens, lse), np.asarray(want))


def test_thread_count_is_checked():
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        HostSampler(4, threads=0)
