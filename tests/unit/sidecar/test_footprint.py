"""The sidecar's footprint (issue 15; benchmarks/README.md, "Sidecar footprint"): it loads only
what its configuration needs, and a real sidecar process at rest stays within a memory budget
over the libraries no sidecar can do without.

The budget is counted over what ``import asyncio, h11, singleton_sidecar.metrics,
pythonjsonlogger.json`` (the metrics module loads prometheus_client's metric core, as a sidecar
does; and asyncpg for a PostgreSQL backend) costs a fresh interpreter of this same environment, not
as an absolute figure: the interpreter, the install (editable or not) and the libraries' builds
move the absolute RSS by megabytes, and the sidecar's own share is what a regression here would
grow. No sidecar loads aiohttp (12 MB and 0.4 s of imports; the sidecar's HTTP server and client
are its own, on h11). Measured on the development machine (Python 3.11, 2 CPUs): see
LEASE_BUDGET_MB and POSTGRES_BUDGET_MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from singleton_testbed.harness.kubehelpers import create_pod
from singleton_testbed.harness.sidecars import SidecarProcess, one_leader
from tests.conftest import Cluster

LIBRARIES = ("asyncio", "h11", "singleton_sidecar.metrics", "pythonjsonlogger.json")
"""What every sidecar needs: the event loop, HTTP, the metrics (prometheus_client's metric core,
loaded as ``run`` loads it: see libraries_rss_mb), the JSON log formatter."""
LEASE_BUDGET_MB = 8.0
"""RSS at rest of a lease sidecar over ``LIBRARIES``, reading a kubeconfig file (so with PyYAML,
and tempfile for its inline certificate) and reporting to its pod: measured 6.2 MB without the
sidecar's bytecode compiled (as in a fresh clone on a machine that sets PYTHONDONTWRITEBYTECODE:
compiling leaves more behind; about 0.8 MB less with it), so the budget leaves more than 1 MB for
machines; what it is there to catch is bigger: asyncpg loaded for nothing, as it was before the
backends were imported on demand, is 3.3 MB more, aiohttp 12 MB. (Before the sidecar loaded
prometheus_client's core only, ``LIBRARIES`` held the whole package, with argparse's shutil and
gettext among its imports, and the same sidecars measured 5.1 to 6.1 MB over it.)"""
POSTGRES_BUDGET_MB = 5.0
"""RSS at rest of a PostgreSQL sidecar outside Kubernetes over ``LIBRARIES`` and asyncpg:
measured 2.9 MB compiled, 3.4 to 3.5 MB not (the Kubernetes client, PyYAML and ctypes loaded for
nothing were 1.9 MB more; prometheus_client's whole package 2.9 MB)."""
REST_SECONDS = 5.0

# Builds the backend the way the sidecar does (singleton_sidecar.app.build_backend) from the
# environment's settings, and prints the modules loaded after the sidecar's own imports and
# after the backend's.
BUILD = """
import argparse, json, os, sys
from singleton_sidecar import cli
from singleton_sidecar.config import add_run_arguments, load_config
cli_only = sorted(sys.modules)
from singleton_sidecar.package_parts import without_init
without_init("prometheus_client")  # as `run` does
from singleton_election import logs
from singleton_sidecar import app
parser = argparse.ArgumentParser()
add_run_arguments(parser)
config = load_config(parser.parse_args([]), os.environ)
imported = sorted(sys.modules)
kube = None
if config.backend != "postgres":
    from singleton_election.kube import KubeClient, KubeConfig
    kube = KubeClient(KubeConfig(server="https://127.0.0.1:1", token="unused"))
backend = app.build_backend(config, kube)
print(json.dumps({"cli": cli_only, "imported": imported, "built": sorted(sys.modules), "backend": backend.name}))
"""

PKG, ELECTION = "singleton_sidecar", "singleton_election"
KUBE, LEASE, BOTH = f"{ELECTION}.kube", f"{ELECTION}.backends.lease", f"{ELECTION}.backends.both"
SESSION, POOLED = f"{ELECTION}.backends.postgres.session_mode", f"{ELECTION}.backends.postgres.pooled_mode"
POSTGRES_MODULES = {"asyncpg", f"{ELECTION}.backends.postgres.connection", f"{ELECTION}.backends.postgres.sql"}
NEVER_AT_START = {"asyncpg", "yaml", "ctypes", KUBE, f"{PKG}.podstatus", LEASE, SESSION, POOLED, BOTH}
NEVER = {"aiohttp", "multidict", "yarl"}
"""Loaded by no sidecar, whatever its configuration (the operator's and the SDK's library)."""
NOT_FOR_RUNNING = {"prometheus_client.exposition", "urllib.request", "http.client", "email", "importlib.resources",
                   "tempfile"}
"""Loaded by no running sidecar until something asks for them (4.6 MB in all): prometheus_client's
package, with its HTTP server and push-gateway client (only a scraper that does not accept
OpenMetrics); urllib (only the control commands); importlib.resources (nothing: the package's
files are found beside its modules); tempfile (only the exec gate's folder and a kubeconfig's
inline certificates)."""


def modules_after_build(env: dict[str, str]) -> dict[str, list[str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SINGLETON_")}
    result = subprocess.run([sys.executable, "-c", BUILD], env={**base, **env}, capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, list[str]] = json.loads(result.stdout)
    return loaded


@pytest.mark.parametrize(("backend", "mode", "wanted", "unwanted"), [
    ("lease", "session", {LEASE}, POSTGRES_MODULES | {SESSION, POOLED}),
    ("postgres", "session", POSTGRES_MODULES | {SESSION}, {KUBE, "yaml", LEASE, POOLED}),
    ("postgres", "pooled", POSTGRES_MODULES | {POOLED}, {KUBE, "yaml", LEASE, SESSION}),
    ("both", "session", POSTGRES_MODULES | {SESSION, LEASE, BOTH}, {POOLED}),
])
def test_a_backend_loads_only_its_own_modules(backend: str, mode: str, wanted: set[str], unwanted: set[str]) -> None:
    env = {"SINGLETON_GROUP": "g", "SINGLETON_BACKEND": backend, "SINGLETON_POSTGRES_MODE": mode,
           "SINGLETON_LOCK_KEY": "local/g", "SINGLETON_NAMESPACE": "ns"}
    if backend != "lease":
        env["SINGLETON_POSTGRES_DSN"] = "postgresql://u:p@127.0.0.1:1/db"
    loaded = modules_after_build(env)
    # `singleton-sidecar drain|step-down|status` (a preStop hook's process) needs no server or client.
    servers = {"h11", "asyncpg", "prometheus_client", "yaml"} & set(loaded["cli"])
    assert not servers, f"importing the command loaded {sorted(servers)}"
    early = NEVER_AT_START & set(loaded["imported"])
    assert not early, f"importing the sidecar loaded {sorted(early)} before the configuration asked for it"
    built = set(loaded["built"])
    assert wanted <= built, f"{backend} ({mode}) should have loaded {sorted(wanted - built)}"
    assert not unwanted & built, f"{backend} ({mode}) loaded {sorted(unwanted & built)} for nothing"
    # No configuration loads PyYAML unless a kubeconfig file is read, nor ctypes without the exec gate.
    assert not {"yaml", "ctypes"} & built, sorted({"yaml", "ctypes"} & built)
    assert not NEVER & built, f"{backend} ({mode}) loaded {sorted(NEVER & built)}"
    assert not NOT_FOR_RUNNING & built, f"{backend} ({mode}) loaded {sorted(NOT_FOR_RUNNING & built)}"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def libraries_rss_mb(*extra: str) -> float:
    """RSS of a fresh interpreter of this environment that imported ``LIBRARIES`` and ``extra``."""
    code = ("from singleton_sidecar.package_parts import without_init\nwithout_init('prometheus_client')\n"
            f"import {', '.join((*LIBRARIES, *extra))}\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')))")
    figures = [int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=60).stdout) / 1024 for _ in range(2)]
    return min(figures)


def mapped_files(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}


def at_rest(sidecar: SidecarProcess) -> tuple[float, set[str]]:
    """RSS (MB) and the mapped files of a leading sidecar after ``REST_SECONDS`` of rest, scraped
    by Prometheus once a second meanwhile."""
    one_leader([sidecar], timeout=20)
    for _ in range(int(REST_SECONDS)):
        assert sidecar.scrape()[0].startswith("application/openmetrics-text;")
        time.sleep(1)
    assert sidecar.popen is not None and sidecar.alive()
    return rss_mb(sidecar.popen.pid), mapped_files(sidecar.popen.pid)


def loaded(files: set[str], part: str) -> bool:
    return any(part in f for f in files)


@pytest.fixture
def started() -> Iterator[list[SidecarProcess]]:
    sidecars: list[SidecarProcess] = []
    yield sidecars
    for sidecar in sidecars:
        sidecar.stop()


@pytest.mark.k8s
def test_lease_sidecar_at_rest(cluster: Cluster, namespace: str, started: list[SidecarProcess],
                               tmp_path: Path) -> None:
    group = "fp-" + uuid.uuid4().hex[:8]
    pod = create_pod(cluster, namespace, group)
    env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "lease", "SINGLETON_NAMESPACE": namespace,
           "SINGLETON_POD_NAME": group, "SINGLETON_POD_UID": pod["metadata"]["uid"],
           "KUBECONFIG": str(cluster.kubeconfig)}
    sidecar = SidecarProcess("lease", env, tmp_path / "lease.log", log_format="json")
    started.append(sidecar.start())
    rss, files = at_rest(sidecar)
    libraries = libraries_rss_mb()
    print(f"lease sidecar at rest: {rss:.1f} MB; {', '.join(LIBRARIES)}: {libraries:.1f} MB")
    assert not loaded(files, "/asyncpg/"), "a lease sidecar loaded asyncpg"
    assert not loaded(files, "/aiohttp/"), "a sidecar loaded aiohttp"
    assert rss <= libraries + LEASE_BUDGET_MB, (
        f"lease sidecar at rest: {rss:.1f} MB, over its libraries' {libraries:.1f} MB + {LEASE_BUDGET_MB} MB")


@pytest.mark.postgres
def test_postgres_sidecar_at_rest(pg_dsn: str, started: list[SidecarProcess], tmp_path: Path) -> None:
    group = "fp-" + uuid.uuid4().hex[:8]
    env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": pg_dsn}
    sidecar = SidecarProcess("postgres", env, tmp_path / "postgres.log", log_format="json")
    started.append(sidecar.start())
    rss, files = at_rest(sidecar)
    libraries = libraries_rss_mb("asyncpg")
    print(f"postgres sidecar at rest: {rss:.1f} MB; {', '.join(LIBRARIES)}, asyncpg: {libraries:.1f} MB")
    assert loaded(files, "/asyncpg/protocol/")
    assert not loaded(files, "/_yaml."), "a sidecar outside Kubernetes loaded PyYAML"
    assert not loaded(files, "/_ctypes."), "a sidecar without the exec gate loaded ctypes"
    assert not loaded(files, "/aiohttp/"), "a sidecar loaded aiohttp"
    assert rss <= libraries + POSTGRES_BUDGET_MB, (
        f"postgres sidecar at rest: {rss:.1f} MB, over its libraries' {libraries:.1f} MB + {POSTGRES_BUDGET_MB} MB")
