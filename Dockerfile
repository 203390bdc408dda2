# One image for every role: `server` (controller) or `agent` (node agent).
#
#   docker build -t relaunch .                              # CPU torch (the default)
#   docker build -t relaunch:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# torch's version comes from constraints.txt, the one place it is pinned; the
# build argument only picks the wheel index (CPU or a CUDA flavour). CUDA wheels
# carry their own CUDA runtime: the host needs only the NVIDIA driver and the
# container toolkit (`docker run --gpus all`).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/relaunch
WORKDIR /src
COPY constraints.txt pyproject.toml README.md alembic.ini ./
COPY contract ./contract
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
RUN /opt/relaunch/bin/pip install --index-url "${TORCH_INDEX_URL}" \
        "$(grep -E '^torch==' constraints.txt)" \
 && /opt/relaunch/bin/pip install -c constraints.txt . \
 && /opt/relaunch/bin/python -c "import torch, service.cli, worker.agent"

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/relaunch relaunch \
 && install -d -o relaunch -g relaunch /snapshots
COPY --from=build /opt/relaunch /opt/relaunch
ENV PATH=/opt/relaunch/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RELAUNCH_DATA_DIR=/var/lib/relaunch \
    RELAUNCH_SNAPSHOT_ROOT=/snapshots
USER relaunch
WORKDIR /var/lib/relaunch
# The API (which also serves the rendezvous). Worker ports are chosen at run time;
# keep all but the API on a private network.
EXPOSE 8080
# Controller: /healthz answers. Agent (RELAUNCH_AGENT_CONTROLLER_URL set): its loop turns.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["relaunch", "healthcheck"]
ENTRYPOINT ["relaunch"]
CMD ["server"]
