"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from jaxpipe.kernels import matmul as mm


@pytest.fixture(params=mm.PATHS)
def path(request) -> str:
    """Each bf16 matmul kernel path in turn; one this machine's build lacks is skipped with the
    reason."""
    if request.param not in mm.paths():
        pytest.skip(f"no {request.param} path here: this CPU's build has "
                    f"{', '.join(mm.paths())}")
    return request.param
