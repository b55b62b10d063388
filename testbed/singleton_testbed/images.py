"""Build the project's image for real, without a Docker engine and without an image registry.

``build_project_image()`` builds the repository's ``Dockerfile`` with ``buildah`` and exports it
as an OCI archive that containerd imports (``ctr -n k8s.io images import ARCHIVE``), tagged
``ghcr.io/singleton-dev/singleton:<version of pyproject.toml>``. The Dockerfile's base,
``python:3.11-slim-bookworm``, cannot be pulled here, so ``build_base_image()`` builds a
stand-in for it under its own name from Debian bookworm packages (``mmdebstrap``): Python 3.11
with venv, pip/setuptools/wheel installed the way the official image has them (uninstallable
with pip), and the machine's own CA certificates trusted, because HTTPS to PyPI may go through
an intercepting proxy. The Dockerfile is built unchanged, as users build it on the real base.

Both are cached by content under ``~/.cache/singleton/images`` (``SINGLETON_IMAGE_CACHE``):
the base by its recipe, the project's archive by a hash over the Dockerfile, .dockerignore and
every file the Dockerfile copies, plus the base's key. A warm call runs no build tool at all.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]  # the test bed is installed editable from the repository
CACHE = Path(os.environ.get("SINGLETON_IMAGE_CACHE", str(Path.home() / ".cache" / "singleton" / "images")))
REPOSITORY = "ghcr.io/singleton-dev/singleton"
BASE_REFERENCE = "docker.io/library/python:3.11-slim-bookworm"
RECIPE_LABEL = "dev.singleton.base-recipe"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")

# --- the base: a stand-in for python:3.11-slim-bookworm ----------------------------------------

SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# What the official slim image has: Python with venv/ensurepip, CA certificates, netbase and
# tzdata. python-is-python3 puts `python` on PATH (the Dockerfile calls `python`), and the
# wheel of `wheel` lets the base install pip, setuptools and wheel as the official image does.
PACKAGES = ("python3", "python3-venv", "python-is-python3", "python3-wheel-whl", "ca-certificates", "netbase", "tzdata")
# Documentation, manual pages and translations are not needed in an image (copyrights stay).
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)
# Debian's pip refuses system-wide installs (PEP 668), and packages installed by dpkg cannot be
# uninstalled by pip (no RECORD). The official image has pip, setuptools and wheel in
# /usr/local, installed by pip and removable by pip (the Dockerfile's runtime stage removes
# them): install them the same way, from Debian's own wheels, without any download.
INSTALL_PIP = (
    "cd /usr/share/python-wheels"
    " && python3 \"$(ls pip-*.whl)/pip\" install --no-index --no-cache-dir --disable-pip-version-check"
    " --root-user-action=ignore pip-*.whl setuptools-*.whl wheel-*.whl"
)
BASE_CONFIG = (
    "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--env", "LANG=C.UTF-8",
    "--cmd", "python3",
    "--label", "dev.singleton.stand-in=a local stand-in for docker.io/library/python:3.11-slim-bookworm, "
               "built from Debian bookworm packages by singleton_testbed.images",
)


class ImageBuildError(RuntimeError):
    """A build tool failed or is missing; its own output went to stderr."""


def missing_tools() -> list[str]:
    """The build tools not on PATH (the image test skips when there are any)."""
    return [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]


def host_ca_files() -> list[Path]:
    """The machine's own extra CA certificates: the base must trust what pip here must trust."""
    return sorted(HOST_CA_DIR.glob("*.crt")) if HOST_CA_DIR.is_dir() else []


def _customize_hooks(ca_files: list[Path]) -> list[str]:
    # Each hook is run by mmdebstrap with `sh -c`, "$1" being the new root folder.
    hooks = ['rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED']
    if ca_files:
        sources = " ".join(shlex.quote(str(path)) for path in ca_files)
        hooks += [f'cp -- {sources} "$1"/usr/local/share/ca-certificates/', 'chroot "$1" update-ca-certificates']
    hooks.append(f'chroot "$1" sh -ec {shlex.quote(INSTALL_PIP)}')
    hooks.append('chroot "$1" python -m pip --version')  # fails the recipe if pip is not usable
    return hooks


def mmdebstrap_argv(output: Path) -> list[str]:
    """The whole recipe of the base's root filesystem, as one mmdebstrap command line."""
    argv = ["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar",
            "--skip=output/dev",  # no device nodes: the runtime provides /dev
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",  # merged /usr without usrmerge (and its perl)
            '--aptopt=APT::Install-Recommends "false"',
            "--include=" + ",".join(PACKAGES)]
    argv += [f"--dpkgopt={option}" for option in DPKG_OPTIONS]
    argv += [f"--customize-hook={hook}" for hook in _customize_hooks(host_ca_files())]
    return [*argv, SUITE, str(output), *MIRRORS]


def base_recipe_key() -> str:
    """Changes whenever the base would come out different: the recipe or the CAs it trusts."""
    digest = hashlib.sha256()
    digest.update(json.dumps([mmdebstrap_argv(Path("OUT")), BASE_CONFIG, BASE_REFERENCE]).encode())
    for path in host_ca_files():
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- running the tools ---------------------------------------------------------------------


def storage_options() -> list[str]:
    """buildah's storage: our own folder, vfs (works on any file system, no mounts left behind)."""
    return ["--root", str(CACHE / "storage"), "--runroot", str(CACHE / "runroot"), "--storage-driver", "vfs"]


def _run(argv: list[str], name: str) -> None:
    # Progress goes to our stderr (fd 2), so that a cold build shows what it is doing and a
    # captured run (pytest) still keeps it for the failure report.
    try:
        result = subprocess.run(argv, stdout=2, stderr=2, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError as error:
        raise ImageBuildError(f"{argv[0]} is not installed") from error
    if result.returncode != 0:
        raise ImageBuildError(f"{name} failed with status {result.returncode}; its output is above")


def buildah(*args: str) -> None:
    _run(["buildah", *storage_options(), *args], f"buildah {args[0]}")


def buildah_output(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *storage_options(), *args], capture_output=True, text=True, check=False)


def image_labels(reference: str) -> dict[str, str] | None:
    """The labels of an image in our storage, or None when it is not there."""
    result = buildah_output("inspect", "--type", "image", reference)
    if result.returncode != 0:
        return None
    labels: dict[str, str] | None = json.loads(result.stdout).get("OCIv1", {}).get("config", {}).get("Labels")
    return labels or {}


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    # One build at a time per cache (make image and the test may run together): buildah's
    # storage is safe, but our tags and archives would race.
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# --- the base image ------------------------------------------------------------------------


def _base_rootfs(key: str) -> Path:
    """The base's root filesystem as a tarball, built once per recipe."""
    tarball = CACHE / f"base-{key[:16]}.tar"
    if tarball.exists():
        return tarball
    print(f"[image] building the stand-in base's root filesystem with mmdebstrap (about a minute) -> {tarball}",
          file=sys.stderr)
    partial = tarball.with_suffix(".partial")
    _run(mmdebstrap_argv(partial), "mmdebstrap")
    partial.replace(tarball)
    for old in CACHE.glob("base-*.tar"):  # only the current recipe's is worth keeping
        if old != tarball:
            old.unlink()
    return tarball


def _commit_base(tarball: Path, key: str) -> None:
    """One layer holding the tarball, the official image's config, our recipe label."""
    name = "singleton-base-" + key[:12]
    buildah_output("rm", name)  # a working container left by an interrupted run
    buildah("from", "--name", name, "scratch")
    buildah("add", name, str(tarball), "/")
    buildah("config", *BASE_CONFIG, "--label", f"{RECIPE_LABEL}={key}", name)
    buildah("commit", "--rm", "--format", "oci", name, BASE_REFERENCE)


def _ensure_base() -> None:
    key = base_recipe_key()
    labels = image_labels(BASE_REFERENCE)
    if labels is None or labels.get(RECIPE_LABEL) != key:
        _commit_base(_base_rootfs(key), key)


def build_base_image() -> str:
    """Make sure the stand-in base is in our storage under its official name; return the name."""
    with _build_lock():
        _ensure_base()
    return BASE_REFERENCE


# --- the project's image -------------------------------------------------------------------


def project_version(context: Path = REPO) -> str:
    version: str = tomllib.loads((context / "pyproject.toml").read_text())["project"]["version"]
    return version


def copied_sources(dockerfile: str) -> list[str]:
    """The context paths the Dockerfile COPYs (not those copied from another stage)."""
    sources: list[str] = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(word.startswith("--from=") for word in words):
            sources += [word for word in words[1:-1] if not word.startswith("--")]
    return sources


def _files_under(path: Path) -> Iterable[Path]:
    # What .dockerignore keeps out of the package folders (bytecode, egg-info) is left out here
    # too, so that running the tests does not invalidate the image.
    if path.is_file():
        yield path
        return
    for child in sorted(path.rglob("*")):
        parts = set(child.parts)
        if child.is_file() and "__pycache__" not in parts and child.suffix not in (".pyc", ".pyo") \
                and not any(part.endswith(".egg-info") for part in parts):
            yield child


def project_key(context: Path, base_key: str) -> str:
    """A hash over everything that makes the image: the Dockerfile, what it copies, the base."""
    dockerfile = (context / "Dockerfile").read_text()
    digest = hashlib.sha256(base_key.encode())
    inputs = [Path("Dockerfile"), Path(".dockerignore"), *(Path(s) for s in copied_sources(dockerfile))]
    for relative in inputs:
        for path in _files_under(context / relative):
            digest.update(str(path.relative_to(context)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _build_and_export(context: Path, reference: str, version: str, archive: Path) -> None:
    _ensure_base()  # the caller holds the build lock
    print(f"[image] building {reference} from {context / 'Dockerfile'} with buildah", file=sys.stderr)
    # chroot isolation: no user namespace or cgroup setup needed (root on any host). No
    # --layers: on vfs every cached layer is a full copy of the root filesystem, and the
    # archive is cached by content anyway.
    try:
        buildah("build", "--pull=never",  # the base is ours, in our storage; nothing is pulled
                "--isolation", "chroot", "--format", "oci",
                "--build-arg", f"VERSION={version}", "--tag", reference,
                "--file", str(context / "Dockerfile"), str(context))
    except ImageBuildError:
        buildah_output("rm", "--all")  # a failed step leaves its container (we hold the build lock)
        raise
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    # The reference goes into index.json (org.opencontainers.image.ref.name), so that
    # `ctr images import` names the image by it.
    buildah("push", reference, f"oci-archive:{partial}:{reference}")
    partial.replace(archive)
    buildah_output("rmi", "--prune")  # the previous build, untagged by this one


def build_project_image(context: Path = REPO) -> tuple[Path, str]:
    """Build the Dockerfile (unless an archive of the same inputs exists); return (archive, reference)."""
    version = project_version(context)
    reference = f"{REPOSITORY}:{version}"
    key = project_key(context, base_recipe_key())
    archive = CACHE / f"singleton-{version}-{key[:16]}.oci.tar"
    with _build_lock():
        if not archive.exists():
            _build_and_export(context, reference, version, archive)
            for old in CACHE.glob("singleton-*.oci.tar"):  # keep only the archive of the current sources
                if old != archive:
                    old.unlink()
    return archive, reference


# --- reading an OCI archive ----------------------------------------------------------------


@dataclass(frozen=True)
class OciImage:
    """What an OCI archive holds: its tagged name, the image config, the layer digests."""

    archive: Path
    ref_name: str
    config: dict[str, Any]
    layers: list[str]


def _blob_name(digest: str) -> str:
    algorithm, hex_digest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hex_digest}"


def _read_json(tar: tarfile.TarFile, name: str) -> Any:
    member = tar.extractfile(name)
    if member is None:
        raise ValueError(f"{name} is not a file in {tar.name!r}")
    return json.load(member)


def read_image(archive: Path) -> OciImage:
    """The single image of an OCI archive, read from the archive alone (no tool involved)."""
    with tarfile.open(archive) as tar:
        index = _read_json(tar, "index.json")
        (descriptor,) = index["manifests"]
        manifest = _read_json(tar, _blob_name(descriptor["digest"]))
        config = _read_json(tar, _blob_name(manifest["config"]["digest"]))
    return OciImage(archive=archive, ref_name=descriptor.get("annotations", {}).get(
        "org.opencontainers.image.ref.name", ""), config=config,
        layers=[layer["digest"] for layer in manifest["layers"]])


@contextlib.contextmanager
def _layer_stream(image: OciImage, digest: str) -> Iterator[tarfile.TarFile]:
    with tarfile.open(image.archive) as outer:
        blob = outer.extractfile(_blob_name(digest))
        if blob is None:
            raise ValueError(f"layer {digest} missing from {image.archive}")
        with tarfile.open(fileobj=blob, mode="r|*") as layer:  # gzip or plain, read as a stream
            yield layer


@dataclass(frozen=True)
class ImageSize:
    compressed: int
    """Bytes of the OCI archive (compressed layers, as pushed and imported)."""
    unpacked: int
    """Bytes of the regular files of all layers (what the layers take once unpacked)."""

    def __str__(self) -> str:
        return f"{self.compressed / 1e6:.1f} MB compressed (archive), {self.unpacked / 1e6:.1f} MB unpacked (layers)"


def image_size(archive: Path) -> ImageSize:
    image = read_image(archive)
    unpacked = 0
    for digest in image.layers:
        with _layer_stream(image, digest) as layer:
            unpacked += sum(member.size for member in layer if member.isfile())
    return ImageSize(compressed=archive.stat().st_size, unpacked=unpacked)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _safe_target(root: Path, name: str) -> Path:
    parts = [part for part in Path(name).parts if part not in ("/", ".")]
    if ".." in parts:
        raise ValueError(f"layer entry outside the root: {name!r}")
    return root.joinpath(*parts)


def _apply_layer(layer: tarfile.TarFile, root: Path) -> None:
    # OCI layer semantics: `.wh.NAME` deletes NAME of the layers below, `.wh..wh..opq` empties
    # its folder of what the layers below put there; anything else replaces what is there.
    written: set[Path] = set()
    for member in layer:
        target = _safe_target(root, member.name)
        if target.name == ".wh..wh..opq":
            for child in list(target.parent.iterdir()) if target.parent.is_dir() else []:
                if child not in written:
                    _remove(child)
        elif target.name.startswith(".wh."):
            _remove(target.with_name(target.name[len(".wh."):]))
        else:
            if not (member.isdir() and target.is_dir() and not target.is_symlink()):
                _remove(target)  # never write through a symbolic link of a lower layer
            layer.extract(member, root, numeric_owner=True)
            written.add(target)


def unpack_rootfs(archive: Path, root: Path) -> OciImage:
    """Unpack the image's layers into the empty folder ``root``, as a container runtime would."""
    image = read_image(archive)
    root.mkdir(parents=True, exist_ok=True)
    for digest in image.layers:
        with _layer_stream(image, digest) as layer:
            _apply_layer(layer, root)
    return image


# --- command line --------------------------------------------------------------------------


def _print_result(archive: Path, reference: str, out: IO[str]) -> None:
    print(f"archive: {archive}", file=out)
    print(f"reference: {reference}", file=out)
    print(f"size: {image_size(archive)}", file=out)
    print(f"import: ctr -n k8s.io images import {archive}", file=out)


def main(argv: list[str] | None = None) -> int:
    """``singleton-testbed image``: build (or find in the cache) the image; print where it is."""
    parser = argparse.ArgumentParser(prog="singleton-testbed image", description=main.__doc__)
    parser.add_argument("--base-only", action="store_true", help="only build the stand-in base image")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if missing := missing_tools():
        print(f"singleton-testbed image: needs {' and '.join(missing)} (apt-get install {' '.join(missing)})",
              file=sys.stderr)
        return 1
    try:
        if args.base_only:
            print(f"base: {build_base_image()} (recipe {base_recipe_key()[:16]})")
            return 0
        archive, reference = build_project_image()
    except ImageBuildError as error:
        print(f"singleton-testbed image: {error}", file=sys.stderr)
        return 1
    _print_result(archive, reference, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
