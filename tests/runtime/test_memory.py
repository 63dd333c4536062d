"""Memory as the OS sees it (jaxpipe/runtime/memory.py): a cleared array gives its pages back,
a zeroed one takes none until written, and so an engine's start costs its weights and
activations, not its KV pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import gguf_dir

from jaxpipe.runtime import memory
from jaxpipe_bench.proc_memory import status_bytes

GIB = 2**30


def test_free_bytes_sums_the_accelerators_and_reads_the_host_for_cpu(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 5 * GIB)
    assert memory.free_bytes([SimpleNamespace(platform="cpu")] * 8) == 5 * GIB  # shared RAM
    stats = [{"bytes_limit": 80 * GIB, "bytes_in_use": 10 * GIB}, {"bytes_limit": 40 * GIB}]
    devices = [SimpleNamespace(platform="gpu", memory_stats=lambda s=s: s) for s in stats]
    assert memory.free_bytes(devices) == 110 * GIB
    assert memory.free_bytes([SimpleNamespace(platform="gpu", memory_stats=dict)]) is None


def test_a_cleared_array_reads_as_zeros_and_costs_memory_only_once_written():
    """A written 256 MiB array, cleared, gives its pages back (RSS falls by most of it) and
    reads as zeros, the partial pages at its ends included; a donated in-place write of one
    row takes back about that row only."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jax.block_until_ready(jax.jit(lambda: jnp.full((256, 1024, 512), 9, jnp.uint16))())
    before = status_bytes("VmRSS")
    assert memory.clear(x)
    after = status_bytes("VmRSS")
    assert before - after > 0.8 * x.nbytes
    assert not np.asarray(x[0, 0]).any() and not np.asarray(x[-1, -1]).any()
    write = jax.jit(lambda c: c.at[7].set(3), donate_argnums=0)
    y = jax.block_until_ready(write(x))
    assert status_bytes("VmRSS") - after < 0.1 * y.nbytes  # one row of 256 was committed, not all
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
    before = status_bytes("VmRSS")
    x = memory.zeros((256, 1024, 1024), jnp.uint16, sharding)
    assert status_bytes("VmRSS") - before < 0.05 * x.nbytes
    buffer = x.unsafe_buffer_pointer()
    write = jax.jit(lambda c: c.at[7].set(3), donate_argnums=0)
    y = jax.block_until_ready(write(x))
    assert y.unsafe_buffer_pointer() == buffer and status_bytes("VmRSS") - before < 0.05 * y.nbytes
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


# An engine's start, measured in a child process (cpu-8 sets its device count before JAX
# starts): its peak RSS, the budget it was sized with, and its pool. The peak is the process's
# own high-water mark (VmHWM): ru_maxrss would carry over the parent's from before the exec
# (Linux keeps the larger across execve), so a child of a large test worker would report the
# worker's size.
START = """
import json, sys
from pathlib import Path
from jaxpipe import Engine, SamplingParams
from jaxpipe.kernels import empty
from jaxpipe.runtime import kernel_choice
from jaxpipe_bench.proc_memory import status_bytes

timings = Path(sys.argv[2])  # the kernel timings' file: what it lacks is timed
kernel_choice.cache_path = lambda: timings

def timed():
    return len(json.loads(timings.read_text())["timings"]) if timings.is_file() else 0

before = timed()

def peak():
    return status_bytes("VmHWM")

engine = Engine(**json.loads(sys.argv[1]), warmup=False, show_progress=False)
built = peak()
pool = engine.runner.cache
pointers = [s.data.unsafe_buffer_pointer() for a in pool for s in a.addressable_shards]
engine.generate(["The capital of France is", "Water boils at", "Once upon a time",
                 "def add(a, b):", "E = mc", "Roses are red,"],
                SamplingParams(temperature=0.0, max_tokens=8))
print(json.dumps(dict(
    built=built, generated=peak(), lazy=empty.available(), measured=timed() > before,
    weights=engine.budget.weight_bytes, reserve=engine.budget.reserve_bytes,
    pool=sum(a.nbytes for a in pool), reshards=engine.stats()["reshards"],
    in_place=pointers == [s.data.unsafe_buffer_pointer()
                          for a in engine.runner.cache for s in a.addressable_shards])))
"""
# What the engine takes besides its weights' budget and its activation reserve, from the
# start through six short requests, measured (2-core AMD EPYC, jax 0.10.2, SmolLM2 bf16, pools
# of 2 and 6.5 GiB alike): 0.58 GB on one device (Python, JAX and XLA, the GGUF reader's mapped
# file and its f32 tensors while they are stacked); 1.97 GB on cpu-8 (compiling the layouts'
# SPMD programs, the weights' host copy during the switch). While the pool was written at
# creation (main 06ef788) the three peaked at 4.5 GB (a 6.7 GiB pool), 2.2 GB and 7.3 GB.
# The first engine on a machine also times its kernels (runtime/kernel_choice.py) and peaks
# higher: what the timings compiled stays (in malloc's thread arenas; `KernelChoice._record`
# gives the rest back). On one device, nine first starts (`start()` with a new timings file
# each) peaked at 1.67-1.85 GB (median 1.76) against 1.57-1.63 GB with the timings cached
# (AMD EPYC family 26 model 2, avx512_bf16, 2026-12-02). While the freed timing buffers
# stayed with malloc, first starts peaked at 1.88 and 1.95 GB there and 1.93 GB on CI's
# machine, over the warm bound of 1.88 GB: make test failed whenever this test's child
# happened to be the first on the machine to time the default model. The children keep
# their timings in a file of this module's own, so that which of them measure is fixed: the
# first case (the file new) and cpu-8 (its tp=4 shards' shapes), not the 2 GiB pool's; each
# reports whether it did (`measured`).
MARGIN = {"cpu-1": 0.9e9, "cpu-8": 2.5e9}
FIRST_START = 0.25e9  # what an engine that times its kernels may take on top


@pytest.fixture(scope="module")
def timings(tmp_path_factory):
    """The kernel timings' file the children share: none before the first."""
    return tmp_path_factory.mktemp("kernel_choice") / "timings.json"


def start(timings, **kwargs) -> dict:
    """What `START` reports for an engine of `kwargs` whose kernel timings are cached in the
    file `timings` (measured first where it does not exist)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    gguf_dir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", START, json.dumps(kwargs), str(timings)],
                          text=True, capture_output=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kwargs", [{}, {"kv_cache_gb": 2},
                                    {"mesh": "cpu-8", "prefill": "pp=8", "decode": "tp=4,pp=2"}],
                         ids=["default-pool-first-start", "2gb-pool", "cpu-8-switching"])
def test_an_engine_takes_its_weights_and_activations_not_its_pool(kwargs, timings):
    """A default-sized engine (the pool 0.4 of the free RAM) that times its kernels first,
    as on a new machine, one with a 2 GiB pool that finds them timed, and a cpu-8 one that
    switches layouts (prefill pp=8, decode tp=4,pp=2): the peak RSS, after construction and
    after six short requests, stays within the weights, the activation reserve and a fixed
    margin (`FIRST_START` more where it timed kernels), whatever the pool's size; the steps
    write the pool in place."""
    got = start(timings, **kwargs)
    if not got["lazy"]:
        pytest.skip("no C++ compiler: the pool's zeros are written, then cleared")
    bound = (got["weights"] + got["reserve"] + MARGIN[kwargs.get("mesh", "cpu-1")]
             + FIRST_START * got["measured"])
    assert got["built"] <= bound and got["generated"] <= bound, (got, bound)
    if "mesh" in kwargs:
        assert got["reshards"] == 1
    else:
        assert got["in_place"], got
