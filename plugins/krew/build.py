"""Build kubectl singleton as self-contained zipapps, one per OS and architecture, their krew
archives, and the krew manifest that names them with their sha256::

    python plugins/krew/build.py OUT_DIR --wheel dist/kube_singleton-0.1.0-py3-none-any.whl [--host]

Each zipapp (``kubectl-singleton-<os>-<arch>.pyz``, run by ``python3``) holds the plugin's
modules from the wheel and its dependencies for CPython 3.11 to 3.14 (the Kubernetes client's
pydantic-core is native code with no fallback, so one archive per platform); the system
Python needs nothing installed (PEP 668 forbids ``pip install`` there on Debian, Ubuntu and
Homebrew). ``--host`` builds only this machine's platform and Python (the tests' quick path).
The dependencies come from PyPI, resolved at build time: the sha256 sums are the build's,
written into ``OUT_DIR/singleton.yaml`` from the template ``plugins/krew/singleton.yaml``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import hashlib
import io
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PYTHONS = ((3, 11), (3, 12), (3, 13), (3, 14))
# Wheel platform tags per krew platform, newest first (pip takes any of them).
PLATFORMS = {
    ("linux", "amd64"): ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"],
    ("linux", "arm64"): ["manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"],
    ("darwin", "amd64"): ["macosx_11_0_x86_64", "macosx_10_12_x86_64", "macosx_10_9_x86_64",
                          "macosx_10_9_universal2", "macosx_10_12_universal2"],
    ("darwin", "arm64"): ["macosx_11_0_arm64", "macosx_10_9_universal2", "macosx_10_12_universal2",
                          "macosx_11_0_universal2"],
}
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible: same inputs, same bytes


def requirements() -> list[str]:
    """What ``kubectl singleton`` imports: the cli extra and the few base dependencies its
    modules use (not the operator's kopf, asyncpg, cryptography...), as pyproject.toml pins them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = ("pyyaml", "h11", "python-json-logger")
    base = [spec for spec in project["dependencies"] if spec.split(">")[0].split("<")[0].split("=")[0] in wanted]
    assert len(base) == len(wanted), base
    return [*project["optional-dependencies"]["cli"], *base]


def host_platform() -> tuple[str, str]:
    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    return sys.platform, machine


def install(target: Path, python: tuple[int, int] | None, tags: list[str] | None) -> None:
    """The dependencies for one CPython on one platform (or this interpreter's), binary only."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
               "--only-binary=:all:", "--target", str(target)]
    if python and tags:
        version = f"{python[0]}{python[1]}"
        command += ["--implementation", "cp", "--python-version", f"{python[0]}.{python[1]}",
                    "--abi", f"cp{version}", "--abi", "abi3", "--abi", "none"]
        command += [arg for tag in tags for arg in ("--platform", tag)]
    subprocess.run([*command, *requirements()], check=True)


def merge(sources: list[Path], site: Path) -> None:
    """One tree: pure files are the same in every version's wheels; native modules are named by
    version (``*.cpython-312-darwin.so``), so they sit side by side."""
    for source in sources:
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            if relative.parts[0] == "bin" or "__pycache__" in relative.parts or not path.is_file():
                continue
            destination = site / relative
            if not destination.exists():
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, destination)


def zipapp(site: Path, pythons: list[tuple[int, int]], out: Path) -> None:
    files = sorted(path for path in site.rglob("*") if path.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(site)).encode() + b"\0" + path.read_bytes())
    main = (HERE / "bootstrap.py").read_text().replace("PYTHONS = ()", f"PYTHONS = {tuple(pythons)!r}", 1)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("__main__.py", ZIP_TIME), main)
        zf.writestr(zipfile.ZipInfo("BUILD_ID", ZIP_TIME), digest.hexdigest()[:16] + "\n")
        for path in files:
            info = zipfile.ZipInfo("site/" + str(path.relative_to(site)), ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    out.write_bytes(b"#!/usr/bin/env python3\n" + buffer.getvalue())
    out.chmod(0o755)


def krew_archive(pyz: Path, out: Path) -> None:
    """The plugin as krew installs it: the zipapp as ``kubectl-singleton``, and its LICENSE."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in (("kubectl-singleton", pyz.read_bytes(), 0o755),
                                 ("LICENSE", (ROOT / "LICENSE").read_bytes(), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uname, info.gname = len(data), mode, 0, "root", "root"
            tar.addfile(info, io.BytesIO(data))
    with open(out, "wb") as file, gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0) as gz:
        gz.write(raw.getvalue())


def manifest(archives: dict[tuple[str, str], Path], out: Path) -> None:
    """The template's platform entries with this build's sha256 (the template names them all;
    a --host build lists its own only, so that krew never gets a sum it did not build)."""
    text = (HERE / "singleton.yaml").read_text()
    for (os_name, arch), archive in archives.items():
        text = text.replace(f"sha256: SHA256-{os_name}-{arch}", f"sha256: {sha256(archive)}")
    doc = yaml.safe_load(text)
    doc["spec"]["platforms"] = [platform for platform in doc["spec"]["platforms"]
                                if not platform["sha256"].startswith("SHA256-")]
    out.write_text(yaml.safe_dump(doc, sort_keys=False))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out_dir: Path, wheel: Path, host: bool) -> dict[tuple[str, str], Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    targets: dict[tuple[str, str], list[tuple[tuple[int, int] | None, list[str] | None]]]
    if host:
        targets = {host_platform(): [(None, None)]}
    else:
        targets = {key: [(python, tags) for python in PYTHONS] for key, tags in PLATFORMS.items()}
    archives = {}
    with tempfile.TemporaryDirectory() as temporary, concurrent.futures.ThreadPoolExecutor(4) as pool:
        work = Path(temporary)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-compile", "--no-deps", "--no-index", "--target", str(work / "app"), str(wheel)],
                       check=True)
        jobs = {}
        for (os_name, arch), combos in targets.items():
            for python, tags in combos:
                folder = work / f"{os_name}-{arch}-{python}"
                jobs[(os_name, arch), folder] = pool.submit(install, folder, python, tags)
        for job in jobs.values():
            job.result()  # raise the first failure
        for (os_name, arch), combos in targets.items():
            site = work / f"{os_name}-{arch}-site"
            merge([work / "app", *(work / f"{os_name}-{arch}-{python}" for python, _ in combos)], site)
            pythons = [python or sys.version_info[:2] for python, _ in combos]
            pyz = out_dir / f"kubectl-singleton-{os_name}-{arch}.pyz"
            zipapp(site, pythons, pyz)
            archive = out_dir / f"kubectl-singleton-{os_name}-{arch}.tar.gz"
            krew_archive(pyz, archive)
            archives[os_name, arch] = archive
    manifest(archives, out_dir / "singleton.yaml")
    return archives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--wheel", type=Path, required=True, help="the kube-singleton wheel (make dist builds it)")
    parser.add_argument("--host", action="store_true", help="this machine's platform and Python only")
    args = parser.parse_args()
    for archive in build(args.out_dir, args.wheel.resolve(), args.host).values():
        print(f"{sha256(archive)}  {archive}")


if __name__ == "__main__":
    main()
