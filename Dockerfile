# The image every process of the cluster runs: the gateway (the default command) and, with another
# command, the workers (deploy/kubernetes/). Installs exactly what requirements.lock pins.
#
#   docker build -t inference-cluster:0.1.0 .                      # CPU build of torch (as pinned)
#   docker build -t inference-cluster:0.1.0-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 --build-arg CPU_KERNELS=0 .
#
# TORCH_INDEX_URL is where torch comes from: the lock pins torch==2.13.0, and that index's local
# variant (2.13.0+cpu, 2.13.0+cu128, ...) wins over PyPI's, so the same lock gives a CPU or a CUDA
# image. The CUDA variant must be one PyTorch publishes for 2.13.0 and the nodes' driver supports.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# 1: install g++ so a worker on the CPU compiles the project's C++ kernels on first use (-march=native,
# so they are built on the node that runs them, never here). 0: leave it out (GPU workers, the
# gateway); a CPU worker then runs the pure-torch paths.
ARG CPU_KERNELS=1

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

RUN if [ "$CPU_KERNELS" = "1" ]; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /app

# Dependencies first, in their own layer: it is rebuilt only when the lock changes.
COPY requirements.lock ./
RUN pip install --extra-index-url "$TORCH_INDEX_URL" -r requirements.lock

# The project itself (what .dockerignore leaves), installed in place as `make` does.
COPY . .
RUN pip install --no-deps -e . \
    && python -m compileall -q protos shared gateway worker tools

# A numeric non-root user, so Kubernetes' runAsNonRoot can check it. /app stays root's and read-only
# to it; caches (compiled kernels, calibrations) go to its home, the run dir under /tmp.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin app
USER 10001:10001

# gRPC API, OpenAI HTTP API, Prometheus metrics, the worker port (tcp://, CURVE).
EXPOSE 50051 8080 8000 5555

# The gateway alone on the default config with the project's own model (models/default): it starts no
# worker. A deployment passes each container its command, config, keys and flags (docs/deployment.md,
# deploy/kubernetes); the gateway then binds 0.0.0.0.
CMD ["python", "-m", "gateway", "--config", "configs/default.toml"]
