"""The Go that builds the test bed: the ``go`` on PATH when it is new enough for every
``testbed/go/*/go.mod``, else the pinned toolchain (``testbed/go/toolchain.sum``) fetched from the
Go module proxy, where the go command's own ``GOTOOLCHAIN`` switching finds it too (module
``golang.org/toolchain``), checked against its pinned ``h1:`` hash and unpacked into
``~/.cache/singleton/go/go1.X.Y`` (``SINGLETON_GO_CACHE``).

It runs before the venv exists (testbed/prerequisites.sh, testbed/build.sh), so: stdlib only,
and run as a script::

    python3 testbed/singleton_testbed/gotoolchain.py bin   [GO.MOD...]  the folder to put first on PATH (fetches)
    python3 testbed/singleton_testbed/gotoolchain.py check [GO.MOD...]  0 ready, 3 would fetch, 2 cannot
    python3 testbed/singleton_testbed/gotoolchain.py fetch              fetch (once) the pinned toolchain

GO.MOD: more modules the Go must build (benchmarks/clientgo). ``GOPROXY`` is honoured (its first
http(s) entry; default https://proxy.golang.org)."""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
import zlib
from pathlib import Path

TESTBED = Path(__file__).resolve().parent.parent
PINS = TESTBED / "go" / "toolchain.sum"
MODULE = "golang.org/toolchain"
DEFAULT_PROXY = "https://proxy.golang.org"
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}

READY, CANNOT, FETCH = 0, 2, 3  # the exit codes of `check`


class ToolchainError(RuntimeError):
    pass


def version_key(version: str) -> tuple[int, ...]:
    """``1.26.8`` -> (1, 26, 8, 1); ``1.26`` and ``1.26rc1`` sort before ``1.26.0`` as in Go."""
    match = re.fullmatch(r"(?:go)?(\d+)\.(\d+)(?:\.(\d+))?(?:(rc|beta)(\d+))?", version.strip())
    if not match:
        raise ValueError(f"not a Go version: {version!r}")
    major, minor, patch, pre, pre_n = match.groups()
    if patch is not None:
        return (int(major), int(minor), int(patch), 1, 0)
    return (int(major), int(minor), 0, 0, int(pre_n or 0) if pre else 0)


def needed(extra: list[Path] | None = None) -> str:
    """The highest ``go`` line of testbed/go/*/go.mod (and ``extra``)."""
    found: list[str] = []
    for gomod in [*sorted((TESTBED / "go").glob("*/go.mod")), *(extra or [])]:
        found += re.findall(r"^go (\S+)", gomod.read_text(), re.MULTILINE)
    return max(found, key=version_key)


def platform_name() -> str:
    arch = ARCHES.get(platform.machine().lower())
    if sys.platform != "linux" or arch is None:
        raise ToolchainError(f"no pinned Go toolchain for {sys.platform}/{platform.machine()}: install Go >= "
                             f"{needed()} from https://go.dev/dl/ and put its bin/ on PATH")
    return f"linux-{arch}"


def pins() -> dict[str, str]:
    """``v0.0.1-go1.X.Y.linux-ARCH`` -> ``h1:...``"""
    result = {}
    for line in PINS.read_text().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == MODULE:
            result[fields[1]] = fields[2]
    return result


def pinned() -> tuple[str, str, str]:
    """(Go version, module version, h1 hash) of this platform's pin."""
    suffix = "." + platform_name()
    for module_version, h1 in pins().items():
        if module_version.endswith(suffix):
            return module_version.removeprefix("v0.0.1-go").removesuffix(suffix), module_version, h1
    raise ToolchainError(f"{PINS} pins no toolchain for {suffix[1:]}")


def cache_root() -> Path:
    return Path(os.environ.get("SINGLETON_GO_CACHE") or Path.home() / ".cache" / "singleton" / "go")


def proxy() -> str:
    """The first proxy URL of GOPROXY: "direct" and "off" cannot serve this module."""
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY") or DEFAULT_PROXY):
        if entry.startswith(("https://", "http://", "file://")):  # as the go command accepts
            return entry.rstrip("/")
    raise ToolchainError(f"GOPROXY={os.environ.get('GOPROXY')} names no proxy to fetch {MODULE} from")


def go_version(go: str) -> str | None:
    """What ``go version`` says it is (``1.26.8``), or None; itself, not a toolchain it would
    switch to (GOTOOLCHAIN=local, outside any module)."""
    try:
        out = subprocess.run([go, "version"], capture_output=True, text=True, timeout=30, check=False,
                             env={**os.environ, "GOTOOLCHAIN": "local"}, cwd="/").stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"go version go(\d+\.\d+(?:\.\d+)?(?:(?:rc|beta)\d+)?)[\s-]", out)
    return match.group(1) if match else None


def dirhash(zip_path: Path) -> str:
    """The go command's ``h1:`` of a module zip (golang.org/x/mod/sumdb/dirhash.Hash1): sha256 of
    the lines "<sha256 hex>  <name>\\n", one per file, in the order of the names."""
    lines = []
    with zipfile.ZipFile(zip_path) as archive:
        names = [info.filename for info in archive.infolist()]  # folders too, as Go's HashZip
        if len(set(names)) != len(names):
            raise ToolchainError(f"{zip_path}: a file appears twice")
        for name in sorted(names, key=lambda name: name.encode()):  # by name, as Go's sort.Strings
            if "\n" in name:
                raise ToolchainError(f"{zip_path}: a file name holds a newline")
            digest = hashlib.sha256()
            with archive.open(name) as member:
                for chunk in iter(lambda: member.read(1 << 20), b""):
                    digest.update(chunk)
            lines.append(f"{digest.hexdigest()}  {name}\n")
    summary = hashlib.sha256("".join(lines).encode())
    return "h1:" + base64.b64encode(summary.digest()).decode()


def verify(zip_path: Path, module_version: str, expected: str) -> None:
    try:
        actual = dirhash(zip_path)
    except (zipfile.BadZipFile, zlib.error, EOFError) as error:  # a damaged member: CRC or deflate
        raise ToolchainError(f"{MODULE}@{module_version}: {zip_path} is not a sound zip ({error}): refused "
                             "(corrupt or tampered download)") from error
    if actual != expected:
        raise ToolchainError(f"{MODULE}@{module_version}: {zip_path} hashes to {actual}, but {PINS.name} pins "
                             f"{expected}: refused (corrupt or tampered download)")


def unpack(zip_path: Path, module_version: str, dest: Path) -> None:
    """Into ``dest``, the module's prefix stripped, atomically (a folder renamed into place)."""
    prefix = f"{MODULE}@{module_version}/"
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would keep other users (the tests' nobody) out
    try:
        with zipfile.ZipFile(zip_path) as archive:
            for info in archive.infolist():
                relative = info.filename.removeprefix(prefix)
                parts = Path(relative).parts
                if (not info.filename.startswith(prefix) or relative.startswith("/") or ".." in parts
                        or not parts):
                    raise ToolchainError(f"{zip_path}: {info.filename!r} is outside {prefix}")
                target = work / relative
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                # Module zips keep no modes: the go command, unpacking a toolchain, makes bin/ and
                # pkg/tool/ executable (cmd/go/internal/toolchain); so do we.
                if parts[0] == "bin" or parts[:2] == ("pkg", "tool") or (info.external_attr >> 16) & 0o111:
                    target.chmod(0o755)
        try:
            work.rename(dest)
        except OSError:
            if not (dest / "bin" / "go").exists():  # not another run's finished unpack
                raise
    finally:
        if work.exists():
            shutil.rmtree(work)


def download(url: str, target: Path) -> None:
    partial = target.with_name(target.name + f".part.{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        partial.rename(target)
    except OSError as error:
        raise ToolchainError(f"cannot fetch {url}: {error}") from error
    finally:
        partial.unlink(missing_ok=True)


def fetch() -> Path:
    """The pinned toolchain's folder, fetched, checked and unpacked the first time."""
    version, module_version, h1 = pinned()
    root = cache_root()
    dest = root / f"go{version}"
    if (dest / "bin" / "go").exists():
        return dest
    downloads = root / "download"
    downloads.mkdir(parents=True, exist_ok=True)
    zip_path = downloads / f"{module_version}.zip"
    if not zip_path.exists():
        url = f"{proxy()}/{MODULE}/@v/{module_version}.zip"
        log(f"fetching Go {version} from {url} (first time only)")
        start = time.monotonic()
        download(url, zip_path)
        log(f"fetched {zip_path.stat().st_size / 1e6:.0f} MB in {time.monotonic() - start:.0f} s")
    try:
        verify(zip_path, module_version, h1)
    except ToolchainError:
        zip_path.unlink()  # a bad download is not kept: the next run fetches anew
        raise
    unpack(zip_path, module_version, dest)
    log(f"Go {version} checked against {PINS.name} and unpacked into {dest}")
    return dest


def choose(extra: list[Path] | None = None) -> tuple[int, str]:
    """(READY, the bin folder) | (FETCH, why) | (CANNOT, why), without fetching anything."""
    want = needed(extra)
    on_path = shutil.which("go")
    have = go_version(on_path) if on_path else None
    if on_path and have and _fits(have, want):
        return READY, str(Path(on_path).parent)
    why = f"{on_path} is Go {have or '?'}" if on_path else "no go on PATH"
    try:
        version, _, _ = pinned()
    except ToolchainError as error:
        return CANNOT, f"{why}; testbed/go needs Go >= {want}: {error}"
    if version_key(version) < version_key(want):
        return CANNOT, f"{why}; testbed/go needs Go >= {want}, newer than the pinned {version} ({PINS})"
    cached = cache_root() / f"go{version}" / "bin"
    if (cached / "go").exists():
        return READY, str(cached)
    return FETCH, (f"{why}; testbed/go needs Go >= {want}: Go {version} is fetched from the Go module proxy "
                   f"into {cached.parent}, checked against {PINS.relative_to(TESTBED.parent)}")


def _fits(have: str, want: str) -> bool:
    try:
        return version_key(have) >= version_key(want)
    except ValueError:  # a devel build says no number: it is not trusted to be new enough
        return False


def log(message: str) -> None:
    print(f"[go-toolchain] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    command, extra = (argv[0] if argv else "bin"), [Path(arg) for arg in argv[1:]]
    if command not in ("bin", "check", "fetch"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        status, said = (FETCH, "") if command == "fetch" else choose(extra)
        if command == "check" or status == CANNOT:
            print(said, file=sys.stdout if status == READY else sys.stderr)
            return status if command == "check" else 1
        if status == FETCH:
            if said:
                log(said)
            said = str(fetch() / "bin")
        print(said)
    except ToolchainError as error:
        log(str(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
