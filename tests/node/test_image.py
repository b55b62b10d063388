"""The image, built for real from the Dockerfile and proven from the image itself.

``singleton_testbed.images`` builds the Dockerfile with buildah on a local stand-in for its
base (no Docker engine, nothing pulled) and exports an OCI archive. Everything below is read
from that archive: its config, and its layers unpacked as a runtime would. The programs are
run by runc, the runtime Kubernetes nodes use, the way the chart runs them: as uid 10001,
on a read-only root filesystem with only /tmp writable (a tmpfs, as the chart's emptyDir).

Cold, this builds the base (about a minute) and the image (about two minutes); warm, the
archive of the same inputs is reused and the module takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest
from packaging.utils import canonicalize_name

from singleton_testbed import dist, images
from tests.support.paths import REPO_ROOT

VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
SITE = "opt/singleton/lib/python3.11/site-packages"

pytestmark = [
    pytest.mark.image,
    pytest.mark.timeout(1800),  # cold: mmdebstrap + a two-stage buildah build on vfs
    pytest.mark.skipif(bool(images.missing_tools()),
                       reason=f"building the image needs {' and '.join(images.missing_tools())} "
                              "(apt-get install buildah mmdebstrap)"),
]


@dataclass(frozen=True)
class Built:
    archive: Path
    reference: str
    image: images.OciImage
    rootfs: Path
    seconds: float


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    start = time.monotonic()
    archive, reference = images.build_project_image()
    seconds = time.monotonic() - start
    rootfs = tmp_path_factory.mktemp("image") / "rootfs"
    image = images.unpack_rootfs(archive, rootfs)
    return Built(archive, reference, image, rootfs, seconds)


# --- running a program of the image --------------------------------------------------------


def _mount(destination: str, kind: str, options: list[str]) -> dict[str, object]:
    return {"destination": destination, "type": kind, "source": kind, "options": options}


def runtime_config(built: Built, argv: list[str], env: dict[str, str]) -> dict[str, object]:
    """An OCI runtime config as a CRI runtime derives it from the image config, plus the
    chart's securityContext: the image's user, a read-only root, a tmpfs on /tmp, no capabilities."""
    config = built.image.config["config"]
    uid, gid = (int(part) for part in config["User"].split(":"))
    image_env = dict(entry.split("=", 1) for entry in config["Env"])
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": uid, "gid": gid}, "args": argv,
            "env": [f"{k}={v}" for k, v in {**image_env, **env}.items()],
            "cwd": config.get("WorkingDir") or "/", "noNewPrivileges": True,
            "capabilities": {kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")},
        },
        "root": {"path": str(built.rootfs), "readonly": True},
        "hostname": "image-test",
        "mounts": [
            _mount("/proc", "proc", []),
            _mount("/dev", "tmpfs", ["nosuid", "strictatime", "mode=755", "size=65536k"]),
            _mount("/sys", "sysfs", ["nosuid", "noexec", "nodev", "ro"]),
            _mount("/tmp", "tmpfs", ["nosuid", "nodev", "mode=1777", "size=65536k"]),
        ],
        "linux": {"namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount", "network")]},
    }


@pytest.fixture(scope="module")
def runc_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("runc") is None:
        pytest.fail("runc is needed to run the image's programs (apt-get install runc; .ci/run installs it)")
    return tmp_path_factory.mktemp("runc-state")


@pytest.fixture
def run(built: Built, runc_state: Path, tmp_path: Path) -> Iterator[RunInImage]:
    runner = RunInImage(built, runc_state, tmp_path)
    yield runner
    runner.cleanup()


class RunInImage:
    """Runs commands in the image with runc (each its own container, removed afterwards)."""

    def __init__(self, built: Built, state: Path, folder: Path) -> None:
        self.built, self.state, self.folder = built, state, folder
        self.ids: list[str] = []

    def __call__(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        container = f"singleton-image-test-{secrets.token_hex(4)}"
        bundle = self.folder / container
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(runtime_config(self.built, list(argv), env or {})))
        self.ids.append(container)
        return subprocess.run(["runc", "--root", str(self.state), "run", "--bundle", str(bundle), container],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, check=False)

    def cleanup(self) -> None:
        for container in self.ids:
            subprocess.run(["runc", "--root", str(self.state), "delete", "--force", container],
                           capture_output=True, check=False)


# --- the image's config --------------------------------------------------------------------


def test_the_archive_is_tagged_with_the_package_version_and_reports_its_size(
        built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    assert built.reference == f"ghcr.io/singleton-dev/singleton:{VERSION}"
    assert built.image.ref_name == built.reference  # what `ctr images import` names the image
    size = images.image_size(built.archive)
    rootfs = _tree_bytes(built.rootfs)
    with capsys.disabled():
        print(f"\n[image] {built.reference}: {built.archive} (built or found in {built.seconds:.1f} s); "
              f"{size}; root filesystem unpacked: {rootfs / 1e6:.1f} MB")
    assert size.compressed == built.archive.stat().st_size
    assert 20e6 < size.compressed < 120e6, "the compressed image should stay small"
    assert 50e6 < rootfs < 220e6, "the unpacked image should stay small (the kubernetes client alone would add 126 MB)"


def _tree_bytes(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            if info.st_ino not in seen:  # hard links count once, as on disk
                seen.add(info.st_ino)
                total += info.st_size
    return total


def test_config_runs_as_10001_not_root_with_the_venv_first_on_path(built: Built) -> None:
    config = built.image.config["config"]
    assert config["User"] == "10001:10001"
    assert config["User"].split(":")[0] not in ("0", "root")
    env = dict(entry.split("=", 1) for entry in config["Env"])
    assert env["PATH"].split(":")[0] == "/opt/singleton/bin"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert config["Labels"]["org.opencontainers.image.version"] == VERSION
    assert "Entrypoint" not in config


# --- the programs, as uid 10001 on a read-only root ------------------------------------------


def test_runs_as_10001_on_a_read_only_root_with_only_tmp_writable(run: RunInImage) -> None:
    probe = ("import os\n"
             "print('ids', os.getuid(), os.getgid())\n"
             "for path in ('/probe', '/opt/singleton/probe', '/tmp/probe'):\n"
             "    try:\n"
             "        open(path, 'w').close()\n"
             "        print(path, 'written')\n"
             "    except OSError as error:\n"
             "        print(path, error.strerror)\n")
    result = run("python", "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ids 10001 10001", "/probe Read-only file system", "/opt/singleton/probe Read-only file system",
        "/tmp/probe written"]


@pytest.mark.parametrize("program", ["singleton-sidecar", "singleton-operator"])
def test_console_script_prints_its_usage(run: RunInImage, program: str) -> None:
    result = run(f"/opt/singleton/bin/{program}", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {program} "), result.stdout
    assert result.stderr == ""


def test_the_file_gates_script_ships_in_the_image(run: RunInImage) -> None:
    """The file gate writes ``gate.sh`` from the package's data into the shared folder: a wheel
    without it made every file-gated sidecar exit at start ("No such file or directory")."""
    result = run("/opt/singleton/bin/singleton-sidecar", "gate-script")
    sidecar_package = REPO_ROOT / "sidecar" / "singleton_sidecar"
    packaged = (sidecar_package / "gates" / "gate.sh").read_text()
    assert result.returncode == 0, result.stderr
    assert result.stdout == packaged


def test_bytecode_is_precompiled_so_nothing_is_written(run: RunInImage) -> None:
    # Without PYTHONDONTWRITEBYTECODE, Python writes bytecode it has to compile; on the read-only
    # root that fails, and -v reports both the compiling ("code object from <the .py>") and the
    # failed write ("could not create").
    result = run("python", "-v", "-c", "import singleton_sidecar.cli, singleton_operator.cli, kopf, asyncpg",
                 env={"PYTHONDONTWRITEBYTECODE": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = re.findall(r"^# code object from '?([^'\n]+)'?$", result.stderr, flags=re.MULTILINE)
    assert f"/{SITE}/singleton_sidecar/__pycache__/cli.cpython-311.pyc" in loaded
    assert f"/{SITE}/singleton_operator/__pycache__/cli.cpython-311.pyc" in loaded
    compiled_from_source = [path for path in loaded if not path.endswith(".pyc")]
    assert compiled_from_source == []
    assert "could not create" not in result.stderr


def test_the_sidecar_runs_without_docstrings_from_bytecode_compiled_so(run: RunInImage) -> None:
    """The sidecar's console script runs ``python -OO`` (1 MB less at rest: see the Dockerfile):
    every module it loads, the standard library's too, from -OO bytecode compiled into the image,
    and its --help whole all the same."""
    script = run("head", "-n", "1", "/opt/singleton/bin/singleton-sidecar")
    assert script.stdout.strip() == "#!/opt/singleton/bin/python -OO", script.stdout
    result = run("/opt/singleton/bin/singleton-sidecar", "--help", env={"PYTHONVERBOSE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "singleton-sidecar drain [--wait]" in result.stdout, result.stdout
    loaded = re.findall(r"^# code object from '?([^'\n]+)'?$", result.stderr, flags=re.MULTILINE)
    assert f"/{SITE}/singleton_sidecar/__pycache__/cli.cpython-311.opt-2.pyc" in loaded
    assert any(path.endswith("/__pycache__/argparse.cpython-311.opt-2.pyc") for path in loaded), loaded
    not_opt2 = [path for path in loaded if not path.endswith(".opt-2.pyc")]
    assert not_opt2 == []
    # What `run` goes on to load (the event loop, TLS, HTTP, PostgreSQL, the metrics, the logs).
    run_path = run("python", "-OO", "-v", "-c", "import singleton_sidecar.app, singleton_election.kube, "
                   "singleton_election.backends.both, asyncpg, h11, prometheus_client.metrics, pythonjsonlogger.json",
                   env={"PYTHONDONTWRITEBYTECODE": ""})
    assert run_path.returncode == 0, run_path.stderr[-2000:]
    loaded = re.findall(r"^# code object from '?([^'\n]+)'?$", run_path.stderr, flags=re.MULTILINE)
    assert f"/{SITE}/asyncpg/__pycache__/connection.cpython-311.opt-2.pyc" in loaded
    assert any(path.endswith("/asyncio/__pycache__/base_events.cpython-311.opt-2.pyc") for path in loaded), loaded
    assert [path for path in loaded if not path.endswith(".opt-2.pyc")] == []
    assert "could not create" not in run_path.stderr


def _pyc_flags(path: Path, level: str = "") -> int | None:
    """The flags word of a .pyc (1: an unchecked hash), None when there is no .pyc; ``level``:
    ``".opt-2"`` for -OO's."""
    pyc = path.parent / "__pycache__" / f"{path.stem}.cpython-311{level}.pyc"
    return int.from_bytes(pyc.read_bytes()[4:8], "little") if pyc.exists() else None


def test_every_module_of_the_venv_has_bytecode_valid_whatever_the_file_times(built: Built) -> None:
    # Timestamp-based bytecode is only valid while the sources keep the exact second it
    # recorded, which a layer may round: an unchecked hash (flags 1) does not depend on it.
    site = built.rootfs / SITE
    sources = sorted(site.rglob("*.py"))
    assert len(sources) > 100
    for level in ("", ".opt-2"):
        not_unchecked = {str(path.relative_to(site)): flags for path in sources
                         if (flags := _pyc_flags(path, level)) != 1}
        assert not_unchecked == {}, level


# --- what is not in the image --------------------------------------------------------------


def test_the_test_bed_is_not_in_the_image(built: Built, run: RunInImage) -> None:
    found = [str(path) for path in built.rootfs.rglob("*") if "testbed" in path.name]
    assert found == []
    (dist_info,) = (built.rootfs / SITE).glob("kube_singleton-*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == [
        "singleton_ctl", "singleton_election", "singleton_operator", "singleton_sidecar"]
    scripts = re.findall(r"^(\S+) = ", (dist_info / "entry_points.txt").read_text(), flags=re.MULTILINE)
    assert sorted(scripts) == ["kubectl-singleton", "singleton-operator", "singleton-sample-poller",
                               "singleton-sidecar", "singletonctl"]
    (sdk_info,) = (built.rootfs / SITE).glob("kube_singleton_sdk-*.dist-info")  # the SDK, its own distribution
    assert (sdk_info / "top_level.txt").read_text().split() == ["singleton_sdk"]
    result = run("python", "-c", "import importlib.util as u; print(u.find_spec('singleton_testbed'))")
    assert (result.returncode, result.stdout) == (0, "None\n"), result.stderr


def test_the_kubectl_plugin_is_not_in_the_image_but_says_how_to_get_it(built: Built, run: RunInImage) -> None:
    """The official client (the package's cli extra) is 126 MB installed; nothing in a pod needs it."""
    result = run("python", "-c", "import importlib.util as u; print(u.find_spec('kubernetes'))")
    assert (result.returncode, result.stdout) == (0, "None\n"), result.stderr
    result = run("kubectl-singleton", "status", "-A")
    assert result.returncode == 1
    assert result.stderr.strip() == ("kubectl singleton: error: needs the official kubernetes client: "
                                     "pip install 'kube-singleton[cli]'")


def test_pip_is_not_in_the_runtime_image(built: Built, run: RunInImage) -> None:
    spec = "import importlib.util as u; print(*(u.find_spec(m) for m in ('pip', 'setuptools', 'wheel')))"
    for python in ("/opt/singleton/bin/python", "/usr/bin/python3"):  # the venv's and the base's
        result = run(python, "-c", spec)
        assert (result.returncode, result.stdout) == (0, "None None None\n"), (python, result.stderr)
    # pip's uninstall removes /usr/local/bin of the stand-in base altogether (it held only
    # pip's and wheel's scripts); the official base keeps it (python lives there).
    folders = [built.rootfs / folder for folder in ("opt/singleton/bin", "usr/local/bin", "usr/bin")]
    programs = [path.name for folder in folders if folder.is_dir()
                for path in folder.iterdir() if path.name.startswith(("pip", "easy_install"))]
    assert programs == []


# --- containerd takes it as it is ------------------------------------------------------------


@pytest.fixture
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A containerd of our own (own root, state and socket; no CRI), for `ctr images import`."""
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        pytest.fail("containerd and ctr are needed to import the image (apt-get install containerd; .ci/run does)")
    folder = tmp_path_factory.mktemp("ctrd")
    config = folder / "config.toml"
    config.write_text(f"""version = 2
root = "{folder / 'root'}"
state = "{folder / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "{folder / 'c.sock'}"
[ttrpc]
  address = "{folder / 'c.sock.ttrpc'}"
""")
    with open(folder / "containerd.log", "wb") as log:
        server = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (folder / "c.sock").exists():
            assert server.poll() is None and time.monotonic() < deadline, (folder / "containerd.log").read_text()
            time.sleep(0.1)
        yield folder / "c.sock"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_containerd_imports_the_archive_under_its_reference(built: Built, containerd: Path) -> None:
    def ctr(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", str(containerd), "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, timeout=300, check=False)

    imported = ctr("images", "import", "--snapshotter", "native", str(built.archive))  # and unpacks it
    assert imported.returncode == 0, imported.stderr
    assert ctr("images", "ls", "--quiet").stdout.split() == [built.reference]
    check = ctr("images", "check")
    assert re.search(rf"^{re.escape(built.reference)}\s.*\scomplete \(\d+/\d+\)", check.stdout, flags=re.MULTILINE), \
        check.stdout


def test_a_warm_build_reuses_the_archive(built: Built) -> None:
    start = time.monotonic()
    archive, reference = images.build_project_image()
    assert (archive, reference) == (built.archive, built.reference)
    assert time.monotonic() - start < 10



@pytest.fixture(scope="module")
def shipped(built: Built, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``make dist``'s image step: (the OCI archive, its SBOM)."""
    archive, sbom = dist.build_image(tmp_path_factory.mktemp("dist"), images.project_version())
    return archive, sbom


def test_make_dist_ships_the_archive_and_an_sbom_of_what_the_image_holds(built: Built,
                                                                         shipped: tuple[Path, Path]) -> None:
    """The archive the tests run, and syft's SPDX document listing every Python distribution of
    the image's venv at the version its dist-info says, and every Debian package dpkg records
    (both read here from the unpacked image, not from syft)."""
    archive, sbom = shipped
    assert archive.name == f"singleton-image-{images.project_version()}.oci.tar"
    assert archive.read_bytes() == built.archive.read_bytes()
    purls = dist.sbom_packages(sbom)
    in_venv = set()
    for info in (built.rootfs / SITE).glob("*.dist-info"):
        name, version = info.name.removesuffix(".dist-info").split("-", 1)
        in_venv.add(f"pkg:pypi/{canonicalize_name(name)}@{version}")
    assert len(in_venv) > 15 and in_venv <= purls, sorted(in_venv - purls)
    status = (built.rootfs / "var/lib/dpkg/status").read_text()
    debs = {f"pkg:deb/debian/{name}@{version}" for name, version in
            re.findall(r"^Package: (\S+)\n(?:.+\n)*?Version: (\S+)$", status, re.MULTILINE)}
    shipped_debs = {unquote(purl) for purl in purls if purl.startswith("pkg:deb/")}
    assert len(debs) > 80 and shipped_debs == debs, (sorted(debs - shipped_debs), sorted(shipped_debs - debs))


def test_the_sbom_check_refuses_a_document_missing_a_requirement(shipped: tuple[Path, Path], tmp_path: Path) -> None:
    document = json.loads(shipped[1].read_text())
    document["packages"] = [package for package in document["packages"] if package["name"] != "asyncpg"]
    (changed := tmp_path / "sbom.json").write_text(json.dumps(document))
    dist.check_sbom(shipped[1], images.project_version())  # the document as syft wrote it passes
    with pytest.raises(dist.DistError, match=r"does not list \['pkg:pypi/asyncpg'\]"):
        dist.check_sbom(changed, images.project_version())
