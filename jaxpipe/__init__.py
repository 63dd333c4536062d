"""jaxpipe: throughput-first LLM inference in JAX.

The package is a stack of layers, lowest first; a module imports only from its own layer or
below (`LAYERS`, enforced over every import, function-local ones included, by
tests/test_imports.py):

    config     validated settings: EngineConfig, ModelConfig, layouts, meshes, the cluster
    kernels    attention and matmul kernels (C++ on CPU, Pallas on GPU) and their jnp math
    model      the decoder, MoE, one module per family, loaders per file format, tokenizer
    scheduler  pure Python: the ledger, the policies, the loop shared with the simulator
    planner    cost model, layout choice, the simulator over the real policies
    request    what a caller asks for and gets back: SamplingParams, validation, outputs
    kv         moves KV bytes: the device pool, the host tier, the prefetcher
    runtime    the device side: the runner, its step programs, sharding, samplers, sizing,
               kernel choice, several processes
    engine     Engine, its builder, and the engine core (executor, step builder, output
               processor, stats, timeline)
    process    child processes: the lifeline, a follower's supervisor
    protocol   the gRPC wire protocol (jaxpipe.proto and its generated code)
    batch      JSONL batch jobs (`python -m jaxpipe.batch`)
    serve      gRPC and OpenAI HTTP front ends (`python -m jaxpipe.serve`)

The public names load on first use (PEP 562), so that importing a module that needs no jax
(`jaxpipe.config.flags`, `jaxpipe.config.checks`, the scheduler) does not load jax."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpipe.config.engine import EngineConfig
    from jaxpipe.engine.engine import Engine
    from jaxpipe.request.outputs import CompletionOutput, RequestOutput, StreamDelta
    from jaxpipe.request.params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StreamDelta"]
__version__ = "0.1.0"

# The layers, lowest first (a name per subpackage; the module docstring says what each holds).
# planner and request share a layer, as process and protocol do: neither imports the other.
LAYERS = (("config",), ("kernels",), ("model",), ("scheduler",), ("planner", "request"),
          ("kv",), ("runtime",), ("engine",), ("process", "protocol"), ("batch",), ("serve",))

_HOMES = {"Engine": "jaxpipe.engine.engine", "EngineConfig": "jaxpipe.config.engine",
          "SamplingParams": "jaxpipe.request.params", "RequestOutput": "jaxpipe.request.outputs",
          "CompletionOutput": "jaxpipe.request.outputs", "StreamDelta": "jaxpipe.request.outputs"}


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
