"""Engines built, used, closed and built again in one process (scripts/rebuild_engines.py):
the first one's memory must come back (`Engine.close()`), so the second fits where the first
did. The process's RSS after each stage and its peak (/proc/self/status).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from jaxpipe.config.checks import check_counts
from jaxpipe_bench.proc_memory import status_bytes

_CPU_MESH = re.compile(r"^cpu-([1-9][0-9]*)$")


@dataclass(frozen=True)
class RebuildConfig:
    """The engines `scripts/rebuild_engines.py` builds in turn (its flags, jaxpipe.config.flags).

    meshes: the engines' meshes, cpu-N presets, one engine each, in order
    requests: greedy requests each engine generates
    max_tokens: tokens each request generates
    """

    meshes: tuple[str, ...] = ("cpu-1", "cpu-8")
    requests: int = 16
    max_tokens: int = 32

    def __post_init__(self):
        check_counts(self, "requests", "max_tokens")
        if not self.meshes or not all(_CPU_MESH.match(m) for m in self.meshes):
            raise ValueError(f"RebuildConfig.meshes must be one or more cpu-N presets, got "
                             f"{list(self.meshes)!r}")

    def devices(self) -> int:
        """The most CPU devices any of the meshes asks for."""
        return max(int(_CPU_MESH.match(m)[1]) for m in self.meshes)


def rss_gib() -> float:
    """This process's resident memory now, GiB."""
    return status_bytes("VmRSS") / 2**30


def peak_gib() -> float:
    """This process's peak resident memory so far, GiB."""
    return status_bytes("VmHWM") / 2**30


def run(config: RebuildConfig, log: Callable[[str], None] = print) -> None:
    """Build, use and close one engine per mesh in turn, logging the RSS after each stage."""
    from jaxpipe.runtime import sharding

    sharding.ensure_cpu_devices(config.devices())  # before anything starts JAX's backend
    from jaxpipe import Engine, SamplingParams

    prompts = [f"Write one sentence about the number {i}." for i in range(config.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
    log(f"{'stage':<28}{'RSS GiB':>9}{'peak GiB':>10}")
    log(_stage("start"))
    for mesh in config.meshes:
        with Engine(mesh=mesh, show_progress=False) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            log(_stage(f"{mesh} built, {tokens} tokens"))
        log(_stage(f"{mesh} closed"))


def _stage(name: str) -> str:
    return f"{name:<28}{rss_gib():>9.2f}{peak_gib():>10.2f}"
