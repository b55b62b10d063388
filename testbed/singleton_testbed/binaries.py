"""Where the test bed's binaries come from.

In order: a per-binary variable (``SINGLETON_TESTBED_KUBE_APISERVER`` …), a folder in
``KUBEBUILDER_ASSETS`` (envtest's convention), then the cache folder filled by
``testbed/build.sh`` from Go modules, which is run when a binary is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm",
         "kubelet", "kube-proxy", "pause")
"""The last three run the real node (``node``); ``pause`` is its sandbox image's process."""
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "build.sh"


VERSIONS_ENV = BUILD_SCRIPT.parent / "go" / "versions.env"
KUBERNETES_VERSION_ENV = "SINGLETON_KUBERNETES_VERSION"
"""Picks the pinned Kubernetes the test bed builds and runs (``testbed/build.sh``)."""


def pinned_versions() -> dict[str, str]:
    """The variables of ``testbed/go/versions.env``."""
    lines = VERSIONS_ENV.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#"))


def kubernetes_version() -> str:
    """The Kubernetes version of this run's test bed: ``SINGLETON_KUBERNETES_VERSION``, else the
    default (``KUBERNETES_VERSION``, the oldest the project supports)."""
    return os.environ.get(KUBERNETES_VERSION_ENV) or pinned_versions()["KUBERNETES_VERSION"]


def _env_name(name: str) -> str:
    return "SINGLETON_TESTBED_" + name.upper().replace("-", "_")


def cache_dir() -> Path:
    """Run the build script (it builds only what is missing) and return its folder."""
    if not BUILD_SCRIPT.exists():
        raise FileNotFoundError(f"test bed build script not found at {BUILD_SCRIPT}")
    print(f"[testbed] checking the binaries of Kubernetes {kubernetes_version()} (a cold build takes about 15 min "
          "on 2 cores)", file=sys.stderr)
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True)
    return Path(result.stdout.strip().splitlines()[-1])


def find(name: str) -> Path:
    """The path of one binary, building the cache when nothing else provides it."""
    if name not in NAMES:
        raise ValueError(f"unknown test bed binary {name!r}")
    if explicit := os.environ.get(_env_name(name)):
        return Path(explicit)
    if assets := os.environ.get("KUBEBUILDER_ASSETS"):
        candidate = Path(assets) / name
        if candidate.exists():
            return candidate
    return cache_dir() / name


def find_all() -> dict[str, Path]:
    found: dict[str, Path] = {}
    missing = []
    for name in NAMES:
        if explicit := os.environ.get(_env_name(name)):
            found[name] = Path(explicit)
        elif (assets := os.environ.get("KUBEBUILDER_ASSETS")) and (Path(assets) / name).exists():
            found[name] = Path(assets) / name
        else:
            missing.append(name)
    if missing:
        built = cache_dir()
        found.update({name: built / name for name in missing})
    return found


def add_to_path(binaries: dict[str, Path]) -> None:
    """Put kubectl and helm first on PATH so tests and docs call exactly these."""
    folders = dict.fromkeys(str(path.parent) for name, path in binaries.items() if name in ("kubectl", "helm"))
    os.environ["PATH"] = os.pathsep.join([*folders, os.environ.get("PATH", "")])
    assert shutil.which("kubectl") is not None


PROMETHEUS_NAMES = ("promtool", "prometheus")
PROMETHEUS_BUILD_SCRIPT = BUILD_SCRIPT.with_name("build-prometheus.sh")


def find_prometheus(name: str) -> Path:
    """promtool or the Prometheus server: ``SINGLETON_TESTBED_PROMTOOL`` (``…_PROMETHEUS``), else
    the cache folder of ``testbed/build-prometheus.sh``, which builds it when missing."""
    if name not in PROMETHEUS_NAMES:
        raise ValueError(f"unknown Prometheus binary {name!r}")
    if explicit := os.environ.get(_env_name(name)):
        return Path(explicit)
    print(f"[testbed] checking {name} (a cold build takes minutes)", file=sys.stderr)
    result = subprocess.run(["bash", str(PROMETHEUS_BUILD_SCRIPT), name], check=True, stdout=subprocess.PIPE,
                            text=True)
    return Path(result.stdout.strip().splitlines()[-1]) / name
