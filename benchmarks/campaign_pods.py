"""What the campaign does to a pod's processes from the host, as a container runtime could:
find every process of a pod (its network namespace), freeze the whole pod and thaw it, and
talk to a sidecar's control port, which listens on the pod's loopback only.

A pod's processes are those whose network namespace is the pod's (``/run/netns/<name>``): every
container of the pod, every process they started (the exec gate's keeper and app, ``gate.sh``'s
app, the app's children), escaped sessions included. Nothing else shares it.

Freezing is SIGSTOP to each of them, repeated until all are stopped (a process forked meanwhile is
caught on the next pass): what a cgroup freeze does, one process at a time. Thawing resumes the
*app* first (every process outside the process groups of the pod's containers' main processes:
the exec gate's app and its children, ``gate.sh``'s app) and the rest (sidecars, keepers,
``gate.sh``) ``stagger`` seconds later: the worst order for a gate, which then cannot stop the
app before the app runs again. An app must not begin an act once its term's deadline passed; an
act it was in the middle of when frozen is finished on waking whatever anyone does.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from singleton_testbed.netns import NETNS_DIR, namespace_id

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


@dataclass(frozen=True)
class Proc:
    pid: int
    state: str
    ppid: int
    pgid: int


def _stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return Proc(pid, fields[0], int(fields[1]), int(fields[2]))


def pod_processes(netns: str) -> list[Proc]:
    """Every live process (zombies excluded) in the network namespace ``/run/netns/<netns>``."""
    target = namespace_id(NETNS_DIR / netns)
    if target is None or target == namespace_id("/proc/self/ns/net"):
        return []  # never the host's own namespace
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and namespace_id(f"/proc/{entry.name}/ns/net") == target:
            proc = _stat(int(entry.name))
            if proc is not None and proc.state != "Z":
                found.append(proc)
    return found


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def freeze_pod(netns: str, timeout: float = 2.0) -> int:
    """SIGSTOP every process of the pod until all are stopped; returns how many were stopped."""
    deadline = time.monotonic() + timeout
    sent: set[int] = set()
    while True:
        running = [p for p in pod_processes(netns) if p.state not in ("T", "t")]
        for proc in running:
            if proc.pid not in sent:
                _signal(proc.pid, signal.SIGSTOP)
                sent.add(proc.pid)
        if not running or time.monotonic() > deadline:
            return len(sent)
        time.sleep(0.001)  # a stop takes effect when the process is next scheduled


def thaw_pod(netns: str, container_pids: list[int], stagger: float) -> None:
    """SIGCONT the app's processes first, everything else of the pod ``stagger`` seconds later."""
    gates = {p.pgid for p in pod_processes(netns) if p.pid in container_pids}
    first = [p.pid for p in pod_processes(netns) if p.pgid not in gates]
    for pid in first:
        _signal(pid, signal.SIGCONT)
    if first and stagger > 0:
        time.sleep(stagger)
    for _ in range(3):  # anything forked while it was being thawed, too
        for proc in pod_processes(netns):
            _signal(proc.pid, signal.SIGCONT)
        if not any(p.state in ("T", "t") for p in pod_processes(netns)):
            return
        time.sleep(0.01)


def loopback_request(netns: str, port: int, method: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """An HTTP request to ``127.0.0.1:<port>`` inside the pod's network namespace (the sidecar's
    control port listens on the pod's loopback only), as ``kubectl exec POD -- curl`` would.

    Made from a thread of its own that enters the namespace (``setns`` moves only the calling
    thread) and ends with the request. Raises ``OSError`` when it cannot connect."""
    result: list[tuple[int, str]] = []
    failure: list[Exception] = []

    def run() -> None:
        try:
            fd = os.open(Path(NETNS_DIR) / netns, os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({netns}): {os.strerror(errno)}")
            finally:
                os.close(fd)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            try:
                conn.request(method, path)
                response = conn.getresponse()
                result.append((response.status, response.read().decode(errors="replace")))
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"loopback {netns}", daemon=True)
    thread.start()
    thread.join(timeout + 1)
    if failure:
        raise failure[0]
    if not result:
        raise OSError(f"no answer from 127.0.0.1:{port}{path} in {netns} within {timeout:g}s")
    return result[0]
