"""Tiny OCI image archives written from local files, for the real node (``node``).

Nothing may come from an image registry, so the sandbox ("pause") image and the test images
are made here: one uncompressed layer holding the given files, a config, a manifest and an
``index.json`` whose ``io.containerd.image.name`` annotation gives containerd the image's full
name on ``ctr images import``. Archives are deterministic (fixed times and owners), so the same
files give the same image ID.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
_MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class ImageFile:
    """One file of the image: its content from ``source`` (a host file) or ``data``."""

    source: Path | None = None
    data: bytes = b""
    mode: int = 0o755


@dataclass(frozen=True)
class ImageSpec:
    name: str
    """Full reference, e.g. ``registry.k8s.io/pause:3.10``: the CRI looks images up by it."""
    files: Mapping[str, ImageFile]
    """Path inside the image (no leading slash) → content; parent folders are made."""
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    user: str = ""
    symlinks: Mapping[str, str] = field(default_factory=dict)
    """Path inside the image → link target (busybox applets)."""


def _tar_layer(spec: ImageSpec) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders: set[str] = set()
        for path in sorted([*spec.files, *spec.symlinks]):
            parts = path.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folder = "/".join(parts[:depth])
                if folder not in folders:
                    folders.add(folder)
                    info = tarfile.TarInfo(folder)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
        # /tmp and /proc etc. are mount points the runtime fills; /tmp must exist for emptyDirs.
        for folder in ("tmp", "proc", "sys", "dev", "etc"):
            if folder not in folders:
                info = tarfile.TarInfo(folder)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
                tar.addfile(info)
        for path, item in sorted(spec.files.items()):
            data = item.source.read_bytes() if item.source is not None else item.data
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), item.mode
            tar.addfile(info, io.BytesIO(data))
        for path, target in sorted(spec.symlinks.items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
    return buffer.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def write_archive(spec: ImageSpec, out: Path) -> Path:
    """Write ``spec`` as an OCI image layout tar at ``out`` (for ``ctr images import``)."""
    layer = _tar_layer(spec)
    config: dict[str, object] = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": list(spec.entrypoint) or None, "Cmd": list(spec.cmd) or None,
                   "User": spec.user, "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        layer_digest = _blob(tar, layer)
        config_digest = _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2, "mediaType": _MEDIA_MANIFEST,
            "config": {"mediaType": _MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": _MEDIA_LAYER, "digest": layer_digest, "size": len(layer)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": _MEDIA_MANIFEST, "digest": manifest_digest, "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": spec.name,
                                "org.opencontainers.image.ref.name": spec.name.rpartition(":")[2]},
            }],
        }
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", json.dumps(index, sort_keys=True).encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("sh", "sleep", "cat", "echo", "nc", "true", "false", "test", "ls", "id", "touch", "wget")


def busybox_image(name: str = "singleton.dev/testbed/busybox:1") -> ImageSpec:
    """A test image from the machine's static busybox (``apt-get install busybox-static``)."""
    if not BUSYBOX.exists():
        raise FileNotFoundError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    return ImageSpec(
        name=name, files={"bin/busybox": ImageFile(source=BUSYBOX)},
        symlinks={f"bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS}, cmd=("sh",),
    )
