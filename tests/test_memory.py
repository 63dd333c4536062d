"""Budgets sized from the machine (jaxpipe/memory.py): explicit settings win, defaults take a
fraction of the free memory after the weights and the activation reserve, and the reserve
bounds what XLA says the largest step needs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpipe import memory
from jaxpipe.config import EngineConfig
from jaxpipe.synthetic_step import padding_inputs

CPU = [SimpleNamespace(platform="cpu")]
GIB = 2**30
BLOCK_BYTES = 16 * 23040  # one block of SmolLM2-135M in bf16


def gpu(limit: int, used: int):
    stats = {"bytes_limit": limit, "bytes_in_use": used}
    return SimpleNamespace(platform="gpu", memory_stats=lambda: stats)


def test_explicit_sizes_win(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 100 * GIB)
    config = EngineConfig(kv_cache_gb=2.0, host_kv_gb=0.5)
    b = memory.plan(config, CPU, GIB, GIB, BLOCK_BYTES)
    b = memory.with_host_tier(b, config, CPU, GIB, GIB)
    assert (b.pool_bytes, b.host_bytes) == (2 * GIB, 0.5 * GIB)
    assert b.pool_setting == "kv_cache_gb=2.0"
    b = memory.plan(EngineConfig(kv_cache_tokens=20, kv_cache_gb=9.0), CPU, 0, 0, BLOCK_BYTES)
    assert b.pool_bytes == 2 * BLOCK_BYTES  # whole blocks; tokens win over GiB


def test_cpu_defaults_take_four_tenths_of_available_ram(monkeypatch):
    """CPU: pool = 0.4 of (MemAvailable - weights - reserve); the host tier 0.1 of what is
    left after the pool and the weights."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 41.5 * GIB)
    b = memory.plan(EngineConfig(), CPU, GIB, GIB // 2, BLOCK_BYTES)
    assert b.pool_bytes == pytest.approx(16 * GIB)
    # the host tier counts the pool the engine really made (capped by max_num_seqs)
    b = memory.with_host_tier(b, EngineConfig(), CPU, 3 * GIB, GIB)
    assert b.host_bytes == pytest.approx(0.1 * (41.5 - 3 - 1) * GIB)
    assert "memory_utilization=0.4 of the 41.5 GiB free (host RAM, MemAvailable)" in \
        b.pool_setting
    b = memory.plan(EngineConfig(memory_utilization=0.5), CPU, GIB, 0, BLOCK_BYTES)
    assert b.pool_bytes == pytest.approx(20.25 * GIB)


def test_accelerator_defaults_take_nine_tenths_of_free_device_memory(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 * GIB)
    devices = [gpu(80 * GIB, 10 * GIB), gpu(80 * GIB, 10 * GIB)]
    b = memory.plan(EngineConfig(), devices, 2 * GIB, GIB, BLOCK_BYTES)
    assert b.pool_bytes == pytest.approx(0.9 * (140 - 3) * GIB)
    b = memory.with_host_tier(b, EngineConfig(), devices, b.pool_bytes, 2 * GIB)
    assert b.host_bytes == pytest.approx(6.4 * GIB)  # the pool is not in host RAM


def test_a_budget_smaller_than_the_weights_is_empty_not_negative(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: GIB)
    assert memory.plan(EngineConfig(), CPU, GIB, GIB, BLOCK_BYTES).pool_bytes == 0


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "half"])
def test_memory_utilization_is_validated(value):
    with pytest.raises(ValueError, match=rf"memory_utilization must be a number in \(0, 1\] "
                                         rf"or None, got {value!r}"):
        EngineConfig(memory_utilization=value)


@pytest.mark.parametrize("packed", [True, False])
def test_activation_reserve_bounds_xla_temporaries_of_the_largest_steps(packed):
    """XLA's own figure (memory_analysis().temp_size_in_bytes) of the default model's step
    programs at 1024 and 4096 tokens is below the reserve the budget subtracts, with the bf16
    kernel's packed weights and with XLA's dots, and not wildly below the latter (the reserve
    is not a blanket; the kernel's steps need less)."""
    from jaxpipe.engine import Engine
    from jaxpipe.kernels import matmul

    if packed and not matmul.paths():
        pytest.skip("the bf16 kernel does not build here")
    engine = Engine(random_weights=True, kv_cache_tokens=4096, max_model_len=256,
                    max_num_seqs=64, warmup=False, show_progress=False,
                    matmul=matmul.paths()[-1] if packed else "xla")
    runner = engine.runner
    try:
        assert bool(runner.placements["prefill"].packed) == packed
        for tokens in (1024, 4096):
            fn = runner._program(0)
            step = padding_inputs(runner, tokens)
            temp = fn.lower(runner.params, runner.cache, step, runner._zeros()).compile(
            ).memory_analysis().temp_size_in_bytes
            reserve = memory.activation_bytes(engine.model_config, tokens, 64)
            assert temp <= reserve, (tokens, temp, reserve)
            if not packed:
                assert reserve < 8 * temp, (tokens, temp, reserve)
    finally:
        engine.close()


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


def test_a_pool_budget_beyond_what_the_sequences_can_use_is_capped_and_leaves_the_host_tier():
    """kv_cache_gb=64 with 8 sequences of 256 tokens: the pool is what they can use, and the
    host tier's default share is computed from that pool, not from the 64 GiB asked."""
    from jaxpipe.engine import Engine

    engine = Engine(random_weights=True, kv_cache_gb=64.0, max_model_len=256, max_num_seqs=8,
                    warmup=False, show_progress=False)
    try:
        assert engine.num_blocks == 8 * 256 // 16
        assert engine.budget.host_bytes > 0
        assert engine.stats()["host_kv_capacity"] > 0
    finally:
        engine.close()
