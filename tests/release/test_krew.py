"""The krew plugin: plugins/krew/singleton.yaml (a template: one platform entry per archive,
its sha256 filled by the build) and the self-contained zipapps plugins/krew/build.py makes
(`make dist`), run from a venv that has nothing of the project; the built manifest checked for
what krew validates (internal/index/validation/validate.go), offline."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from singleton_ctl.cli import parser
from tests.release.test_dist import HOST, VERSION
from tests.support.paths import REPO_ROOT

KREW = REPO_ROOT / "plugins" / "krew"
SEMVER = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
PLATFORMS = [("linux", "amd64"), ("linux", "arm64"), ("darwin", "amd64"), ("darwin", "arm64")]
NAME = f"kubectl-singleton-{sys.platform}-{HOST}"


def check_krew_rules(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert doc["kind"] == "Plugin"
    name = doc["metadata"]["name"]
    assert re.fullmatch(r"[\w-]+", name) and name == "singleton"  # `kubectl singleton`
    spec = doc["spec"]
    assert spec["shortDescription"] and not re.search(r"[\r\n]", spec["shortDescription"])
    assert SEMVER.match(spec["version"]), spec["version"]
    assert spec["platforms"]
    for platform in spec["platforms"]:
        assert platform["uri"].startswith("https://")
        assert re.fullmatch(r"[a-f0-9]{64}", platform["sha256"])
        assert platform["bin"] == "kubectl-singleton"
        assert platform["files"] and all(op["from"] and op["to"] for op in platform["files"])
        selector = platform["selector"]
        keys = list(selector.get("matchLabels") or {}) + [e["key"] for e in selector.get("matchExpressions") or []]
        assert keys and set(keys) <= {"os", "arch"}


def test_the_template_names_an_archive_per_platform() -> None:
    doc = yaml.safe_load((KREW / "singleton.yaml").read_text())
    assert doc["spec"]["version"] == f"v{VERSION}"
    entries = [(p["selector"]["matchLabels"]["os"], p["selector"]["matchLabels"]["arch"], p)
               for p in doc["spec"]["platforms"]]
    assert [(os_name, arch) for os_name, arch, _ in entries] == PLATFORMS
    for os_name, arch, platform in entries:
        assert platform["sha256"] == f"SHA256-{os_name}-{arch}"  # build.py fills it
        assert platform["uri"].endswith(f"/v{VERSION}/kubectl-singleton-{os_name}-{arch}.tar.gz")


def test_the_built_manifest_names_the_built_archive(dist_dir: Path) -> None:
    doc = yaml.safe_load((dist_dir / "singleton.yaml").read_text())
    check_krew_rules(doc)
    (platform,) = doc["spec"]["platforms"]  # a host-only build lists its own archive only
    assert platform["selector"]["matchLabels"] == {"os": sys.platform, "arch": HOST}
    archive = dist_dir / f"{NAME}.tar.gz"
    assert platform["uri"].endswith(f"/v{VERSION}/{archive.name}")
    assert platform["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(op["from"] for op in platform["files"])
        member = tar.getmember(platform["bin"])
        assert member.mode & 0o111
        plugin = tar.extractfile(member)
        assert plugin is not None and plugin.read() == (dist_dir / f"{NAME}.pyz").read_bytes()


def test_the_zipapp_holds_the_plugin_and_its_dependencies_not_the_operators(dist_dir: Path) -> None:
    pyz = dist_dir / f"{NAME}.pyz"
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(pyz) as archive:
        tops = {name.split("/")[1] for name in archive.namelist() if name.startswith("site/")}
    assert {"singleton_ctl", "kubernetes", "yaml", "pydantic_core"} <= tops
    assert not {"kopf", "asyncpg", "cryptography", "singleton_sdk"} & tops


def test_the_zipapp_runs_from_a_venv_without_the_project(dist_dir: Path, tmp_path: Path) -> None:
    """A bare venv (no site-packages of this one): everything the plugin imports is in the
    archive, unpacked on first run into XDG_CACHE_HOME."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "KUBECONFIG": str(tmp_path / "absent")}
    missing = subprocess.run([str(venv / "bin" / "python"), "-c", "import singleton_ctl"], capture_output=True,
                             env=env, check=False)
    assert missing.returncode == 1 and b"No module named 'singleton_ctl'" in missing.stderr
    pyz = str(dist_dir / f"{NAME}.pyz")
    for _ in range(2):  # the first run unpacks, the second reuses
        result = subprocess.run([str(venv / "bin" / "python"), pyz, "--help"], capture_output=True, text=True,
                                env=env, check=False)
        assert result.returncode == 0 and result.stdout == parser("kubectl singleton").format_help(), result.stderr
    (unpacked,) = (tmp_path / "cache" / "kubectl-singleton").iterdir()
    assert (unpacked / "singleton_ctl" / "__init__.py").is_file()
    status = subprocess.run([pyz, "status"], capture_output=True, text=True, env=env, check=False)  # via its #!
    assert status.returncode == 1
    assert status.stderr.startswith("kubectl singleton: error: kubeconfig:"), status.stderr
    manifest = tmp_path / "app.yaml"
    manifest.write_text(yaml.safe_dump_all([
        {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": "poller"},
         "spec": {"workloadRef": {"kind": "Deployment", "name": "poller"}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "poller"},
         "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "poller"}},
                  "template": {"metadata": {"labels": {"app": "poller"}},
                               "spec": {"containers": [{"name": "poller", "image": "vendor/poller:1"}]}}}}]))
    inject = subprocess.run([str(venv / "bin" / "python"), pyz, "inject", "-n", "team", "-f", str(manifest)],
                            capture_output=True, text=True, env=env, check=False)  # offline: the operator's code
    assert inject.returncode == 0, inject.stderr
    (_, deployment) = yaml.safe_load_all(inject.stdout)
    pod = deployment["spec"]["template"]["spec"]
    assert "singleton-sidecar" in [c["name"] for c in pod.get("initContainers", []) + pod["containers"]]


def test_the_zipapp_refuses_a_python_it_has_no_native_modules_for(dist_dir: Path, tmp_path: Path) -> None:
    pyz = dist_dir / f"{NAME}.pyz"
    with zipfile.ZipFile(pyz) as archive:
        main = archive.read("__main__.py").decode()
    pythons = f"(({sys.version_info.major}, {sys.version_info.minor}),)"
    assert f"PYTHONS = {pythons}" in main
    patched = tmp_path / "other.pyz"
    with zipfile.ZipFile(pyz) as source, zipfile.ZipFile(patched, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "__main__.py":
                data = main.replace(f"PYTHONS = {pythons}", "PYTHONS = ((3, 99),)").encode()
            target.writestr(item, data)
    result = subprocess.run([sys.executable, str(patched), "--help"], capture_output=True, text=True, check=False,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.startswith("kubectl singleton: error: this archive runs on CPython 3.99, not "), result.stderr
