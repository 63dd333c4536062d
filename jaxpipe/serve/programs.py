"""Where the engine process's compiled programs came from: compiled in the process, or loaded
from JAX's persistent compilation cache (`EngineConfig.compilation_cache_dir`).

The two are not the same in memory. XLA:CPU keeps, beside each program loaded from the cache,
its whole HLO module as a proto (`CpuAotCompilationResult::LoadExecutable` stores it for
`GetCompiledMemoryStats`), which a program compiled in the process does not keep. SmolLM2's 42
programs (max_model_len 512, max_num_seqs 32; a step program is ~3,900 HLO instructions, the
30 layers unrolled) hold 127 MB of those protos: an engine built from the cache holds 1,121 MB
of heap where the same engine compiling its programs holds 994 MB (2-core AMD EPYC, jax
0.10.2, memray's native traces). So a server's first engine on a cold cache is smaller than
each engine restarted after it, which loads what the first compiled; on a warm cache every
engine loads, and they are alike. The front end logs the counts when an engine is ready, and
/metrics carries them (`jaxpipe_programs{source}`).
"""

from __future__ import annotations

import threading

# jax.monitoring events: every program asked of the compiler (a compile or a cache load), and
# each of those the persistent cache answered.
REQUESTED = "/jax/core/compile/backend_compile_duration"
LOADED = "/jax/compilation_cache/cache_hits"


class Programs:
    """Counts this process's compiled programs by origin, from the moment it is made."""

    def __init__(self):
        # lazy: only the engine process counts (jax); the front ends import serve jax-free
        import jax

        self._requested = self._loaded = 0
        self._lock = threading.Lock()  # programs compile on any thread
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def counts(self) -> dict[str, int]:
        """{"compiled": programs compiled here, "loaded": loaded from the persistent cache}."""
        with self._lock:
            return {"compiled": max(self._requested - self._loaded, 0), "loaded": self._loaded}

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == REQUESTED:
            with self._lock:
                self._requested += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == LOADED:
            with self._lock:
                self._loaded += 1
