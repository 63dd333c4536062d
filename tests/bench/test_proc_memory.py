"""/proc/self/status's memory fields (jaxpipe_bench/proc_memory.py), read against an
allocation of known size and against each other."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpipe_bench.proc_memory import status_bytes


def test_the_resident_set_grows_by_a_written_array_and_the_peak_holds_it():
    before = status_bytes("VmRSS")
    a = np.ones(64 * 2**20, np.uint8)  # 64 MiB, every page written
    grown = status_bytes("VmRSS") - before
    assert 0.9 * a.nbytes < grown < 1.5 * a.nbytes
    assert status_bytes("VmHWM") >= status_bytes("VmRSS") >= status_bytes("RssAnon") > a.nbytes


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(KeyError, match="VmNope"):
        status_bytes("VmNope")
