"""The peers' environment and the call into it.

The OpenVINO and HF peers (`jaxpipe_peers`) run in `.venv-peers` beside the checkout's
`.venv`, built from `requirements/peers.lock` the first time a benchmark needs it (or by
`make bench-env`) and rebuilt when the lock or the CPU changes; `JAXPIPE_PEERS_VENV` puts it
elsewhere. A peer is one child process: the benchmark writes a job file (the workload's
token ids and the peer's sweep), the child writes a result file. The child's output goes
straight to this process's terminal, so its progress and errors read as before.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jaxpipe_peers
from jaxpipe_peers.protocol import read_json, write_json

Log = Callable[[str], None]

ROOT = Path(jaxpipe_peers.__file__).resolve().parents[1]  # the checkout holding both packages
LOCK = ROOT / "requirements" / "peers.lock"
_STAMP = ".jaxpipe-peers-lock"  # in the venv: the hashes of the lock and CPU it was built for


def env_dir() -> Path:
    """Where the peers' environment lives: $JAXPIPE_PEERS_VENV, else `.venv-peers` in the
    checkout."""
    return Path(os.environ.get("JAXPIPE_PEERS_VENV") or ROOT / ".venv-peers")


def lock_hash(lock: Path = LOCK) -> str:
    """The lock's part of what the environment's stamp must say for it to be current."""
    if not lock.is_file():
        raise FileNotFoundError(
            f"the peers' lock {lock} is missing: the peers run from a jaxpipe checkout "
            "(requirements/peers.lock; `make lock` writes it)")
    return hashlib.sha256(lock.read_bytes()).hexdigest()


# The CPU flags (/proc/cpuinfo) and the llama.cpp (ggml) build options that name them.
LLAMA_ISA = (("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"),
             ("bmi2", "BMI2"), ("avx_vnni", "AVX_VNNI"), ("avx512f", "AVX512"),
             ("avx512_vbmi", "AVX512_VBMI"), ("avx512_vnni", "AVX512_VNNI"),
             ("avx512_bf16", "AVX512_BF16"))


def llama_cmake_args(flags: set[str]) -> str | None:
    """CMAKE_ARGS for llama-cpp-python's build from source on a CPU with `flags`: None (its
    own -march=native) unless the CPU has AMX. There -march=native compiles ggml's AMX int8
    path, which stopped on an illegal instruction (`tilezero` on an OpenMP thread, with the
    process's AMX permission asked or not) on the 2-core Intel Xeon of family 6 model 207
    (llama-cpp-python 0.3.36); so the build names the CPU's other extensions and leaves AMX
    out, and llama.cpp runs its AVX-512 VNNI paths."""
    if not {"amx_tile", "amx_int8", "amx_bf16"} & flags:
        return None
    return " ".join(["-DGGML_NATIVE=OFF",
                     *(f"-DGGML_{name}=ON" for flag, name in LLAMA_ISA if flag in flags),
                     "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def cpu_key(flags: set[str]) -> str:
    """A short hash of a CPU's feature flags: llama.cpp is compiled for the CPU it is built
    on, so an environment built on another CPU (a checkout shared between machines) is
    rebuilt rather than run into an illegal instruction."""
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]


def llama_pin(lock: Path) -> str | None:
    """The lock's `llama-cpp-python==X` line, if it has one."""
    for line in lock.read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split()[0]
    return None


def ensure_env(log: Log = print, venv: Path | None = None, lock: Path = LOCK,
               flags: set[str] | None = None) -> Path:
    """The peers' Python, building (or rebuilding, when the lock or the CPU changed) its
    environment first: `python -m venv`, then `pip install -r` the lock (a few minutes,
    once; llama.cpp built from source for this CPU, `flags`: /proc/cpuinfo's,
    `build.cpu_flags`, `llama_cmake_args`, never a wheel pip cached from a build on
    another CPU or with other options)."""
    venv = venv or env_dir()
    python = venv / "bin" / "python"
    if flags is None:
        from jaxpipe.kernels.build import cpu_flags  # (here: importing it imports jax)

        flags = set(cpu_flags().split())
    want = f"{lock_hash(lock)} cpu {cpu_key(flags)}"
    stamp = venv / _STAMP
    have = stamp.read_text().strip() if python.is_file() and stamp.is_file() else None
    if have == want:
        return python
    why = "the lock changed" if have and have.split()[0] != want.split()[0] else (
        "not built for this CPU" if have else "once")
    log(f"[peers] building the peers' environment in {venv} from {lock.name} ({why}; a few "
        "minutes)")
    if not python.is_file():
        _check([sys.executable, "-m", "venv", str(venv)], "creating the peers' venv")
    env = dict(os.environ)
    cmake = llama_cmake_args(flags)
    if cmake and "CMAKE_ARGS" not in env:
        log(f"[peers] an AMX CPU: llama.cpp is built without its AMX path, CMAKE_ARGS={cmake}")
        env["CMAKE_ARGS"] = cmake
    pin = llama_pin(lock)
    if pin:  # built here, now: pip's wheel cache keys a build by version, not CPU or options
        _check([str(python), "-m", "pip", "install", "-q", "--no-cache-dir", "--force-reinstall",
                "--no-deps", pin], f"building {pin} for this CPU", env)
    _check([str(python), "-m", "pip", "install", "-q", "-r", str(lock)],
           f"installing {lock.name} into {venv}", env)
    stamp.write_text(want + "\n")
    return python


def _check(cmd: list[str], what: str, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}")


def run_peer(job: dict, log: Log = print, python: Path | None = None) -> dict:
    """Run one peer's `job` (`jaxpipe_peers.__main__`) in the peers' environment (or under
    `python`) and return its result."""
    python = python or ensure_env(log)
    with tempfile.TemporaryDirectory(prefix="jaxpipe-peer-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        write_json(job, job_file)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [str(python), "-m", "jaxpipe_peers", str(job_file), str(result_file)]
        log(f"[peers] {job['peer']}: {len(job['requests'])} requests in {python.parent.parent}")
        proc = subprocess.run(cmd, env=env)
        if proc.returncode or not result_file.is_file():
            raise RuntimeError(f"the {job['peer']} peer failed (exit {proc.returncode}); its "
                               "output is above")
        return read_json(result_file)


if __name__ == "__main__":  # `make bench-env`
    print(f"the peers' Python: {ensure_env()}")
