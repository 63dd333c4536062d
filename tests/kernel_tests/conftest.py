"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from jaxpipe.kernels import gguf_matmul as gm
from jaxpipe.kernels import int8_matmul as im
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


@pytest.fixture(params=im.PATHS)
def int8_path(request) -> str:
    """Each int8 matmul kernel path in turn; one this machine's build lacks is skipped with the
    reason (amx_int8 is compiled only for a CPU with amx_int8)."""
    if request.param not in im.paths():
        why = ("this CPU has no amx_int8 (or the OS refused the tile state)"
               if request.param == "amx_int8" else "this CPU's build lacks it")
        pytest.skip(f"no {request.param} int8 path here: {why}; its build has "
                    f"{', '.join(im.paths()) or 'no kernel'}")
    return request.param


@pytest.fixture(params=gm.PATHS)
def gguf_path(request) -> str:
    """Each GGUF block kernel path in turn; one this machine's build lacks is skipped with the
    reason."""
    if request.param not in gm.paths():
        pytest.skip(f"no {request.param} GGUF path here: this CPU's build has "
                    f"{', '.join(gm.paths()) or 'no kernel'}")
    return request.param
