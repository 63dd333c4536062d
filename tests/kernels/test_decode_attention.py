"""The C++ decode attention kernel against a NumPy reference and against the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import decode_attention as da
from jaxpipe.kv.device_cache import to_storage

pytestmark = pytest.mark.skipif(not da.available(), reason="kernel cannot be built here")

# Prime-ish sizes so that a swapped axis fails loudly; N > B: the cache has idle slots.
B, H, HKV, S, D, N = 7, 6, 2, 37, 16, 9
LENGTHS = [1, 37, 0, 5, 20, 36, 2]  # includes an idle row (0) and a full row (S)


def numpy_attention(q, k, v, lengths):
    """Textbook softmax(q·kᵀ/√D)·v per row over its first `length` positions, in float64."""
    b, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((b, h, d))
    for r in range(b):
        n = lengths[r]
        for head in range(h if n else 0):
            keys, vals = k[r, head // g, :n], v[r, head // g, :n]
            s = keys @ q[r, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[r, head] = (p / p.sum()) @ vals
    return out


def inputs(dtype, seed=0, head_dim=D):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, head_dim)).astype(np.float32)
    k = rng.normal(size=(N, HKV, S, head_dim)).astype(np.float32)
    v = rng.normal(size=(N, HKV, S, head_dim)).astype(np.float32)
    store = jnp.zeros((1,), jnp.uint16 if dtype == "bfloat16" else jnp.float32)
    return jnp.asarray(q), to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)


@pytest.mark.parametrize("head_dim", [D, 64])  # 64: the compile-time specialised path
def test_f32_matches_numpy(head_dim):
    q, k, v = inputs("float32", head_dim=head_dim)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    got = np.asarray(jax.jit(da.decode_attention)(q, k, v, lengths))
    want = numpy_attention(*(np.asarray(a, np.float64) for a in (q, k, v)), LENGTHS)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_idle_rows_are_zero_and_other_rows_ignore_them():
    q, k, v = inputs("float32")
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    got = np.asarray(da.decode_attention(q, k, v, lengths))
    assert not got[2].any()
    # Changing keys beyond a row's length, or another row's keys, changes nothing.
    k2 = k.at[0, :, 1:].set(100.0).at[3].set(-5.0)
    again = np.asarray(da.decode_attention(q, k2, v, lengths))
    np.testing.assert_array_equal(np.delete(got, 3, 0), np.delete(again, 3, 0))


def test_bf16_cache_matches_the_xla_path():
    q, k, v = inputs("bfloat16", seed=1)
    assert k.dtype == jnp.uint16
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    got = np.asarray(jax.jit(da.decode_attention)(q, k, v, lengths))
    want = np.asarray(da.reference(q, k, v, lengths))
    # Same roundings (q and probabilities to bf16), different summation order.
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_rows_fewer_than_cache_slots_and_jit_with_cache_update():
    q, k, v = inputs("float32", seed=2)
    lengths = jnp.asarray(LENGTHS, jnp.int32)

    @jax.jit
    def write_then_attend(k, v):  # the kernel must see the write made earlier in the program
        k = k.at[:, :, 0].set(0.0)
        return da.decode_attention(q, k, v, lengths)

    got = np.asarray(write_then_attend(k, v))
    k0 = np.asarray(k).copy()
    k0[:, :, 0] = 0.0
    want = numpy_attention(np.asarray(q, np.float64), k0.astype(np.float64),
                           np.asarray(v, np.float64), LENGTHS)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
