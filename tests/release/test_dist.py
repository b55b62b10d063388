"""``make dist`` (singleton_testbed.dist): the release artifacts are built, checked, and the
root wheel installs into a fresh venv whose console scripts run. No server: helm lints and
packages the chart offline. The krew plugin's zipapp: tests/release/test_krew.py."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEELS = [f"kube_singleton-{VERSION}-py3-none-any.whl", f"kube_singleton_sdk-{VERSION}-py3-none-any.whl"]
SDISTS = [f"kube_singleton-{VERSION}.tar.gz", f"kube_singleton_sdk-{VERSION}.tar.gz"]


HOST = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
KREW = [f"kubectl-singleton-{sys.platform}-{HOST}.pyz", f"kubectl-singleton-{sys.platform}-{HOST}.tar.gz",
        "singleton.yaml"]


@pytest.fixture
def dist(dist_dir: Path) -> Path:
    return dist_dir  # conftest.py: built once for this module and tests/release/test_krew.py


def test_every_artifact_is_built_and_summed(dist: Path) -> None:
    expected = {*WHEELS, *SDISTS, f"singleton-{VERSION}.tgz", *KREW, "SHA256SUMS"}
    assert {path.name for path in dist.iterdir()} == expected
    summed = {line.split("  ")[1] for line in (dist / "SHA256SUMS").read_text().splitlines()}
    assert summed == expected - {"SHA256SUMS"}
    result = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=dist, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_twine_check_strict_passes_every_python_artifact(dist: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *WHEELS, *SDISTS], cwd=dist,
                            capture_output=True, text=True, check=False)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    assert result.returncode == 0, plain + result.stderr
    assert sorted(re.findall(r"^Checking (\S+): PASSED$", plain, re.MULTILINE)) == sorted([*WHEELS, *SDISTS]), plain


def test_license_is_in_every_wheel_and_sdist(dist: Path) -> None:
    text = (REPO_ROOT / "LICENSE").read_bytes()
    assert text.startswith(b"\n                                 Apache License\n                           Version 2.0")
    for wheel in WHEELS:
        stem = wheel.removesuffix("-py3-none-any.whl")
        with zipfile.ZipFile(dist / wheel) as archive:
            assert archive.read(f"{stem}.dist-info/licenses/LICENSE") == text
            metadata = archive.read(f"{stem}.dist-info/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata.splitlines()
        assert "License-File: LICENSE" in metadata.splitlines()
        assert "Project-URL: Source, https://github.com/singleton-dev/singleton" in metadata.splitlines()
    for sdist in SDISTS:
        with tarfile.open(dist / sdist) as archive:
            member = archive.extractfile(sdist.removesuffix(".tar.gz") + "/LICENSE")
            assert member is not None and member.read() == text


def test_the_chart_archive_holds_its_schema_and_crd(dist: Path) -> None:
    with tarfile.open(dist / f"singleton-{VERSION}.tgz") as archive:
        names = set(archive.getnames())
        schema = archive.extractfile("singleton/values.schema.json")
        assert schema is not None and schema.read() == (REPO_ROOT / "charts/singleton/values.schema.json").read_bytes()
    assert "singleton/crds/singleton.dev_singletonservices.yaml" in names
    assert "singleton/templates/deployment.yaml" in names


def test_the_root_wheel_installs_into_a_fresh_venv_and_its_scripts_run(dist: Path, tmp_path: Path) -> None:
    """The wheel alone, offline (--no-index --no-deps); its dependencies are lent by this venv
    through a path entry (not a site dir: its editable kube-singleton is not loaded), and
    ``pip check`` proves they satisfy the wheel's Requires-Dist."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                    "--no-deps", "--find-links", str(dist), f"kube-singleton=={VERSION}"], check=True)
    (site / "lent-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    where = subprocess.run([str(python), "-c", "import importlib.resources as r, singleton_sidecar, singleton_ctl; "
                            "print(singleton_sidecar.__file__); print(singleton_ctl.__file__); "
                            "print((r.files('singleton_sidecar') / 'gates' / 'gate.sh').read_text()[:9])"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert where[:2] == [f"{site}/singleton_sidecar/__init__.py", f"{site}/singleton_ctl/__init__.py"]
    assert where[2] == "#!/bin/sh"
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(declared) == sorted(p.name for p in (venv / "bin").iterdir() if p.name in declared)
    for script in ("singleton-sidecar", "singleton-operator", "kubectl-singleton", "singletonctl"):
        result = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True, check=False)
        assert result.returncode == 0 and result.stdout.startswith("usage: "), (script, result.stdout, result.stderr)
