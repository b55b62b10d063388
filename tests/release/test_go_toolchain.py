"""singleton_testbed.gotoolchain: the Go that builds the test bed, PATH's when new enough, else the
pinned ``golang.org/toolchain`` from the Go module proxy, checked against testbed/go/toolchain.sum.
The real fetch (~72 MB) happens once per cache (``SINGLETON_GO_CACHE``, default
~/.cache/singleton/go), as testbed/build.sh would do it; the other fetches come from a local
proxy serving that zip, or a tampered copy of it."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from singleton_testbed import gotoolchain
from tests.support.localhttp import serving
from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "testbed" / "singleton_testbed" / "gotoolchain.py"
PREREQUISITES = REPO_ROOT / "testbed" / "prerequisites.sh"
OLD_GO = '#!/bin/sh\necho "go version go1.19 linux/amd64"\n'
SYSTEM_GO = Path("/usr/local/go/bin/go")


@functools.cache
def real_toolchain() -> tuple[Path, float | None]:
    """The pinned toolchain in the cache, fetched from the real proxy if it is not there yet
    (then also the seconds it took)."""
    version, _, _ = gotoolchain.pinned()
    dest = gotoolchain.cache_root() / f"go{version}"
    start = time.monotonic()
    fetched = not (dest / "bin" / "go").exists()
    assert gotoolchain.fetch() == dest
    return dest, (time.monotonic() - start) if fetched else None


def cached_zip() -> Path:
    real_toolchain()
    _, module_version, _ = gotoolchain.pinned()
    return gotoolchain.cache_root() / "download" / f"{module_version}.zip"


@contextmanager
def local_proxy(zip_path: Path, folder: Path) -> Iterator[str]:
    """A GOPROXY on loopback that serves ``zip_path`` as the pinned toolchain's zip."""
    _, module_version, _ = gotoolchain.pinned()
    served = folder / "proxy" / "golang.org" / "toolchain" / "@v"
    served.mkdir(parents=True)
    (served / f"{module_version}.zip").symlink_to(zip_path)
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(folder / "proxy"), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)

    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler), "local-goproxy") as url:
        yield url
    assert requests, "the local proxy was never asked"


def tool(folder: Path, *args: str, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    """gotoolchain.py as the shell scripts run it (before the venv: stdlib only), with PATH."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          check=False, cwd=folder,
                          env={**os.environ, "PATH": path, "SINGLETON_GO_CACHE": str(folder / "cache"), **env})


def old_go_path(folder: Path) -> str:
    bin_dir = folder / "old-go"
    bin_dir.mkdir()
    (bin_dir / "go").write_text(OLD_GO)
    (bin_dir / "go").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.build
def test_the_pins_are_what_the_proxy_lists_and_the_checksum_database_signed() -> None:
    """Every pin is listed by the proxy, its .mod is the toolchain module's, and its h1 is
    sum.golang.org's record (through the proxy's /sumdb/, the go command's way)."""
    proxy = gotoolchain.proxy()
    listed = urllib.request.urlopen(f"{proxy}/golang.org/toolchain/@v/list", timeout=60).read().decode().split()
    pins = gotoolchain.pins()
    assert {"linux-amd64", "linux-arm64"} == {version.rsplit(".", 1)[1] for version in pins}
    for module_version, h1 in pins.items():
        assert module_version in listed
        mod = urllib.request.urlopen(f"{proxy}/golang.org/toolchain/@v/{module_version}.mod", timeout=60).read()
        assert mod.decode().strip() == "module golang.org/toolchain"
        record = urllib.request.urlopen(f"{proxy}/sumdb/sum.golang.org/lookup/golang.org/toolchain@{module_version}",
                                        timeout=60).read().decode()
        assert f"golang.org/toolchain {module_version} {h1}\n" in record, record
    version, _, _ = gotoolchain.pinned()
    assert gotoolchain.version_key(version) >= gotoolchain.version_key(gotoolchain.needed())
    same_minor = {v.removeprefix("v0.0.1-go").rsplit(".", 1)[0] for v in listed
                  if v.startswith(f"v0.0.1-go{version.rsplit('.', 1)[0]}.") and "rc" not in v}
    newer = sorted(v for v in same_minor if gotoolchain.version_key(v) > gotoolchain.version_key(version))
    if newer:  # a hint to move the pin, not a failure: the pinned one is sound
        print(f"the proxy lists newer patches than the pinned go{version}: {newer}")


@pytest.mark.build
def test_the_fetched_toolchain_matches_its_pin_and_runs() -> None:
    dest, seconds = real_toolchain()
    zip_path = cached_zip()
    version, module_version, h1 = gotoolchain.pinned()
    print(f"{zip_path}: {zip_path.stat().st_size / 1e6:.0f} MB, "
          + (f"fetched, checked and unpacked in {seconds:.1f} s" if seconds is not None else "cached before"))
    assert gotoolchain.dirhash(zip_path) == h1
    arch = module_version.rsplit("-", 1)[1]
    said = subprocess.run([str(dest / "bin" / "go"), "version"], capture_output=True, text=True, timeout=60,
                          check=True, env={**os.environ, "GOTOOLCHAIN": "local"}, cwd="/").stdout
    assert said.strip() == f"go version go{version} linux/{arch}"
    assert os.access(dest / "pkg" / "tool" / f"linux_{arch}" / "compile", os.X_OK)


@pytest.mark.build
def test_a_zip_with_one_byte_changed_is_refused(tmp_path: Path) -> None:
    """One byte of a file's content, the zip otherwise sound (re-stored): the hash tells."""
    _, module_version, h1 = gotoolchain.pinned()
    tampered = tmp_path / f"{module_version}.zip"
    with zipfile.ZipFile(cached_zip()) as source, zipfile.ZipFile(tampered, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/VERSION"):
                data = data.replace(b"go1.", b"go2.", 1)
            out.writestr(info.filename, data)
    with pytest.raises(gotoolchain.ToolchainError) as refused:
        gotoolchain.verify(tampered, module_version, h1)
    said = str(refused.value)
    assert f"but toolchain.sum pins {h1}: refused (corrupt or tampered download)" in said
    assert said.startswith(f"golang.org/toolchain@{module_version}: {tampered} hashes to h1:")


@pytest.mark.build
def test_a_fetch_of_a_tampered_zip_keeps_nothing(tmp_path: Path) -> None:
    """Through GOPROXY (honoured): one raw byte of the download changed; nothing is unpacked,
    the download is not kept, and the script fails saying why."""
    raw = bytearray(cached_zip().read_bytes())
    with zipfile.ZipFile(cached_zip()) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith("/bin/go"))
    raw[info.header_offset + 30 + len(info.filename) + 1000] ^= 0x01  # inside bin/go's deflated data
    tampered = tmp_path / "tampered.zip"
    tampered.write_bytes(bytes(raw))
    with local_proxy(tampered, tmp_path) as proxy:
        done = tool(tmp_path, "bin", path=old_go_path(tmp_path), GOPROXY=f"{proxy},direct")
    assert done.returncode == 1, done.stderr
    assert f"fetching Go {gotoolchain.pinned()[0]} from {proxy}/golang.org/toolchain/@v/" in done.stderr
    assert "refused (corrupt or tampered download)" in done.stderr
    assert done.stdout == ""
    assert sorted(path.name for path in (tmp_path / "cache").rglob("*")) == ["download"]


@pytest.mark.build
def test_an_old_go_on_path_makes_it_fetch(tmp_path: Path) -> None:
    """go1.19 on PATH (Debian 12's): `check` says it would fetch; `bin` fetches (from a local proxy
    serving the real zip) and gives the fetched toolchain's folder, which `check` then takes."""
    path = old_go_path(tmp_path)
    check = tool(tmp_path, "check", path=path)
    assert check.returncode == gotoolchain.FETCH, check.stderr
    version, _, _ = gotoolchain.pinned()
    assert f"old-go/go is Go 1.19; testbed/go needs Go >= {gotoolchain.needed()}: Go {version} is fetched" \
        in check.stderr
    with local_proxy(cached_zip(), tmp_path) as proxy:
        done = tool(tmp_path, "bin", path=path, GOPROXY=proxy)
    assert done.returncode == 0, done.stderr
    fetched = tmp_path / "cache" / f"go{version}" / "bin"
    assert done.stdout == f"{fetched}\n"
    assert f"Go {version} checked against toolchain.sum and unpacked into {fetched.parent}" in done.stderr
    again = tool(tmp_path, "check", path=path)
    assert (again.returncode, again.stdout) == (0, f"{fetched}\n")


@pytest.mark.skipif(not SYSTEM_GO.exists(), reason="no /usr/local/go here")
@pytest.mark.build
def test_a_new_enough_go_on_path_is_used_and_nothing_fetched(tmp_path: Path) -> None:
    """This machine's /usr/local/go (1.26.8 >= the go.mod files' 1.26.7): no fetch, even with a
    proxy that answers nothing."""
    have = gotoolchain.go_version(str(SYSTEM_GO))
    assert have is not None
    if gotoolchain.version_key(have) < gotoolchain.version_key(gotoolchain.needed()):
        pytest.skip(f"/usr/local/go is {have}, older than testbed/go needs")
    path = f"{SYSTEM_GO.parent}:/usr/bin:/bin"
    done = tool(tmp_path, "bin", path=path, GOPROXY="http://127.0.0.1:9")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{SYSTEM_GO.parent}\n", "")
    assert not (tmp_path / "cache").exists()


@pytest.mark.build
def test_prerequisites_fetch_go_without_root_or_apt(tmp_path: Path) -> None:
    """`make testbed` on a machine with Debian 12's go: `check` names no Debian package and
    succeeds (build.sh fetches it); `install`, even with SINGLETON_NO_APT=1, fetches it."""
    env = {**os.environ, "PATH": old_go_path(tmp_path), "SINGLETON_NO_APT": "1",
           "SINGLETON_GO_CACHE": str(tmp_path / "cache")}
    check = subprocess.run(["bash", str(PREREQUISITES), "check", "testbed"], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stderr
    assert "Go comes from the Go module proxy" in check.stderr
    assert "apt-get" not in check.stderr
    with local_proxy(cached_zip(), tmp_path) as proxy:
        install = subprocess.run(["bash", str(PREREQUISITES), "install", "testbed"], env={**env, "GOPROXY": proxy},
                                 capture_output=True, text=True, timeout=300, check=False)
    assert install.returncode == 0, install.stderr
    assert "fetching Go from the Go module proxy" in install.stderr
    assert (tmp_path / "cache" / f"go{gotoolchain.pinned()[0]}" / "bin" / "go").exists()
    after = subprocess.run(["bash", str(PREREQUISITES), "check", "testbed"], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert (after.returncode, after.stderr) == (0, "")


def test_the_build_scripts_take_their_go_from_it() -> None:
    """Every script that runs `go build` or `go install` asks gotoolchain.py first."""
    for script in ("testbed/build.sh", "testbed/build-prometheus.sh", "testbed/build-go-tool.sh",
                   "benchmarks/clientgo/build.sh"):
        text = "\n".join(line for line in (REPO_ROOT / script).read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        asked = text.index("singleton_testbed/gotoolchain.py\" bin")
        assert asked < min(text.index(word) for word in ("go build", "go install") if word in text), script
        assert 'PATH="$gobin:$PATH' in text, script


@pytest.mark.build
def test_build_sh_builds_with_the_fetched_go_when_path_has_an_old_one(tmp_path: Path) -> None:
    """testbed/build.sh with go1.19 first on PATH: it builds (here only pause, the others stand in
    as present) with the pinned toolchain from the cache."""
    dest, _ = real_toolchain()
    versions_env = (REPO_ROOT / "testbed" / "go" / "versions.env").read_text()
    versions = dict(line.split("=", 1) for line in versions_env.splitlines()
                    if "=" in line and not line.startswith("#"))
    built = tmp_path / "testbed" / (f"k8s-{versions['KUBERNETES_VERSION']}_etcd-{versions['ETCD_VERSION']}"
                                     f"_helm-{versions['HELM_VERSION']}")
    built.mkdir(parents=True)
    for name in ("etcd", "kube-apiserver", "kubectl", "kube-controller-manager", "kube-scheduler", "kubelet",
                 "kube-proxy", "helm"):
        (built / name).write_text("#!/bin/sh\n")
        (built / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'old-go'}:{os.environ['PATH']}", "SINGLETON_TESTBED_CACHE":
           str(tmp_path / "testbed"), "SINGLETON_GO_CACHE": str(dest.parent)}
    old_go_path(tmp_path)
    done = subprocess.run(["bash", str(REPO_ROOT / "testbed" / "build.sh")], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(built)
    assert f"building pause from singleton.dev/testbed/pause with go{gotoolchain.pinned()[0]}" in done.stderr
    assert os.access(built / "pause", os.X_OK)


@pytest.mark.build
def test_prerequisites_fail_saying_so_when_the_fetch_fails(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": old_go_path(tmp_path), "SINGLETON_GO_CACHE": str(tmp_path / "cache"),
           "GOPROXY": "http://127.0.0.1:9"}  # nothing listens on the discard port
    done = subprocess.run(["bash", str(PREREQUISITES), "install", "testbed"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert "cannot fetch http://127.0.0.1:9/golang.org/toolchain/@v/" in done.stderr
    assert "make testbed cannot run here:" in done.stderr
    assert done.stderr.rstrip().endswith("(fetching it failed, above)")
    assert not (tmp_path / "cache" / f"go{gotoolchain.pinned()[0]}").exists()


def test_versions_compare_as_go_compares_them() -> None:
    key = gotoolchain.version_key
    assert key("1.24") < key("1.24rc1") < key("1.24.0") < key("1.24.7") < key("1.24.10") < key("1.26.0")
    assert key("go1.26.8") > key("1.26.7")
    gomods = [*(REPO_ROOT / "testbed" / "go").glob("*/go.mod"), REPO_ROOT / "benchmarks" / "clientgo" / "go.mod"]
    lines = {gomod: gomod.read_text().split("\ngo ", 1)[1].split()[0] for gomod in gomods}
    assert gotoolchain.needed() == gotoolchain.needed(gomods[-1:]) == max(lines.values(), key=key)
    with pytest.raises(ValueError, match="not a Go version"):
        key("devel")
