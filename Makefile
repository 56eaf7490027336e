# pdserve — `make install` sets up .venv; `make test` is the test command CI runs.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip

LOCK := requirements.lock
# Where pip finds the CPU build of torch when no local wheel folder offers it, e.g.
# make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

.PHONY: install test lint convert up compose-smoke bench-engine bench-kv-tiers proto clean lock check-latest

$(VPY):
	$(PY) -m venv $(VENV)

# Everything at the lock's versions (requirements.lock, from `make lock`): a release anywhere
# in the dependency tree changes nothing here until the lock is regenerated.
# Progress: one `==` line per step, then pip's own lines (Collecting / Downloading /
# Installing; its bars only on a terminal), so a first install is never silent.
install: $(VPY)
	@echo "== [1/5] pip at the lock's version"
	$(PIP) install "$$(grep -E '^pip==' $(LOCK))"
	@echo "== [2/5] torch, the CPU build (the largest download)"
	$(PIP) install -c $(LOCK) $(TORCH_INDEX_URL:%=--extra-index-url %) \
	    "$$(grep -E '^torch==' $(LOCK))"
	@echo "== [3/5] every other package at the lock's version (--no-deps: the lock is whole)"
	$(PIP) install --no-deps -r $(LOCK)
	@echo "== [4/5] pdserve itself (editable; the lock's setuptools builds it)"
	$(PIP) install --no-deps --no-build-isolation -e .
	@echo "== [5/5] convert the default model (once; skipped when cached)"
	$(VPY) -m pdserve.services.cli convert

# Regenerate requirements.lock from pyproject.toml's ranges (the newest releases they admit).
lock: $(VPY)
	$(VPY) scripts/lock.py

# Resolve pyproject's ranges with no lock in a throw-away venv, install, convert the model
# and run a fast smoke set; prints the versions it resolved. See README, "Dependencies".
check-latest:
	scripts/check_latest.sh

test:
	$(VPY) -m pytest -q -p no:cacheprovider tests

lint:
	$(VENV)/bin/ruff check shared kernels services tests benchmarks

convert:
	$(VPY) -m pdserve.services.cli convert

# `make up`: install once (again only when pyproject.toml changes), then run Redis, prefill,
# decode and the gateway locally until Ctrl-C. Flags pass through: make up ARGS="--port 9000".
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(MAKE) install
	@touch $@

up: $(VENV)/.installed
	$(VPY) -m pdserve.services.cli up $(ARGS)

# Builds a local base image, the compose stack, one chat completion, then tears it all down.
compose-smoke:
	scripts/compose_smoke.sh

bench-engine:
	$(VPY) benchmarks/engine_throughput.py

# KV cache tiers (issue 30), docs/benchmarks.md: make bench-kv-tiers ARGS="--vllm-venv /tmp/vllmenv"
bench-kv-tiers:
	$(VPY) benchmarks/kv_tiers.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build

# The proto is compiled at its import path under the namespace (protoc's virtual path
# `pdserve=.`), so the stubs import `pdserve.services.proto.engine_pb2`; then copied back.
proto:
	rm -rf build/proto && mkdir -p build/proto
	$(VPY) -m grpc_tools.protoc --proto_path=pdserve=. --python_out=build/proto \
	    --pyi_out=build/proto --grpc_python_out=build/proto pdserve/services/proto/engine.proto
	cp build/proto/pdserve/services/proto/engine_pb2* services/proto/
