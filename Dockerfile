# asyncmesh-peer: a volunteer peer daemon on a CUDA GPU.
#
#   docker build -t asyncmesh .
#   docker run --init --gpus all -d --name asyncmesh --restart unless-stopped --stop-timeout 90 \
#       -p 31337:31337 -v asyncmesh-data:/data asyncmesh \
#       join --stage auto --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
#
# See docs/docker.md (ports, the announce address behind NAT, health checks, graceful stops).

# Python 3.11 like the tests; torch comes from PyPI at the version the tests run (constraints.txt pins it): PyPI's Linux
# wheel carries its CUDA libraries, so the host needs only an NVIDIA driver and the NVIDIA Container Toolkit.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ASYNCMESH_HOME=/data \
    ASYNCMESH_METRICS_HOST=0.0.0.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /app

# 1. Dependencies first, from the manifest and the constraints alone, so that editing the source does not re-download
#    them. constraints.txt pins every package to the version the tests run with (CI installs from it too). The
#    Hugging Face extra is in (real runs name a tokenizer and stream a dataset; `export --format hf`); the
#    simulator's plotting extra is left out of the runtime image.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['hf']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 2. The source, installed without touching the dependencies again.
COPY README.md ./
COPY protocol ./protocol
COPY trainer ./trainer
COPY peer ./peer
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import peer.cli, protocol, trainer"

# 3. An unprivileged user owning only the data volume (identity key and checkpoints live in $ASYNCMESH_HOME).
RUN groupadd --gid 10001 peer \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin peer \
    && mkdir -p /data /address \
    && chown 10001:10001 /data /address
USER 10001:10001
VOLUME ["/data"]

# 31337: libp2p (publish it, and announce the public address when behind NAT); 9464: /status and /metrics, bound to
# 0.0.0.0 inside the container (ASYNCMESH_METRICS_HOST) so that a published 9464 can be scraped.
EXPOSE 31337/tcp 9464/tcp

# SIGTERM drains in-flight micro-batches, writes a final checkpoint and withdraws the DHT record: give it time with
# `docker run --stop-timeout 90` / compose `stop_grace_period: 90s` (Docker's default of 10 s cuts the drain short).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
    CMD ["asyncmesh-peer", "status", "--quiet", "--port", "9464"]

ENTRYPOINT ["asyncmesh-peer"]
CMD ["join", "--stage", "auto", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337", "--checkpoint-dir", "/data/checkpoints", \
     "--metrics-port", "9464", "--no-tui"]
