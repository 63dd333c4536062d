"""The head inside a shard_map over tp=4 (vocab split, padded to a multiple of 4): the
embedding and the gathered logits equal the unsplit model's, and every sampler branch equals
`sampling.sample` with the same static mode and penalties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from jax.sharding import PartitionSpec as P

from jaxpipe import sampling, shard_head, sharding
from jaxpipe.layout import Layout
from jaxpipe.model import llama
from jaxpipe.model.llama import HeadParams
from jaxpipe.sampling import SamplingParams

LAYOUT = Layout(tp=4)
ROWS = 5
# One program, every branch.
SAMPLE = jax.jit(lambda logits, t, pm, counts, switch: shard_head.sample(
    logits, t, lambda: (pm, counts), switch, num_top=4))


@pytest.fixture(scope="module")
def head(tiny_values):
    """(unpadded HeadParams, padded HeadParams split over tp=4 on 4 devices, mesh)."""
    plan = sharding.plan_padding(TINY, [LAYOUT])
    mesh = sharding.make_mesh(LAYOUT, jax.devices()[:4])
    padded = jax.device_put(sharding.pad_values(TINY, tiny_values, plan),
                            sharding.param_shardings(TINY, plan, LAYOUT, mesh))
    names = ("embed", "final_norm", "lm_head")
    return (HeadParams(*(jnp.asarray(tiny_values[n]) for n in names)),
            HeadParams(*(padded[n] for n in names)), mesh)


def head_map(mesh, fn):
    decls = llama.param_decls(TINY)
    specs = HeadParams(*(sharding.spec(decls[n].axes, LAYOUT)
                         for n in ("embed", "final_norm", "lm_head")))
    return jax.jit(jax.shard_map(fn, mesh=mesh, check_vma=False, in_specs=(specs, P()),
                                 out_specs=P()))


def test_embedding_and_logits_equal_the_unsplit_head(head):
    full, split, mesh = head
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, ROWS), jnp.int32)
    x = jnp.asarray(rng.standard_normal((ROWS, TINY.hidden_size)), jnp.float32)

    def embed(h, tokens):
        return jax.lax.psum(shard_head.embed_local(h.embed, tokens), "tp")

    def logits(h, x):
        return shard_head.vocab_logits(TINY, h, x, jnp.bool_(True), LAYOUT.tp,
                                       TINY.vocab_size)

    np.testing.assert_array_equal(head_map(mesh, embed)(split, tokens),
                                  llama.embed(full, tokens))
    np.testing.assert_allclose(head_map(mesh, logits)(split, x), llama.logits(TINY, full, x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, penalties", shard_head.SAMPLERS)
def test_every_sampler_branch_is_sampling_sample(mode, penalties):
    rng = np.random.default_rng(1)
    v = TINY.vocab_size
    logits = jnp.asarray(3 * rng.standard_normal((ROWS, v)), jnp.float32)
    params = [SamplingParams(temperature=0.7, top_k=9, top_p=0.8, repetition_penalty=1.2,
                             frequency_penalty=0.3, presence_penalty=0.4),
              SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.0)] * 3
    t = jax.tree.map(jnp.asarray, sampling.build_sampling_tensors(
        params, [5, 6, 7, 8, 9], [3] * ROWS, [[1, 2]] + [[]] * 4, ROWS))
    prompt_mask = jnp.asarray(rng.random((ROWS, v)) < 0.1)
    counts = jnp.asarray(rng.integers(0, 3, (ROWS, v)), jnp.int32)
    switch = shard_head.sampler_switch(mode, penalties, 4)
    got = SAMPLE(logits, t, prompt_mask, counts, switch)
    want = sampling.sample(logits, t, prompt_mask, counts, mode=mode, penalties=penalties)
    np.testing.assert_array_equal(got.tokens, want)
    lp, ids, top = sampling.compute_logprobs(logits, want, 4)
    np.testing.assert_array_equal(got.top_ids, ids)
    np.testing.assert_allclose(got.logprob, lp, rtol=1e-6)
    np.testing.assert_allclose(got.top_logprobs, top, rtol=1e-6)
