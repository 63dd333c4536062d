"""jaxpipe: throughput-first LLM inference in JAX."""

from jaxpipe.config import EngineConfig
from jaxpipe.engine import Engine
from jaxpipe.outputs import CompletionOutput, RequestOutput, StreamDelta
from jaxpipe.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StreamDelta"]
__version__ = "0.1.0"
