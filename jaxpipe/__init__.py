"""jaxpipe: throughput-first LLM inference in JAX.

The public names load on first use (PEP 562), so that importing a module that needs no jax
(`jaxpipe.config_flags`, `jaxpipe.config_checks`, the scheduler) does not load jax."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpipe.config import EngineConfig
    from jaxpipe.engine import Engine
    from jaxpipe.outputs import CompletionOutput, RequestOutput, StreamDelta
    from jaxpipe.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StreamDelta"]
__version__ = "0.1.0"

_HOMES = {"Engine": "jaxpipe.engine", "EngineConfig": "jaxpipe.config",
          "SamplingParams": "jaxpipe.sampling", "RequestOutput": "jaxpipe.outputs",
          "CompletionOutput": "jaxpipe.outputs", "StreamDelta": "jaxpipe.outputs"}


def __getattr__(name: str):
    """Import a public name's module the first time the name is read."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    """The public names (loaded or not) and the module's dunders, not its helpers."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
