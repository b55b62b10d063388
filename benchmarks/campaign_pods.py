"""What the campaign does to a pod's processes on the real node, from the host, by the kernel's
own handles (``singleton_testbed.node_pods``): freeze the whole pod and thaw it in the worst
order for a gate, and talk to a sidecar's control port, which listens on the pod's loopback only.

Freezing is the v1 freezer cgroup of the pod: every process of every container (the exec
gate's keeper and app, ``gate.sh``'s app, the app's children, escaped sessions included) stops
at once, as in a paused VM or a stalled machine. Thawing resumes the *app* first (every process
outside the process groups of the pod's containers' main processes: the exec gate's app and its
children, ``gate.sh``'s app) and the rest (sidecars, keepers, ``gate.sh``) ``stagger`` seconds
later: the worst order for a gate, which then cannot stop the app before the app runs again. An
app must not begin an act once its term's deadline passed; an act it was in the middle of when
frozen is finished on waking whatever anyone does.

The staggered thaw: while the pod is frozen, the gates' processes are sent SIGSTOP, which
stays pending (a frozen task handles no signal); on thawing they leave the freezer straight into
that signal and stop before running a single instruction of their own, while the app runs on;
``stagger`` seconds later they get SIGCONT.
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

from singleton_testbed import node_pods
from singleton_testbed.node_config import NodeLayout

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


@dataclass(frozen=True)
class Frozen:
    """A pod frozen whole: the pod object, and the processes thawed last (its containers'
    main processes' process groups)."""

    pod: node_pods.Pod
    gates: tuple[int, ...]
    processes: int
    """How many processes were frozen (the pause process included)."""


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _signal(pids: tuple[int, ...], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def freeze_pod(pod: node_pods.Pod, containers: list[str], layout: NodeLayout) -> Frozen:
    """Freeze every process of ``pod``; ``containers``: the containers whose main processes'
    process groups are the gates (thawed last)."""
    # Found before freezing: a container the API does not list yet (its ID lags after an API
    # server restart) fails here, not as a freeze undone at once, retried, and undone again.
    mains = {name: node_pods.container_main_pid(pod, name, layout=layout) for name in containers}
    try:
        node_pods.freeze_pod(pod, layout=layout)
        everything = node_pods.pod_pids(pod, layout=layout)
        if gone := sorted(name for name, pid in mains.items() if pid not in everything):
            name = (pod.get("metadata") or {}).get("name")
            raise node_pods.NotOnThisNode(f"pod {name}: {gone} restarted while being frozen")
    except BaseException:  # never leave it frozen (or stuck FREEZING): a frozen pod cannot end
        with contextlib.suppress(node_pods.NotOnThisNode, TimeoutError, OSError):
            node_pods.thaw_pod(pod, layout=layout)
        raise
    groups = {_pgid(pid) for pid in mains.values()}
    gates = tuple(pid for pid in everything if _pgid(pid) in groups)
    return Frozen(pod, gates, len(everything))


def thaw_pod(frozen: Frozen, stagger: float, layout: NodeLayout) -> None:
    """Thaw: the app at once, the gates ``stagger`` seconds later (see the module docstring).
    Also when the pod's cgroup is gone meanwhile (nothing left to thaw)."""
    _signal(frozen.gates, signal.SIGSTOP)
    try:
        with contextlib.suppress(node_pods.NotOnThisNode):
            node_pods.thaw_pod(frozen.pod, layout=layout)
        if stagger > 0:
            time.sleep(stagger)
    finally:
        _signal(frozen.gates, signal.SIGCONT)


def loopback_request(netns: Path, port: int, method: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """An HTTP request to ``127.0.0.1:<port>`` inside the network namespace ``netns`` (a pod's:
    ``node_pods.pod_netns``; the sidecar's control port listens on the pod's loopback only), as
    ``kubectl exec POD -- curl`` would without needing curl in the image.

    Made from a thread of its own that enters the namespace (``setns`` moves only the calling
    thread) and ends with the request. Raises ``OSError`` when it cannot connect."""
    result: list[tuple[int, str]] = []
    failure: list[Exception] = []

    def run() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
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
