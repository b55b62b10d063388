"""plugins/krew/singleton.yaml: what krew validates (internal/index/validation/validate.go),
checked offline, and the archive it names built from the repository with its sha256."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import yaml

from singleton_ctl.cli import parser

KREW = Path(__file__).resolve().parent.parent / "plugins" / "krew"
SEMVER = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def manifest() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((KREW / "singleton.yaml").read_text())
    return doc


def test_the_manifest_has_what_krew_validates() -> None:
    doc = manifest()
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


def test_the_manifest_names_the_archive_the_repository_builds(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(KREW / "build.py"), str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout
    digest, archive = out.split()
    assert hashlib.sha256(Path(archive).read_bytes()).hexdigest() == digest
    (platform,) = manifest()["spec"]["platforms"]
    assert platform["sha256"] == digest, "rebuild the archive and update the manifest's sha256"
    assert platform["uri"].endswith("/v0.1.0/" + Path(archive).name)
    with tarfile.open(archive) as tar:
        member = tar.getmember(platform["bin"])
        assert member.mode & 0o111
        launcher = tar.extractfile(member)
        assert launcher is not None and launcher.read() == (KREW / "kubectl-singleton").read_bytes()


def test_the_launcher_runs_the_plugin(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(KREW / "kubectl-singleton"), "--help"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0 and result.stdout == parser("kubectl singleton").format_help(), result.stderr


def test_the_launcher_without_the_package_says_what_to_install() -> None:
    # -S: no site-packages, so no kube-singleton.
    result = subprocess.run([sys.executable, "-S", str(KREW / "kubectl-singleton"), "status"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("kubectl singleton: error: the kube-singleton Python package is missing (")
    assert result.stderr.rstrip().endswith("install it with: python3 -m pip install 'kube-singleton[cli]'")
    assert len(result.stderr.strip().splitlines()) == 1
