"""``make demo`` end to end, in its plain (non-interactive) mode, then ``make demo-down``.

The demo starts a test bed of its own (its servers on free ports, its state in a folder of
this test's) and this machine's real node (containerd + kubelet + kube-proxy), into which it
imports the project's image (built with buildah, cached by content: minutes when cold). It
must print a summary with at least three handovers and no overlap, and ``demo down`` must
leave no process, folder or node behind. Only one real node runs per machine: while another
holds it (the tests' ``real_node``, ``make testbed-up``) the demo says so and stops, and the
test tries again for up to ``SINGLETON_NODE_WAIT`` seconds, then skips.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from singleton_testbed.images import missing_tools
from singleton_testbed.node import RUN_DIR, unavailable_reason
from tests.support.paths import REPO_ROOT

# The node's own binaries are built by the demo (testbed/build.sh): check the machine alone.
_SKIP = unavailable_reason({name: Path("/") for name in ("kubelet", "kube-proxy", "pause")}) or (
    f"the image needs {' and '.join(missing)}" if (missing := missing_tools()) else None)
NODE_BUSY = 4  # python -m demo run: another real node runs on this machine
NODE_BUSY_WAIT = float(os.environ.get("SINGLETON_NODE_WAIT", "300"))  # as long as the session's real_node waits
SUMMARY = re.compile(r"^SUMMARY (.*)$", re.MULTILINE)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(entry: dict[str, object]) -> bool:
    return _start_time(int(str(entry["pid"]))) == entry.get("start")


def _processes_mentioning(*needles: str) -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in argv for needle in needles):
            found.append(f"{entry.name}: {argv[:200]}")
    return found


def _demo(state: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SINGLETON_DEMO_STATE": str(state)}
    env.pop("SINGLETON_TESTBED_STATE", None)
    return subprocess.run([sys.executable, "-m", "demo", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.k8s
@pytest.mark.controlplane
@pytest.mark.postgres
@pytest.mark.image
@pytest.mark.timeout(1100)
@pytest.mark.skipif(_SKIP is not None, reason=f"make demo needs a real node and the image tools: {_SKIP}")
def test_demo_runs_end_to_end_and_demo_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "demo-state"
    recorded: dict[str, dict[str, object] | str] = {}
    deadline = time.monotonic() + NODE_BUSY_WAIT
    try:
        while True:
            # Warm: about 100 s; a cold image build adds about 2 min.
            result = _demo(state, "run", "--no-live", "--pause", "0.5", timeout=480)
            if result.returncode != NODE_BUSY or time.monotonic() > deadline:
                break
            time.sleep(5)  # another process's node (the e2e tests, make testbed-up): wait for it to go
        if result.returncode != NODE_BUSY:
            recorded = json.loads((state / "demo.json").read_text())
    finally:
        down = _demo(state, "down", timeout=200)
    output = result.stdout + result.stderr
    if result.returncode == NODE_BUSY:
        pytest.skip(f"another real node ran on this machine for {NODE_BUSY_WAIT:.0f} s (SINGLETON_NODE_WAIT): "
                    f"{output.strip().splitlines()[-1]}")
    assert result.returncode == 0, output
    match = SUMMARY.search(result.stdout)
    assert match, output
    figures = dict(item.split("=", 1) for item in match.group(1).split())
    assert int(figures["handovers"]) >= 3, output
    assert int(figures["overlaps"]) == 0, output
    assert int(figures["regressions"]) == 0 and int(figures["stale_writes"]) == 0, output
    assert int(figures["shared_tokens"]) == 0, output
    assert float(figures["seconds"]) < 120, output  # the scripted part
    assert "export KUBECONFIG=" in result.stdout and "make demo-down" in result.stdout, output

    # demo down: nothing left.
    assert down.returncode == 0, down.stdout + down.stderr
    for key in ("testbed", "operator"):
        entry = recorded[key]
        assert isinstance(entry, dict)
        assert not _alive(entry), f"{key} (pid {entry['pid']}) still runs after demo down"
    assert not state.exists()
    kubeconfig = Path(str(recorded["kubeconfig"]))
    assert not kubeconfig.parent.exists(), "the test bed's folder was not removed"
    workdirs = recorded["workdirs"]
    assert isinstance(workdirs, list) and len(workdirs) == 2
    assert not [folder for folder in workdirs if Path(folder).exists()], workdirs
    node = recorded["node"]
    assert isinstance(node, dict)
    work = str(node["work"])
    assert not Path(work).exists(), "the node's folder was not removed"
    assert not _processes_mentioning(str(state), str(kubeconfig.parent), work), "processes of the demo are left"
    # Our node is gone: its state file is removed (or names another node started since).
    node_state = RUN_DIR / "state.json"
    if node_state.exists():
        assert json.loads(node_state.read_text()).get("work") != work


def test_demo_down_without_a_demo_says_so(tmp_path: Path) -> None:
    result = _demo(tmp_path / "none", "down", timeout=30)
    assert result.returncode == 0
    assert "no demo is running" in result.stdout
