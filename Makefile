# diffuserve — `make serve` and `make test` do their own set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 30010
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit lint bench clean

# Idempotent: creates the venv once; installs torch pinned only when no torch is present (an
# unpinned torch pulls a multi-GB CUDA build; a user's newer CUDA torch is kept as is).
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet -e ".[test,bench]"
	@touch $@

serve: setup
	$(VENV)/bin/diffuserve serve --host $(HOST) --port $(PORT)

test: setup
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: setup
	$(PY) benchmarks/bench_pipeline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
