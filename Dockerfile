# syntax=docker/dockerfile:1
#
# One image, two entry points: the console scripts `singleton-operator` and
# `singleton-sidecar` (on PATH from the venv /opt/singleton). There is no ENTRYPOINT, and no
# CMD of its own (the base's, `python3`, is inherited): the chart sets the operator's
# `command` and the operator sets the injected sidecar's.
#
#   make docker-build        # docker build -t ghcr.io/singleton-dev/singleton:0.1.0 . (needs a Docker engine)
#   make image               # without an engine or a registry: buildah, on a local stand-in
#                            # for the base (singleton_testbed.images), to an OCI archive
#
# Base images are pinned by tag. Pin them by digest as well for releases
# (python:3.11-slim-bookworm@sha256:...): the digest could not be resolved where this file
# was written (no registry access), so none is given here rather than a made-up one.
# Runtime dependencies are pinned exactly in requirements.lock and installed from wheels
# only (no compilers in either stage).
#
# Read-only root filesystem: nothing is written at run time except below /tmp (mount an
# emptyDir there, as the chart does); bytecode is compiled at build time and
# PYTHONDONTWRITEBYTECODE stops Python from trying to write more.

# --- builder: a venv with the pinned dependencies and the package ----------------------
FROM python:3.11-slim-bookworm AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/singleton

WORKDIR /src
COPY requirements.lock ./
RUN /opt/singleton/bin/pip install --only-binary=:all: --no-deps --requirement requirements.lock

# LICENSE: both projects' license-files (sdk/LICENSE is a link to it); the wheels carry it.
COPY pyproject.toml README.md LICENSE ./
COPY election/ election/
COPY sidecar/ sidecar/
COPY operator/ operator/
# The application SDK, a distribution of its own (sdk/pyproject.toml): the sample poller the
# image ships is one of its apps.
COPY sdk/ sdk/
# A regular (non-editable) install; then prove the set is complete, compile the bytecode
# once (the runtime filesystem is read-only) and drop pip and setuptools from the venv.
# All of it, forced (-f), as unchecked hashes: the timestamp-based bytecode pip wrote for the
# dependencies records whole seconds of the sources' times, which a layer may round up
# (buildah does), leaving it stale, so Python would compile at every start.
# Two levels (one file where both are the same): plain, and -OO's (no docstrings, no asserts)
# for the sidecar, whose console script gets `-OO` on its #! line: the docstrings are 1 MB of a
# sidecar's ~30 MB at rest, and nothing in it reads them (its --help is a constant; its asserts
# only narrow types). The exec gate's keeper and the apps a sidecar starts run without it (a
# flag is not inherited).
RUN /opt/singleton/bin/pip install --no-deps --no-compile ./sdk . \
 && /opt/singleton/bin/pip check \
 && /opt/singleton/bin/pip uninstall --yes pip setuptools \
 && /opt/singleton/bin/python -m compileall -f -q -o 0 -o 2 --hardlink-dupes --invalidation-mode unchecked-hash /opt/singleton/lib \
 && sed -i '1s|^#!\(/[^ ]*/python[0-9.]*\)$|#!\1 -OO|' /opt/singleton/bin/singleton-sidecar \
 && head -n 1 /opt/singleton/bin/singleton-sidecar | grep -qx '#!/opt/singleton/bin/python[0-9.]* -OO' \
 && /opt/singleton/bin/python -c "import singleton_election, singleton_sidecar, singleton_operator, singleton_sdk" \
 && test -x /opt/singleton/bin/singleton-operator \
 && test -x /opt/singleton/bin/singleton-sidecar

# --- runtime: only the venv on the slim base ---------------------------------------------
FROM python:3.11-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="singleton" \
      org.opencontainers.image.description="Make any Kubernetes workload a safe singleton: the singleton-operator and the singleton-sidecar in one image." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/singleton-dev/singleton" \
      org.opencontainers.image.url="https://github.com/singleton-dev/singleton" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="singleton-dev" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"

# The non-root user 10001 (the chart's runAsUser); the base image's own pip and setuptools
# are removed too: nothing installs packages at run time.
# The standard library's bytecode, compiled here at both levels (see the builder): the official
# base ships none (it deletes every .pyc), and on the read-only root Python would compile each
# module it imports at every start.
RUN groupadd --system --gid 10001 singleton \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin singleton \
 && python -m pip uninstall --yes --no-cache-dir pip setuptools wheel \
 && python -m compileall -f -q -j 0 -o 0 -o 2 --hardlink-dupes --invalidation-mode unchecked-hash \
      -x '/(test|tests|idlelib|tkinter|turtledemo|lib2to3|ensurepip)/' \
      "$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" \
 && rm -rf /root/.cache /tmp/*

COPY --from=builder /opt/singleton /opt/singleton

ENV PATH=/opt/singleton/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TMPDIR=/tmp

WORKDIR /tmp
USER 10001:10001

# Kubernetes probes the processes (the chart's /healthz and /readyz, the sidecar's /livez
# and /readyz), so the image declares no health check of its own.
HEALTHCHECK NONE
