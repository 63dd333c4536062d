"""The two pipeline designs of `jaxpipe_bench/mpmd.py` compute the same activations: the
engine's SPMD tick program and per-stage MPMD programs with `device_put` between them, on the
tiny prime-sized model (padded: identity layers, padded heads), for micro-batches of
different sizes flowing through pp=4,tp=2 (tp inside each stage; 5 layers padded to 8),
each against one device's run of every layer (pp=1: one stage, the same
`pipeline.stage_layers`). One layout only: mpmd compiles pp programs per size (about a second
each here); scripts/bench_mpmd.py checks pp=8's agreement on every run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY

from jaxpipe.config.layout import Layout
from jaxpipe_bench import mpmd

# Sizes 3 and 5 alternating: spmd pads every slot to 5 tokens, mpmd runs each as it is.
WORK = mpmd.Workload((3, 5), context=21, vocab=TINY.vocab_size)
TICKS = 10


def hiddens(design, pp: int) -> dict[int, np.ndarray]:
    return mpmd.leaving(WORK, pp, mpmd.run_ticks(design, 0, TICKS))


@pytest.fixture(scope="module")
def one_device(tiny_values) -> dict[int, np.ndarray]:
    return hiddens(mpmd.build(TINY, tiny_values, Layout(), WORK)["spmd"], 1)


def test_spmd_ticks_and_the_mpmd_chain_give_one_devices_activations(tiny_values, one_device):
    parsed = Layout.parse("pp=4,tp=2")
    designs = mpmd.build(TINY, tiny_values, parsed, WORK)
    got = {name: hiddens(d, parsed.pp) for name, d in designs.items()}
    left = list(range(TICKS - parsed.pp + 1))  # the micro-batches that left the last stage
    for name, out in got.items():
        assert sorted(out) == left, name
        for k in left:
            assert out[k].shape == (WORK.size(k), TINY.hidden_size)
            np.testing.assert_allclose(out[k], one_device[k], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} micro-batch {k}")
    # Not trivially equal: the two sizes' micro-batches (their own inputs) differ.
    assert not np.allclose(got["mpmd"][0], got["mpmd"][1][:3], atol=1e-2)
