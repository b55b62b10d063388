"""Faults on the containers of the real node (``singleton_testbed.node``), from pod objects.

Faults done to real containers from outside, by the kernel's own handles:

- ``container_pids`` / ``signal_container``: the processes of one container, found in its
  cgroup, and a signal to all of them (SIGKILL, SIGSTOP, SIGCONT of the sidecar alone);
- ``freeze_pod`` / ``thaw_pod`` / ``frozen_pod``: the whole pod stopped at once by the v1
  freezer cgroup (atomic: no process runs between the first and the last being stopped, which
  a SIGSTOP sent process by process cannot promise);
- ``pod_netns`` / ``in_pod_netns`` / ``partition`` / ``heal``: the pod's network namespace
  (that of its pause process), and iptables rules inside it that cut the pod off a target.

The pod object is what the API returns (``kubectl get pod -o json``): ``metadata.uid`` and
``status.containerStatuses[].containerID`` (init containers, native sidecars included, are
in ``initContainerStatuses``) name the cgroups. Re-read the pod after a container restarts:
its new container has a new ID.

Layout (kubelet with ``cgroupDriver: cgroupfs`` under the node's ``cgroupRoot``, cgroup v1):
``/sys/fs/cgroup/<hierarchy>/<cgroup root>/kubepods[/besteffort|/burstable]/pod<uid>/<container ID>``,
one folder per container plus one for the pod's sandbox (pause). Everything here needs root,
and only works on the machine that runs the node; ``on_this_machine`` tells.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from singleton_testbed.node_config import FIRST_NODE, SECOND_NODE, NodeLayout

Pod = Mapping[str, Any]
"""A pod object as the API returns it."""

DEFAULT_LAYOUT = FIRST_NODE
"""Not given a layout, the functions here take the pod's own node's (``layout_of``)."""
CGROUP_FS = Path("/sys/fs/cgroup")
HIERARCHY = "freezer"
"""The v1 hierarchy the processes are read from: runc puts a container's processes in every
hierarchy, and this one is also the one that freezes."""
PARTITION_COMMENT = "singleton-partition"
"""Marks the iptables rules ``partition`` adds, so ``heal`` removes exactly those."""


class NotOnThisNode(LookupError):
    """The pod (or one of its containers) has no cgroup here: not running, not scheduled on
    this machine's node, or the pod object is stale (a restarted container has a new ID)."""


# --- cgroups and processes -----------------------------------------------------------------


def container_id(pod: Pod, container: str) -> str:
    """The runtime's ID of ``container`` (regular, init or native sidecar), without the
    ``containerd://`` prefix."""
    status = pod.get("status") or {}
    for entry in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if entry.get("name") == container:
            if not entry.get("containerID"):
                raise NotOnThisNode(f"container {container!r} of pod {_name(pod)} has not started")
            return str(entry["containerID"]).split("://", 1)[-1]
    raise KeyError(f"pod {_name(pod)} has no container {container!r}")


def layout_of(pod: Pod, layout: NodeLayout = DEFAULT_LAYOUT) -> NodeLayout:
    """``layout``, or when it is the default, the layout of the test bed node the pod is bound
    to (the second node's for a pod there: a cluster of both nodes, seen through a kubeconfig)."""
    if layout is DEFAULT_LAYOUT and (pod.get("spec") or {}).get("nodeName") == SECOND_NODE.name:
        return SECOND_NODE
    return layout


def pod_cgroup(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT, hierarchy: str = HIERARCHY) -> Path:
    """The pod's cgroup folder in ``hierarchy`` (its QoS class decides the parent folder, so it
    is looked up rather than computed)."""
    layout = layout_of(pod, layout)
    uid = str(pod["metadata"]["uid"])
    kubepods = CGROUP_FS / hierarchy / layout.cgroup_root.strip("/") / "kubepods"
    folder = f"pod{uid}"
    for parent in (kubepods, kubepods / "besteffort", kubepods / "burstable"):
        if (parent / folder).is_dir():
            return parent / folder
    raise NotOnThisNode(f"pod {_name(pod)} has no cgroup under {kubepods}")


def container_cgroup(pod: Pod, container: str, *, layout: NodeLayout = DEFAULT_LAYOUT,
                     hierarchy: str = HIERARCHY) -> Path:
    path = pod_cgroup(pod, layout=layout, hierarchy=hierarchy) / container_id(pod, container)
    if not path.is_dir():
        raise NotOnThisNode(f"container {container!r} of pod {_name(pod)} has no cgroup (not running, "
                            "or restarted since the pod object was read)")
    return path


def _procs(cgroup: Path) -> list[int]:
    with contextlib.suppress(FileNotFoundError):  # removed as the container ended
        return sorted(int(pid) for pid in (cgroup / "cgroup.procs").read_text().split())
    return []


def container_pids(pod: Pod, container: str, *, layout: NodeLayout = DEFAULT_LAYOUT) -> list[int]:
    """The host PIDs of every process of ``container`` (its main process first is not
    promised: sorted by PID)."""
    return _procs(container_cgroup(pod, container, layout=layout))


def pod_pids(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> list[int]:
    """The host PIDs of every process of the pod, its pause process included."""
    top = pod_cgroup(pod, layout=layout)
    return sorted({pid for folder, _, _ in os.walk(top) for pid in _procs(Path(folder))})


def on_this_machine(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> bool:
    """Whether the pod's cgroup is here, so the functions of this module can act on it."""
    try:
        pod_cgroup(pod, layout=layout)
    except (NotOnThisNode, KeyError):
        return False
    return True


def signal_container(pod: Pod, container: str, signum: int, *, layout: NodeLayout = DEFAULT_LAYOUT) -> list[int]:
    """Send ``signum`` to every process of ``container`` and return their PIDs.

    SIGKILL and SIGSTOP reach a container's PID 1 from the host (the host's PID namespace is
    its ancestor); other signals reach it only if it handles them. Processes forked while the
    signal goes out are caught by another round, so a SIGKILL or SIGSTOP leaves none behind.
    After SIGSTOP it returns once every one of them is stopped (delivery is asynchronous)."""
    sent: set[int] = set()
    for _ in range(5):
        try:
            found = container_pids(pod, container, layout=layout)
        except NotOnThisNode:
            if sent:
                break  # the signal ended the container, and its cgroup went with it
            raise
        pending = [pid for pid in found if pid not in sent]
        if not pending:
            break
        for pid in pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
            sent.add(pid)
    if not sent:
        raise NotOnThisNode(f"container {container!r} of pod {_name(pod)} has no process")
    if signum == signal.SIGSTOP:
        deadline = time.monotonic() + 5
        while (running := [pid for pid in sent if _task_state(pid) not in ("T", "t", "Z", None)]) \
                and time.monotonic() < deadline:
            time.sleep(0.002)
        if running:
            raise TimeoutError(f"pod {_name(pod)}: {running} of {container!r} not stopped 5 s after SIGSTOP")
    return sorted(sent)


def container_main_pid(pod: Pod, container: str, *, layout: NodeLayout = DEFAULT_LAYOUT) -> int:
    """The host PID of ``container``'s main process: PID 1 of its PID namespace (``NSpid`` in
    /proc/<pid>/status), not one of the processes an exec probe or ``kubectl exec`` started in it."""
    for pid in container_pids(pod, container, layout=layout):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == "1":
                    return pid
    raise NotOnThisNode(f"container {container!r} of pod {_name(pod)} has no main process")


def _task_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z…), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# --- freezing the whole pod ----------------------------------------------------------------


def _freezer(pod: Pod, layout: NodeLayout) -> Path:
    return pod_cgroup(pod, layout=layout, hierarchy="freezer") / "freezer.state"


def freezer_state(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> str:
    """``THAWED``, ``FREEZING`` or ``FROZEN``."""
    return _freezer(pod, layout).read_text().strip()


def _set_freezer(pod: Pod, state: str, layout: NodeLayout, timeout: float) -> None:
    path = _freezer(pod, layout)
    deadline = time.monotonic() + timeout
    path.write_text(state)
    # FREEZING lasts until every task has stopped; writing again retries the stragglers.
    while (current := path.read_text().strip()) != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pod {_name(pod)}: freezer.state is {current}, not {state}, after {timeout:g} s")
        time.sleep(0.005)
        path.write_text(state)


def freeze_pod(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT, timeout: float = 10.0) -> None:
    """Stop every process of the pod at once (v1 freezer, the whole subtree), as a paused VM
    or a stalled machine would; returns once all are frozen.

    A frozen process does not die of SIGKILL until thawed: thaw before deleting the pod (or use
    ``frozen_pod``); the node thaws what is left when it stops."""
    _set_freezer(pod, "FROZEN", layout, timeout)


def thaw_pod(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT, timeout: float = 10.0) -> None:
    _set_freezer(pod, "THAWED", layout, timeout)


@contextlib.contextmanager
def frozen_pod(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> Iterator[None]:
    """``with frozen_pod(pod): ...``: frozen inside, thawed on the way out whatever happens."""
    freeze_pod(pod, layout=layout)
    try:
        yield
    finally:
        with contextlib.suppress(NotOnThisNode):  # gone meanwhile: nothing left to thaw
            thaw_pod(pod, layout=layout)


# --- the pod's network namespace -----------------------------------------------------------


def sandbox_pid(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> int:
    """The pod's pause process, which holds its network namespace for the pod's whole life
    (containers come and go; it stays)."""
    top = pod_cgroup(pod, layout=layout)
    for child in sorted(p for p in top.iterdir() if p.is_dir()):
        for pid in _procs(child):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"/pause":
                    return pid
    raise NotOnThisNode(f"pod {_name(pod)} has no pause process in {top}")


def pod_netns(pod: Pod, *, layout: NodeLayout = DEFAULT_LAYOUT) -> Path:
    """``/proc/<pause PID>/ns/net``: for ``nsenter --net=...`` or ``setns``."""
    return Path(f"/proc/{sandbox_pid(pod, layout=layout)}/ns/net")


def in_pod_netns(pod: Pod, *argv: str, layout: NodeLayout = DEFAULT_LAYOUT) -> list[str]:
    """The command line that runs ``argv`` (a host program) inside the pod's network namespace."""
    return ["nsenter", f"--net={pod_netns(pod, layout=layout)}", "--", *argv]


def _iptables(pod: Pod, *args: str, layout: NodeLayout, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(in_pod_netns(pod, "iptables", "-w", *args, layout=layout),
                            capture_output=True, text=True, check=False, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)} in pod {_name(pod)}: {result.stderr.strip()}")
    return result


def _rules(target: str, mode: str, port: int | None = None) -> list[list[str]]:
    address = str(ipaddress.IPv4Address(target))
    mark = ["-m", "comment", "--comment", PARTITION_COMMENT]
    to_port = [] if port is None else ["-p", "tcp", "--dport", str(port)]
    from_port = [] if port is None else ["-p", "tcp", "--sport", str(port)]
    if mode == "drop":
        # Both ways, silently: connects and open connections hang until their own timeouts,
        # and replies to the target's inbound connections are lost too.
        return [["OUTPUT", "-d", address, *to_port, *mark, "-j", "DROP"],
                ["INPUT", "-s", address, *from_port, *mark, "-j", "DROP"]]
    if mode == "reject":
        # Connects fail at once with EHOSTUNREACH, as with an unreachable route.
        return [["OUTPUT", "-d", address, *to_port, *mark, "-j", "REJECT", "--reject-with", "icmp-host-unreachable"]]
    raise ValueError(f"partition mode must be 'drop' or 'reject', not {mode!r}")


def partition(pod: Pod, target: str, *, mode: str = "drop", port: int | None = None,
              layout: NodeLayout = DEFAULT_LAYOUT) -> None:
    """Cut the pod's traffic with ``target`` (an IPv4 address: the node IP for the API server
    and PostgreSQL, a pod IP, a ClusterIP — matched before the host's kube-proxy translates it),
    or only its TCP ``port`` there (the node IP also carries the kubelet's probes).
    ``drop``: packets vanish both ways; ``reject``: connects fail at once. Idempotent."""
    for rule in _rules(target, mode, port):
        if _iptables(pod, "-C", *rule, layout=layout, check=False).returncode != 0:
            _iptables(pod, "-I", *rule, layout=layout)


def heal(pod: Pod, target: str, *, port: int | None = None, layout: NodeLayout = DEFAULT_LAYOUT) -> None:
    """Undo ``partition`` for ``target`` (and ``port``), whichever mode (no error when it was not cut)."""
    for mode in ("drop", "reject"):
        for rule in _rules(target, mode, port):
            while _iptables(pod, "-D", *rule, layout=layout, check=False).returncode == 0:
                pass  # a rule added twice (by hand) is removed twice


def _name(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"


__all__ = [
    "NotOnThisNode", "Pod", "container_cgroup", "container_id", "container_main_pid", "container_pids", "freeze_pod",
    "freezer_state", "frozen_pod", "heal", "in_pod_netns", "on_this_machine", "partition", "pod_cgroup", "pod_netns",
    "pod_pids", "sandbox_pid", "signal_container", "thaw_pod",
]
