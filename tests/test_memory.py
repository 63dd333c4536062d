"""Memory as the OS sees it (jaxpipe/memory.py): a cleared array gives its pages back, a zeroed
one takes none until written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpipe import memory

GIB = 2**30


def test_free_bytes_sums_the_accelerators_and_reads_the_host_for_cpu(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 5 * GIB)
    assert memory.free_bytes([SimpleNamespace(platform="cpu")] * 8) == 5 * GIB  # shared RAM
    stats = [{"bytes_limit": 80 * GIB, "bytes_in_use": 10 * GIB}, {"bytes_limit": 40 * GIB}]
    devices = [SimpleNamespace(platform="gpu", memory_stats=lambda s=s: s) for s in stats]
    assert memory.free_bytes(devices) == 110 * GIB
    assert memory.free_bytes([SimpleNamespace(platform="gpu", memory_stats=dict)]) is None


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_cleared_array_reads_as_zeros_and_costs_memory_only_once_written():
    """A written 256 MiB array, cleared, gives its pages back (RSS falls by most of it) and
    reads as zeros, the partial pages at its ends included; a donated in-place write of one
    row takes back about that row only."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jax.block_until_ready(jax.jit(lambda: jnp.full((256, 1024, 512), 9, jnp.uint16))())
    before = rss_bytes()
    assert memory.clear(x)
    after = rss_bytes()
    assert before - after > 0.8 * x.nbytes
    assert not np.asarray(x[0, 0]).any() and not np.asarray(x[-1, -1]).any()
    write = jax.jit(lambda c: c.at[7].set(3), donate_argnums=0)
    y = jax.block_until_ready(write(x))
    assert rss_bytes() - after < 0.1 * y.nbytes  # one row of 256 was committed, not all
    assert int(y[7, 0, 0]) == 3 and not np.asarray(y[:7]).any() and not np.asarray(y[8:]).any()


def test_zeros_take_no_memory_until_written_and_a_donated_write_stays_in_place():
    """A 512 MiB `memory.zeros` array costs no RSS, reads as zeros, and a program that takes
    it donated writes one row of it in place (the same buffer, that row's pages only)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe.kernels import empty

    if not empty.available():
        pytest.skip("no C++ compiler: the pool's zeros are written, then cleared")
    sharding = NamedSharding(jax.make_mesh((1,), ("x",)), P())
    before = rss_bytes()
    x = memory.zeros((256, 1024, 1024), jnp.uint16, sharding)
    assert rss_bytes() - before < 0.05 * x.nbytes
    buffer = x.unsafe_buffer_pointer()
    write = jax.jit(lambda c: c.at[7].set(3), donate_argnums=0)
    y = jax.block_until_ready(write(x))
    assert y.unsafe_buffer_pointer() == buffer and rss_bytes() - before < 0.05 * y.nbytes
    assert int(y[7, 0, 0]) == 3 and not np.asarray(y[:7]).any() and not np.asarray(y[8:]).any()


def test_zeros_without_the_allocation_kernel_are_written_then_cleared(monkeypatch):
    """Where `kernels/empty.cc` cannot be built the zeros are XLA's, in the same sharding."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(memory.empty, "available", lambda: False)
    sharding = NamedSharding(jax.make_mesh((1,), ("x",)), P())
    x = memory.zeros((3, 4099), np.int32, sharding)
    assert x.sharding == sharding and x.dtype == np.int32 and not np.asarray(x).any()
