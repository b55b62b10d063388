"""``make demo`` end to end, in its plain (non-interactive) mode, then ``make demo-down``.

The demo starts a test bed of its own (its servers on free ports, its state in a folder of
this test's, its kubelet stand-in under a node name derived from that folder), so it never
touches the session's servers. It must print a summary with at least three handovers and no
overlap, and ``demo down`` must leave no process, network namespace or folder behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from singleton_testbed.netns import DEFAULT_NETWORK, netns_supported

REPO = Path(__file__).resolve().parent.parent
_SKIP = netns_supported()
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
    return subprocess.run([sys.executable, "-m", "demo", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.k8s
@pytest.mark.controlplane
@pytest.mark.postgres
@pytest.mark.timeout(360)
@pytest.mark.skipif(_SKIP is not None, reason=f"make demo needs root and `ip netns`: {_SKIP}")
def test_demo_runs_end_to_end_and_demo_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "demo-state"
    recorded: dict[str, dict[str, object] | str] = {}
    try:
        result = _demo(state, "run", "--no-live", "--pause", "0.5", timeout=180)
        recorded = json.loads((state / "demo.json").read_text())
    finally:
        down = _demo(state, "down", timeout=150)
    output = result.stdout + result.stderr
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
    for key in ("testbed", "kubelet", "operator"):
        entry = recorded[key]
        assert isinstance(entry, dict)
        assert not _alive(entry), f"{key} (pid {entry['pid']}) still runs after demo down"
    assert not state.exists()
    kubeconfig = Path(str(recorded["kubeconfig"]))
    assert not kubeconfig.parent.exists(), "the test bed's folder was not removed"
    assert not _processes_mentioning(str(state), str(kubeconfig)), "processes of the demo are left"
    kubelet = recorded["kubelet"]
    assert isinstance(kubelet, dict)
    subnet = kubelet["subnet"]
    assert isinstance(subnet, int)
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    prefix = f"{DEFAULT_NETWORK.prefix}-{subnet}-"
    assert not [name for name in netns if name.startswith(prefix)], netns
    claim = DEFAULT_NETWORK.state_root / DEFAULT_NETWORK.prefix / "claims" / str(subnet)
    if claim.exists():  # another stand-in may have claimed the /24 since, never ours
        assert json.loads(claim.read_text()).get("node") != kubelet["node"]


def test_demo_down_without_a_demo_says_so(tmp_path: Path) -> None:
    result = _demo(tmp_path / "none", "down", timeout=30)
    assert result.returncode == 0
    assert "no demo is running" in result.stdout
