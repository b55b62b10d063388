"""The test-apps image: the project's image plus what the tests' own workers need, for pods of
the real node (``node``). Test-only: never pushed, never the product.

Workers such as ``tests/data/ledger_worker.py`` (asyncpg, ``singleton_sdk.asyncpg``,
``singleton_testbed.actlog``) and ``tests/data/acting_app.py`` run inside pods. The project's
image already has Python, asyncpg and the sidecar's package; this image adds, on top of it,
one layer with ``tests/data`` at ``/opt/singleton-tests/data`` and the test bed's package at
``/opt/singleton-tests/singleton_testbed``, with ``/opt/singleton-tests`` on ``PYTHONPATH``::

    command: ["python", "/opt/singleton-tests/data/ledger_worker.py"]

It is built with buildah from the project's OCI archive (``images.build_project_image()``),
nothing pulled, and cached by content like it (``images.CACHE``): a hash over the project
archive's name (itself named by a hash of its inputs) and every file added here.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from singleton_testbed import images

REFERENCE = "localhost/singleton-test-apps"
"""``localhost/``: a name no registry serves, so it is never mistaken for the product."""
APPS_ROOT = "/opt/singleton-tests"
DATA = "tests/data"
PACKAGE = "testbed/singleton_testbed"
RECIPE = "1"
"""Bumped when the recipe below changes in a way the inputs' hash would not show."""
CONFIG = (
    "--env", f"PYTHONPATH={APPS_ROOT}",
    "--label", "dev.singleton.test-only=true",
    "--label", "org.opencontainers.image.title=singleton-test-apps",
    "--label", "org.opencontainers.image.description=TEST ONLY: the singleton image plus the tests' workers "
               "(tests/data) and the test bed's package; never ship it",
)


def _inputs(context: Path) -> list[tuple[str, Path]]:
    """(path in the image below ``APPS_ROOT``, file on disk), bytecode and egg-info left out."""
    found = []
    for source, target in ((DATA, "data"), (PACKAGE, "singleton_testbed")):
        top = context / source
        found += [(f"{target}/{path.relative_to(top)}", path) for path in images._files_under(top)]
    return sorted(found)


def apps_key(context: Path, project_archive: Path) -> str:
    digest = hashlib.sha256(f"{RECIPE}\0{project_archive.name}\0{CONFIG}\0".encode())
    for name, path in _inputs(context):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _build(context: Path, project_archive: Path, reference: str, archive: Path) -> None:
    container = "singleton-test-apps-build"
    images.buildah_output("rm", container)  # left by an interrupted run (we hold the build lock)
    with tempfile.TemporaryDirectory(prefix="singleton-test-apps-") as staging:
        root = Path(staging) / "apps"
        for name, path in _inputs(context):
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        # Read-only to the image's user (10001): the image runs with a read-only root anyway.
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        # From the archive, not by name: the archive is what the cache holds, whatever
        # buildah's storage still has.
        images.buildah("from", "--name", container, f"oci-archive:{project_archive}")
        try:
            images.buildah("copy", "--chown", "0:0", container, str(root), APPS_ROOT)
            images.buildah("config", *CONFIG, container)
            images.buildah("commit", "--rm", "--format", "oci", container, reference)
        except images.ImageBuildError:
            images.buildah_output("rm", container)
            raise
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    images.buildah("push", reference, f"oci-archive:{partial}:{reference}")
    partial.replace(archive)
    images.buildah_output("rmi", "--prune")


def build_test_apps_image(context: Path = images.REPO) -> tuple[Path, str]:
    """Build (unless cached) the project's image, then the test-apps image on it; return the
    test-apps image's (OCI archive, reference), for ``Node.import_image``."""
    project_archive, _ = images.build_project_image(context)
    reference = f"{REFERENCE}:{images.project_version(context)}"
    key = apps_key(context, project_archive)
    archive = images.CACHE / f"test-apps-{key[:16]}.oci.tar"
    with images._build_lock():
        if not archive.exists():
            _build(context, project_archive, reference, archive)
            for old in images.CACHE.glob("test-apps-*.oci.tar"):  # only the current inputs' archive
                if old != archive:
                    old.unlink()
    return archive, reference
