# One image, three entry points: mtc-csi (the CSI node plugin, run as root by the DaemonSet),
# mtc-replicator (the per-node daemon, run as the non-root user below) and mtc-controller
# (the CheckpointConfiguration controller's Deployment, non-root too).
#   docker build -t REGISTRY/mtc-replicator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# --- builder: a self-contained virtualenv: the package, its daemon, s3/gcs, controller extras
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/mtc
COPY . /src
# Every dependency ships manylinux wheels, so no compiler is needed even here. A regular
# (non-editable) install: the final stage copies /opt/mtc alone, not /src.
RUN /opt/mtc/bin/pip install "/src[daemon,s3,gcs,controller]"

# --- final: the venv, util-linux for mounts, nothing to build with ------------------------
FROM ${PYTHON_IMAGE}
# mount/umount (package mount) and mountpoint (util-linux): the plugin mounts the RAM disk
# and binds it into pods; the DaemonSet's startup probe runs mountpoint.
RUN apt-get update \
    && apt-get install -y --no-install-recommends mount util-linux \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 65532 mtc \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mtc
COPY --from=builder /opt/mtc /opt/mtc
COPY LICENSE NOTICE /usr/share/doc/mtc-replicator/
LABEL org.opencontainers.image.title="mtc-replicator" \
      org.opencontainers.image.description="Node-local multi-tier checkpoint replicator and its CSI plugin" \
      org.opencontainers.image.licenses="Apache-2.0"
# Bytecode was compiled at install time; the root filesystem is read-only at run time.
ENV PATH=/opt/mtc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
CMD ["mtc-replicator"]
