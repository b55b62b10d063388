"""Build the archive plugins/krew/singleton.yaml points at, byte for byte reproducibly, and
print its sha256 (the manifest's ``sha256``):

    python3 plugins/krew/build.py OUT_DIR

The archive holds the launcher ``kubectl-singleton`` only; the code comes from the
kube-singleton distribution (see the manifest's caveats)."""

from __future__ import annotations

import gzip
import hashlib
import io
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHIVE = "kubectl-singleton.tar.gz"


def build(out_dir: Path) -> Path:
    launcher = (HERE / "kubectl-singleton").read_bytes()
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("kubectl-singleton")
        info.size, info.mode, info.mtime, info.uname, info.gname = len(launcher), 0o755, 0, "root", "root"
        tar.addfile(info, io.BytesIO(launcher))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ARCHIVE
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(tar_bytes.getvalue())
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 plugins/krew/build.py OUT_DIR")
    archive = build(Path(sys.argv[1]))
    print(f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {archive}")
