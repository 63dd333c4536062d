"""The KV pool's storage dtype per platform (bf16 as u16 bits only where XLA's CPU backend
needs it), and that storage round-trips the compute values exactly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels.paged import from_storage, storage_dtype, to_storage


def test_bf16_is_stored_as_u16_bits_on_cpu_only():
    assert storage_dtype(jnp.bfloat16, "cpu") == jnp.uint16
    assert storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert storage_dtype(jnp.float32, "cpu") == storage_dtype(jnp.float32, "gpu") == jnp.float32


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_storage_round_trips_bf16_values(platform):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    cache = jnp.zeros((1,), storage_dtype(jnp.bfloat16, platform))
    back = from_storage(to_storage(x, cache))
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back, np.float32),
                                  np.asarray(x.astype(jnp.bfloat16), np.float32))
