# diffuserve — `make serve` and `make test` do their own set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 30010
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit test-container lint bench clean image image-cpu

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

# The container image built and served for real (tests/container; needs root and podman, which .ci/run installs).
# Opt-in: the default run leaves it out (-m "not container" in pyproject.toml). Exit 5 (no test selected) means the
# marker or the folder moved: a failure, never a silent pass.
test-container: setup
	@$(VENV)/bin/pytest -q -m container tests/container $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test-container: no test selected by -m container in tests/container" >&2; rc=1; fi; \
	  exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: setup
	$(PY) benchmarks/bench_pipeline.py

# Container images (Containerfile; docs/deployment.md#container-image). Docker when its daemon answers, else Podman
# (a docker client with no daemon is common); CONTAINER_TOOL=podman to choose.
# Podman builds in Docker's format (OCI drops HEALTHCHECK) and with chroot isolation, which works where its OCI
# runtime cannot make cgroups (CI machines, nested containers): PODMAN_BUILD_FLAGS= to change that.
CONTAINER_TOOL ?= $(shell docker info >/dev/null 2>&1 && echo docker || { command -v podman >/dev/null 2>&1 && echo podman; } || echo docker)
IMAGE ?= diffuserve
IMAGE_TAG ?= latest
BASE_IMAGE ?=
CPU_BASE_IMAGE ?= python:3.11-slim-bookworm
TORCH_WHEEL ?=
TORCH_INDEX_URL ?=
PODMAN_BUILD_FLAGS ?= --format docker --isolation chroot
BUILD = $(CONTAINER_TOOL) build -f Containerfile $(if $(filter podman,$(notdir $(CONTAINER_TOOL))),$(PODMAN_BUILD_FLAGS))
SIZE = $(CONTAINER_TOOL) image inspect --format '{{.Size}}'

# The CUDA variant: BASE_IMAGE (default: the Containerfile's PyTorch CUDA runtime image) and its torch.
image:
	$(BUILD) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE):$(IMAGE_TAG) .
	@echo "$(IMAGE):$(IMAGE_TAG): $$($(SIZE) $(IMAGE):$(IMAGE_TAG) | awk '{printf "%.0f", $$1 / 1e6}') MB"

# The CPU variant, tagged $(IMAGE):cpu: a CPU torch from TORCH_WHEEL (a wheel file, staged into the build context)
# or from TORCH_INDEX_URL (default: PyTorch's CPU index), on a base without torch.
image-cpu:
	$(if $(TORCH_WHEEL),rm -f deploy/container/wheels/torch-*.whl && cp $(TORCH_WHEEL) deploy/container/wheels/)
	$(BUILD) --build-arg BASE_IMAGE=$(or $(BASE_IMAGE),$(CPU_BASE_IMAGE)) \
	  $(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) -t $(IMAGE):cpu .
	@echo "$(IMAGE):cpu: $$($(SIZE) $(IMAGE):cpu | awk '{printf "%.0f", $$1 / 1e6}') MB"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
