"""``make dist``: build every release artifact into one folder and check it, as a release
would publish it (nothing is pushed from here)::

    python -m singleton_testbed.dist [--krew-host] [OUT_DIR]      # default: dist/

- wheel and sdist of ``kube-singleton`` (the root) and ``kube-singleton-sdk`` (``sdk/``), by
  ``python -m build``, checked by ``twine check --strict`` and by their contents: LICENSE in
  each, and the package data the sidecar needs at run time (``gate.sh``, ``py.typed``);
- the Helm chart, ``helm lint --strict`` then ``helm package``, with its values schema and CRD;
- kubectl singleton as self-contained zipapps and their krew archives, one per OS and
  architecture, and the krew manifest naming them (plugins/krew/build.py; ``--krew-host``:
  this machine's only, the tests' quick path);
- the image as an OCI archive (the Dockerfile built by ``singleton_testbed.images``: buildah
  and mmdebstrap, root) and its SBOM, SPDX JSON written by syft (built from its Go module,
  ``testbed/build-go-tool.sh``) and checked to list the image's Python and Debian packages
  (``--no-image``: without them, as the release workflow's ``dist`` job, which leaves the
  image to buildx for two architectures);
- ``SHA256SUMS`` of all of them.

Every check raises ``DistError`` naming what is wrong; the last line printed is the folder.
``tests/release/test_dist.py`` runs it and checks the artifacts again from the outside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from singleton_testbed import images
from singleton_testbed.binaries import find

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "charts" / "singleton"
KUBE_VERSION = "1.34.0"  # the test bed's helm assumes v1.20 without it; the chart needs >= 1.34
PROJECTS = {"kube-singleton": ROOT, "kube-singleton-sdk": ROOT / "sdk"}
# Files a wheel must hold besides its modules: what setuptools leaves out when package-data
# is wrong, and nothing notices until a pod starts (the file gate runs gate.sh).
WHEEL_DATA = {
    "kube-singleton": ["singleton_election/py.typed", "singleton_sidecar/gates/gate.sh", "singleton_sidecar/py.typed",
                       "singleton_operator/py.typed", "singleton_ctl/py.typed"],
    "kube-singleton-sdk": ["singleton_sdk/py.typed"],
}
CHART_FILES = ["Chart.yaml", "values.yaml", "values.schema.json", "crds/singleton.dev_singletonservices.yaml"]
# What the image's SBOM must list besides kube-singleton and its own requirements: the Debian
# package of the interpreter the sidecar runs on (a scanner that misses dpkg misses the CVEs).
IMAGE_DEB_PACKAGES = ["python3.11", "libc6"]


class DistError(Exception):
    pass


def version_of(project: Path) -> str:
    version: str = tomllib.loads((project / "pyproject.toml").read_text())["project"]["version"]
    return version


def check_versions() -> str:
    """One version for every artifact of a release."""
    versions = {name: version_of(path) for name, path in PROJECTS.items()}
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    versions["chart version"], versions["chart appVersion"] = str(chart["version"]), str(chart["appVersion"])
    if len(set(versions.values())) != 1:
        raise DistError(f"the artifacts' versions differ: {versions}")
    return versions["kube-singleton"]


def build_python(out: Path) -> None:
    """Both distributions at once (each ``build`` is mostly waiting on its isolated env)."""
    running = [(name, subprocess.Popen([sys.executable, "-m", "build", "--outdir", str(out), str(path)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
               for name, path in PROJECTS.items()]
    for name, process in running:
        output, _ = process.communicate()
        if process.returncode != 0:
            raise DistError(f"python -m build failed for {name}:\n{output}")


def python_artifacts(out: Path, version: str) -> list[Path]:
    paths = []
    for name in PROJECTS:
        stem = f"{name.replace('-', '_')}-{version}"
        paths += [out / f"{stem}-py3-none-any.whl", out / f"{stem}.tar.gz"]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise DistError(f"not built: {missing}")
    return paths


def twine_check(paths: list[Path]) -> None:
    names = [path.name for path in paths]  # relative: rich wraps long lines at 80 columns
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *names], cwd=paths[0].parent,
                            capture_output=True, text=True, check=False)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)  # rich colours it whatever NO_COLOR says
    passed = re.findall(r"^Checking (\S+): PASSED$", plain, re.MULTILINE)
    if result.returncode != 0 or sorted(passed) != sorted(names):
        raise DistError(f"twine check --strict failed:\n{result.stdout}{result.stderr}")


def check_contents(out: Path, version: str) -> None:
    license_text = (ROOT / "LICENSE").read_bytes()
    for name in PROJECTS:
        stem = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(out / f"{stem}-py3-none-any.whl") as wheel:
            names = set(wheel.namelist())
            wanted = [f"{stem}.dist-info/licenses/LICENSE", *WHEEL_DATA[name]]
            if missing := [member for member in wanted if member not in names]:
                raise DistError(f"{stem} wheel lacks {missing}")
            if wheel.read(f"{stem}.dist-info/licenses/LICENSE") != license_text:
                raise DistError(f"{stem} wheel's LICENSE is not the repository's")
        with tarfile.open(out / f"{stem}.tar.gz") as sdist:
            member = sdist.extractfile(f"{stem}/LICENSE")
            if member is None or member.read() != license_text:
                raise DistError(f"{stem} sdist's LICENSE is not the repository's")


def build_chart(out: Path, version: str) -> Path:
    helm = str(find("helm"))
    lint = subprocess.run([helm, "lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART)],
                          capture_output=True, text=True, check=False)
    if lint.returncode != 0 or "[WARNING]" in lint.stdout or "[ERROR]" in lint.stdout:
        raise DistError(f"helm lint --strict failed:\n{lint.stdout}{lint.stderr}")
    package = subprocess.run([helm, "package", str(CHART), "--destination", str(out)], capture_output=True,
                             text=True, check=False)
    archive = out / f"singleton-{version}.tgz"
    if package.returncode != 0 or not archive.is_file():
        raise DistError(f"helm package failed:\n{package.stdout}{package.stderr}")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    if missing := [name for name in CHART_FILES if f"singleton/{name}" not in names]:
        raise DistError(f"the chart archive lacks {missing}")
    return archive


def build_krew(out: Path, version: str, host_only: bool) -> list[Path]:
    wheel = out / f"kube_singleton-{version}-py3-none-any.whl"
    command = [sys.executable, str(ROOT / "plugins" / "krew" / "build.py"), str(out), "--wheel", str(wheel)]
    result = subprocess.run(command + (["--host"] if host_only else []), capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise DistError(f"plugins/krew/build.py failed:\n{result.stdout}{result.stderr}")
    archives = [Path(line.split("  ", 1)[1]) for line in result.stdout.splitlines()]
    manifest = yaml.safe_load((out / "singleton.yaml").read_text())
    if manifest["spec"]["version"] != f"v{version}":
        raise DistError(f"the krew manifest says {manifest['spec']['version']}, the release is v{version}")
    pyzs = [archive.with_name(archive.name.removesuffix(".tar.gz") + ".pyz") for archive in archives]
    return [*pyzs, *archives, out / "singleton.yaml"]


def go_tool(name: str) -> Path:
    """A release tool built from its Go module (testbed/build-go-tool.sh), cached."""
    result = subprocess.run(["bash", str(ROOT / "testbed" / "build-go-tool.sh"), name], capture_output=True,
                            text=True, check=False, timeout=1800)
    if result.returncode != 0:
        raise DistError(f"testbed/build-go-tool.sh {name} failed:\n{result.stderr}")
    return Path(result.stdout.splitlines()[-1]) / name


def build_image(out: Path, version: str) -> list[Path]:
    """The image as an OCI archive and its SBOM (SPDX JSON), both checked."""
    if missing := images.missing_tools():
        raise DistError(f"the image needs {', '.join(missing)} (apt-get install buildah mmdebstrap; root), "
                        "or --no-image")
    built, reference = images.build_project_image()
    if reference != f"{images.REPOSITORY}:{version}":
        raise DistError(f"the image is tagged {reference}, the release is {version}")
    archive = out / f"singleton-image-{version}.oci.tar"
    shutil.copyfile(built, archive)
    image = images.read_image(archive)
    labels = image.config.get("config", {}).get("Labels") or {}
    if image.ref_name != reference or labels.get("org.opencontainers.image.version") != version:
        raise DistError(f"the image archive names {image.ref_name!r}, version label "
                        f"{labels.get('org.opencontainers.image.version')!r}; the release is {reference}")
    sbom = out / f"singleton-image-{version}.spdx.json"
    scan = subprocess.run([str(go_tool("syft")), "scan", f"oci-archive:{archive}", "--quiet",
                           "--source-name", images.REPOSITORY, "--source-version", version,
                           "--output", f"spdx-json={sbom}"], capture_output=True, text=True, check=False,
                          timeout=600)
    if scan.returncode != 0 or not sbom.is_file():
        raise DistError(f"syft failed:\n{scan.stdout}{scan.stderr}")
    check_sbom(sbom, version)
    return [archive, sbom]


def sbom_packages(sbom: Path) -> set[str]:
    """The package URLs of an SPDX JSON document, without their qualifiers (``pkg:pypi/h11@0.16.0``)."""
    document = json.loads(sbom.read_text())
    return {ref["referenceLocator"].split("?", 1)[0] for package in document.get("packages", [])
            for ref in package.get("externalRefs", []) if ref.get("referenceType") == "purl"}


def check_sbom(sbom: Path, version: str) -> None:
    """SPDX 2.3 naming the image, listing kube-singleton at the release's version, every one of
    its requirements, and the Debian packages that carry the interpreter."""
    document = json.loads(sbom.read_text())
    if document.get("spdxVersion") != "SPDX-2.3" or document.get("name") != images.REPOSITORY:
        raise DistError(f"{sbom.name}: not an SPDX 2.3 document of {images.REPOSITORY}: "
                        f"{document.get('spdxVersion')!r}, {document.get('name')!r}")
    purls = sbom_packages(sbom)
    names = {purl.rsplit("@", 1)[0] for purl in purls}
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {f"pkg:pypi/{canonicalize_name(Requirement(requirement).name)}" for requirement in requirements}
    wanted |= {f"pkg:deb/debian/{name}" for name in IMAGE_DEB_PACKAGES}
    missing = sorted(wanted - names)
    if f"pkg:pypi/kube-singleton@{version}" not in purls:
        missing.insert(0, f"pkg:pypi/kube-singleton@{version}")
    if missing:
        raise DistError(f"{sbom.name} does not list {missing}")


def write_sums(out: Path) -> Path:
    sums = out / "SHA256SUMS"
    lines = [f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
             for path in sorted(out.iterdir()) if path.is_file() and path != sums]
    sums.write_text("".join(lines))
    return sums


def dist(out: Path, krew_host_only: bool = False, image: bool = True) -> list[Path]:
    version = check_versions()
    if out.exists():
        shutil.rmtree(out)  # only this run's artifacts, so SHA256SUMS lists exactly them
    out.mkdir(parents=True)
    build_python(out)
    artifacts = python_artifacts(out, version)
    twine_check(artifacts)
    check_contents(out, version)
    artifacts.append(build_chart(out, version))
    artifacts += build_krew(out, version, krew_host_only)
    if image:
        artifacts += build_image(out, version)
    artifacts.append(write_sums(out))
    return artifacts


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m singleton_testbed.dist", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "dist", help="the folder to (re)create")
    parser.add_argument("--krew-host", action="store_true", help="the krew plugin for this machine only")
    parser.add_argument("--no-image", action="store_true",
                        help="without the image's OCI archive and SBOM (they need buildah and mmdebstrap, as root)")
    args = parser.parse_args()
    try:
        artifacts = dist(args.out.resolve(), args.krew_host, image=not args.no_image)
    except DistError as exc:
        print(f"make dist: error: {exc}", file=sys.stderr)
        return 1
    for path in artifacts:
        print(f"{path.stat().st_size:>10}  {path.name}")
    print(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
