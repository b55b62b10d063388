"""testbed/prerequisites.sh, the one list of what the machine needs (issue 32). Each test runs the
script with a PATH of symlinks to the programs it runs and checks for but one, so a tool goes
missing without removing anything; where the script could install, a stand-in ``apt-get`` records the call."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from singleton_testbed import images, node
from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "testbed" / "prerequisites.sh"
APT_STAND_IN = '#!/bin/sh\necho "apt-get $*" >> "$(dirname "$0")/../apt-get.log"\necho "stand-in apt-get $*" >&2\n'


@dataclass
class Run:
    returncode: int
    output: str
    required: set[str]  # the packages of "... cannot run here:"
    wanted: set[str]  # the packages the tests can do without
    apt_calls: list[str]


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder that nobody (the non-root runs) can read too, unlike pytest's tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="singleton-prereq-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


# What the script runs besides the tools it checks for.
UTILITIES = ("bash", "env", "cat", "dirname", "sed", "sort", "head", "tail", "grep", "awk", "id", "dpkg-query",
             "apt-cache")


@functools.cache
def programs() -> dict[str, str]:
    """The script's utilities and the tools it checks for, by name, as this PATH finds them."""
    checked = re.findall(r"^cmd:(\S+)", SCRIPT.read_text(), re.MULTILINE)
    return {name: path for name in (*UTILITIES, *checked, "go", "initdb", "pgbouncer") if (path := shutil.which(name))}


def bin_without(folder: Path, *missing: str, apt_get: bool = True, stand_ins: dict[str, str] | None = None) -> Path:
    """A PATH folder: the programs above but ``missing`` and (``apt_get``) a stand-in apt-get,
    never this machine's; ``stand_ins``: other programs' scripts in their place."""
    scripts = {**({"apt-get": APT_STAND_IN} if apt_get else {}), **(stand_ins or {})}
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name, path in programs().items():
        if name not in missing and name not in scripts:
            (bin_dir / name).symlink_to(path)
    for name, script in scripts.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    log = folder / "apt-get.log"
    log.touch()
    log.chmod(0o666)
    return bin_dir


def run(folder: Path, mode: str, *targets: str, missing: tuple[str, ...] = (), no_apt: bool = False,
        as_nobody: bool = False, apt_get: bool = True, stand_ins: dict[str, str] | None = None,
        extra_env: dict[str, str] | None = None) -> Run:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=folder))
    run_dir.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "SINGLETON_NO_APT"}
    env["PATH"] = str(bin_without(run_dir, *missing, apt_get=apt_get, stand_ins=stand_ins))
    env["PYTHON"] = sys.executable
    if no_apt:
        env["SINGLETON_NO_APT"] = "1"
    env.update(extra_env or {})
    command = ["bash", str(SCRIPT), mode, *targets]
    if as_nobody:
        # go env reads its settings under HOME, and root's is closed to nobody.
        env["HOME"] = str(run_dir)
        setpriv = shutil.which("setpriv") or "setpriv"
        command = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=run_dir, check=False)
    assert done.stdout == ""  # everything it says goes to stderr, around make's own output
    required: set[str] = set()
    wanted: set[str] = set()
    section = required
    for line in done.stderr.splitlines():
        if line.endswith("cannot run here:"):
            section = required
        elif "without these" in line:
            section = wanted
        elif line.startswith("  as root: apt-get install "):
            section.update(line.removeprefix("  as root: apt-get install ").split())
    apt_calls = (run_dir / "apt-get.log").read_text().splitlines()
    return Run(done.returncode, done.stderr, required, wanted, apt_calls)


def present(*tools: str) -> str:
    """The first of ``tools`` this machine has (the test takes it away)."""
    for tool in tools:
        if shutil.which(tool):
            return tool
    pytest.skip(f"none of {', '.join(tools)} is here to take away")


PACKAGE = {"openssl": "openssl", "psql": "postgresql-client", "buildah": "buildah", "mmdebstrap": "mmdebstrap"}


def test_check_names_exactly_the_package_of_a_missing_tool(folder: Path) -> None:
    tool = present("openssl", "psql")
    before = run(folder, "check", "test")
    after = run(folder, "check", "test", missing=(tool,))
    assert PACKAGE[tool] not in before.required
    assert after.required == before.required | {PACKAGE[tool]}, after.output
    assert after.wanted == before.wanted
    assert after.returncode == 1
    assert after.apt_calls == []


def test_make_test_can_do_without_the_image_but_make_demo_cannot(folder: Path) -> None:
    """The image's and the real node's packages are wanted by `make test` (its tests skip or fail
    saying why, as before), needed by `make demo`."""
    tool = present("buildah", "mmdebstrap")
    before = run(folder, "check", "test")
    after = run(folder, "check", "test", missing=(tool,))
    assert after.wanted == before.wanted | {PACKAGE[tool]}, after.output
    assert after.required == before.required
    assert after.returncode == before.returncode
    demo_before = run(folder, "check", "demo")
    demo = run(folder, "check", "demo", missing=(tool,))
    assert demo.required == demo_before.required | {PACKAGE[tool]}, demo.output
    assert demo.returncode == 1


def test_install_with_no_apt_prints_the_apt_get_line_and_fails(folder: Path) -> None:
    tool = present("openssl", "psql")
    before = run(folder, "check", "test")
    after = run(folder, "install", "test", missing=(tool,), no_apt=True)
    assert after.returncode == 1
    assert "SINGLETON_NO_APT=1, installing nothing" in after.output
    assert after.required == before.required | {PACKAGE[tool]}, after.output
    assert after.apt_calls == []


def test_install_as_non_root_prints_the_apt_get_line_and_fails(folder: Path) -> None:
    tool = present("openssl", "psql")
    as_nobody = os.geteuid() == 0
    if as_nobody and shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to run the script as nobody")
    before = run(folder, "check", "test", as_nobody=as_nobody)
    after = run(folder, "install", "test", missing=(tool,), as_nobody=as_nobody)
    assert after.returncode == 1
    assert "not root, installing nothing" in after.output
    assert after.required == before.required | {PACKAGE[tool]}, after.output
    assert after.apt_calls == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs only as root")
def test_install_as_root_says_what_and_why_before_apt_get(folder: Path) -> None:
    """As root it calls apt-get (here the stand-in, which installs nothing: the tool stays
    missing, and the script says so and fails)."""
    tool = present("openssl", "psql")
    before = run(folder, "check", "test")
    after = run(folder, "install", "test", missing=(tool,))
    packages = before.required | before.wanted | {PACKAGE[tool]}
    assert after.apt_calls[0] == "apt-get update -qq"
    assert after.apt_calls[1].startswith("apt-get install -y -qq ")
    assert set(after.apt_calls[1].split()[4:]) == packages
    assert len(after.apt_calls) == 2
    said = after.output.index("installing with apt-get")
    assert said < after.output.index("stand-in apt-get update")
    why = next(line for line in after.output[said:].splitlines() if line.split()[:1] == [PACKAGE[tool]])
    listed = re.search(rf"^cmd:{tool} +{PACKAGE[tool]} +bed +(.+)$", SCRIPT.read_text(), re.MULTILINE)
    assert listed, f"{tool} is not in the script's list as the test bed's"
    assert why.split(None, 1)[1] == f"{listed.group(1)} ({tool})"  # the package, why, and what shows it
    assert f"still missing after apt-get install {' '.join(after.apt_calls[1].split()[4:])}" in after.output
    assert after.returncode == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs only as root")
def test_a_failed_apt_get_stops_make_test_only_for_what_it_needs(folder: Path) -> None:
    """Without the image's packages `make test` goes on (their tests skip), as before it installed."""
    tool = present("buildah", "mmdebstrap")
    failing = {"apt-get": APT_STAND_IN + "exit 100\n"}
    before = run(folder, "check", "test")
    after = run(folder, "install", "test", missing=(tool,), stand_ins=failing)
    assert "prerequisites: apt-get install failed" in after.output
    assert after.wanted == before.wanted | {PACKAGE[tool]}, after.output
    assert after.returncode == before.returncode
    demo = run(folder, "install", "demo", missing=(tool,), stand_ins=failing)
    assert PACKAGE[tool] in demo.required, demo.output
    assert demo.returncode == 1


def test_no_apt_get_on_path_prints_the_apt_get_line_and_fails(folder: Path) -> None:
    tool = present("openssl", "psql")
    after = run(folder, "install", "test", missing=(tool,), apt_get=False)
    assert after.returncode == 1
    if os.geteuid() == 0:
        assert "no apt-get here, installing nothing" in after.output
    assert PACKAGE[tool] in after.required, after.output


def test_without_go_it_names_no_debian_package_but_the_go_module_proxy(folder: Path) -> None:
    """Debian 12's golang-go (1.19) would not do: without a Go new enough `check` says that the
    pinned one comes from the Go module proxy (tests/release/test_go_toolchain.py fetches it), needs no
    apt-get, and lets `make testbed` run (testbed/build.sh fetches it too)."""
    lines = [re.findall(r"^go (\S+)", gomod.read_text(), re.MULTILINE)
             for gomod in (REPO_ROOT / "testbed" / "go").glob("*/go.mod")]
    want = max((line for found in lines for line in found), key=lambda v: [int(part) for part in v.split(".")])
    toolchain_sum = (REPO_ROOT / "testbed" / "go" / "toolchain.sum").read_text()
    pinned = re.findall(r"^golang.org/toolchain v0.0.1-go(\S+)\.linux-", toolchain_sum, re.MULTILINE)[0]
    empty = {"SINGLETON_GO_CACHE": str(folder / "no-go-here")}
    without = run(folder, "check", "testbed", missing=("go",), extra_env=empty)
    assert without.returncode == 0, without.output
    assert without.required == set(), without.output
    assert (f"no go on PATH; testbed/go needs Go >= {want}: Go {pinned} is fetched from the Go module proxy into "
            f"{folder}/no-go-here/go{pinned}, checked against testbed/go/toolchain.sum") in without.output
    assert "golang-go" not in without.output
    assert not (folder / "no-go-here").exists()


def test_make_runs_the_script_first_and_ci_run_uses_it() -> None:
    """`make test`, `make demo`, `make testbed` and `make venv` run the script before anything
    else, with their goal; .ci/run has no list of its own."""
    for goal in ("test", "demo", "testbed", "venv"):
        dry = subprocess.run(["make", "-n", "--no-print-directory", goal], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=30, check=True)
        assert dry.stdout.splitlines()[0] == f"PYTHON=python3 bash testbed/prerequisites.sh install {goal}"
    ci_run = (REPO_ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci_run
    assert ci_run.index("bash testbed/prerequisites.sh install ci") < ci_run.index("\nmake test\n")


def test_the_list_has_what_the_node_and_the_image_check(monkeypatch: pytest.MonkeyPatch) -> None:
    text = SCRIPT.read_text()
    for path in (node.CONTAINERD, node.CTR, node.RUNC, *(node.CNI_BIN / name for name in ("bridge", "host-local",
                                                                                          "loopback"))):
        assert f"\nfile:{path} " in text
    monkeypatch.setattr(shutil, "which", lambda *_args, **_kwargs: None)
    assert images.missing_tools()
    for tool in images.missing_tools():
        assert f"\ncmd:{tool} " in text
