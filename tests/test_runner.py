"""Which attention the runner's step takes for `EngineConfig.attention` on each backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpipe.kernels import ragged_attention
from jaxpipe.runner import attention_impl

CPU, GPU = [SimpleNamespace(platform="cpu")], [SimpleNamespace(platform="gpu")]


def test_auto_is_pallas_on_gpu_and_the_cpp_kernels_on_cpu():
    assert attention_impl("auto", GPU) == "pallas"
    assert attention_impl("auto", CPU) == ("cpu" if ragged_attention.available() else "xla")
    assert attention_impl("xla", GPU) == attention_impl("xla", CPU) == "xla"
    assert attention_impl("pallas-interpret", CPU) == "pallas-interpret"


def test_kernels_off_their_backend_are_refused_by_name():
    with pytest.raises(ValueError, match="attention='pallas' needs a GPU.*cpu"):
        attention_impl("pallas", CPU)
    with pytest.raises(ValueError, match="attention='kernel' is the C\\+\\+ CPU kernel.*gpu"):
        attention_impl("kernel", GPU)
