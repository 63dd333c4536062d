"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from jaxpipe.kernels import matmul as mm
from jaxpipe.kernels import ragged_attention as ra


@pytest.fixture(params=mm.PATHS)
def path(request) -> str:
    """Each bf16 matmul kernel path in turn; one this machine's build lacks is skipped with the
    reason."""
    if request.param not in mm.paths():
        pytest.skip(f"no {request.param} path here: this CPU's build has "
                    f"{', '.join(mm.paths())}")
    return request.param


@pytest.fixture(params=ra.PATHS)
def attention_path(request) -> str:
    """Each path of the ragged attention kernel in turn, asked for by name (the kernel runs
    that path or fails: no silent fallback); one this machine's build lacks is skipped with
    the reason."""
    if request.param not in ra.paths():
        pytest.skip(f"no {request.param} attention path here: this CPU's build has "
                    f"{', '.join(ra.paths()) or 'no kernel'}")
    return request.param
