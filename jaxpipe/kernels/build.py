"""Compile the package's C++ CPU kernels once per machine and cache the shared library.

A kernel is built with the system C++ compiler against the XLA FFI headers shipped in jaxlib,
for this CPU (`-march=native`), into `~/.cache/jaxpipe/kernels/` keyed by the source, the
flags, jaxlib's version and the CPU's feature flags, so an edited source, a new jaxlib or a
different machine rebuilds. Processes that need the same library at once (pytest's workers,
a cluster's processes on one machine) take turns on a lock file beside it: the first builds,
the others wait and load its library, rather than each compiling it (1-3 minutes of a core per
kernel on a 2-core Xeon). The library is written to a private temp file and renamed into
place, so a reader never sees half of one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from jaxpipe.config.cache_dir import cache_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared",
         "-fPIC", "-w")
LIBS = ("-lmvec",)  # glibc's vector math (the vectorised expf that -ffast-math selects)


class KernelBuildError(RuntimeError):
    """No compiler, or the compiler failed: callers fall back to the XLA implementation."""



def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX or install g++)")
    return cxx


def build(source: Path) -> Path:
    """The shared library for `source`, compiling it if it is not cached yet."""
    cxx = compiler()
    key = _key(source, cxx)
    target = cache_dir("kernels") / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not target.is_file():  # (another process may have built it while this one waited)
            _compile(cxx, source, target)
    return target


def _compile(cxx: str, source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-I", str(source.parent), str(source),
           "-o", tmp, *LIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling {source.name} failed:\n{' '.join(cmd)}\n"
                               f"{proc.stderr[-2000:]}")
    os.replace(tmp, target)


def _key(source: Path, cxx: str) -> str:
    """What the library depends on: the source, the headers beside it (cpu_kernel.h), the
    compiler, flags, jaxlib (its FFI headers) and this CPU."""
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    for part in (cxx, *FLAGS, *LIBS, jaxlib.__version__, platform.machine(), cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU feature flags line of /proc/cpuinfo (what -march=native builds for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def register(source: Path, symbol: str, target: str, what: str) -> ctypes.CDLL | None:
    """Build `source` (once per machine), register its FFI handler `symbol` as `target` on
    the CPU and return the loaded library; None, with a warning naming `what` falls back to
    XLA, if it cannot be built."""
    if jax.default_backend() != "cpu":
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
    except (KernelBuildError, OSError) as e:
        log.warning("%s unavailable, using XLA: %s", what, e)
        return None
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib
