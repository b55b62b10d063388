"""Handover and failover on the real node: pods of the project's image, made by the operator.

    sudo .venv/bin/python -m benchmarks.node_failover --runs 10 [--backend postgres lease both]
        [--fault delete-pod evict-pod sidecar-kill sidecar-kill-again pod-kill partition] [--gating cooperative|file]
        [--runs-per-fault [BACKEND/]FAULT=N ...] [--json F]

Root only (the real node: containerd, kubelet, kube-proxy; ``singleton_testbed.node``). It
starts its own PostgreSQL (admitting the pod network), control plane and controllers, the
node, the project's image (built from the Dockerfile, cached) and the operator. Per backend,
one ``SingletonService`` of 3 replicas with the backend's default timings and an app
container (busybox) that exits at once on SIGTERM, gated cooperatively (the default: the app
registers nothing, so the sidecar waits for the kubelet to say it exited) or by the file gate
(``--gating file``: gate.sh says when it stopped). Per run, watched from this machine (pod
IPs route through the node's bridge) by polling every pod's ``/readyz`` every few ms:

- pod deletion: ``DELETE`` of the leader pod (graceful) -> another pod's ``/readyz`` 200;
- eviction: the same through the Eviction API (``POST .../pods/<leader>/eviction``, which the
  group's PodDisruptionBudget may refuse for a while: the run begins at the accepted one);
- sidecar SIGKILL: every process of the leader's sidecar container (``node_pods``) -> a
  pod's ``/readyz`` 200 with a newer token (the restarted sidecar of the same pod may win).
  The container killed has never restarted before (a leader whose sidecar has is deleted
  first, and its ReplicaSet makes a new pod): the kubelet delays restarting a container that
  crashed within 10 minutes of its previous crash (its crash-loop back-off: 10 s doubling up to
  5 min by default, capped at 1 s on the test bed), which is policy, not failover. With
  ``--crash-loop`` the same leader container is killed run after run instead, back-off included;
- sidecar SIGKILL again (``sidecar-kill-again``, not in the default faults): the same, the
  leader's sidecar container killed whether or not it restarted before (``--crash-loop`` for
  this fault alone); each run records how often that container had restarted;
- pod SIGKILL (``pod-kill``, not in the default faults): every process of the leader pod's
  app and sidecar containers stopped (SIGSTOP, so that neither outlives the other) and then
  SIGKILLed, as in a crash of the whole pod -> a pod's ``/readyz`` 200 with a newer token. The
  other pods cannot know that the dead leader's app stopped: they wait for its term to lapse,
  while its own restarted sidecar may lead again sooner. The pod has crashed never before, as
  for sidecar-kill;
- partition: the leader pod cut off from its store inside its network namespace (postgres:
  PostgreSQL's port; lease: the API server's ClusterIP; both: both) -> another pod's
  ``/readyz`` 200; then healed, and the group settles before the next run.

Before the faults, each backend's group rests ``--rest-seconds`` once settled (every
sidecar scraped by this machine once a second, as Prometheus does), and the
footprint of every pod's sidecar as a user gets it (the image, in-cluster configuration) is
read on the node: the RSS of the container's main process, and the time from that process's
start (``/proc/<pid>/stat``) to the sidecar's first log line (imports and configuration: it
campaigns next). The group's API requests during that rest are counted too: distinct auditIDs
of the user agent ``singleton-sidecar`` in the API server's audit log (Lease, own pod, events).

Deletions and evictions are also split into the steps the sidecars log (``PHASES``) and end
at the new leader's app acting: with ``--gating file`` the app (started by gate.sh on the
leader only) prints "acting" first, and its line's time in the container log on the node is
when it began; that, not the ``/readyz`` this machine sees a little later, is what issue 31's
goals name.

Prints medians and p99 (nearest rank) per backend and fault, and each run's figure.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.compare_clientgo import SIDECAR_AGENT, audit_size, count_requests
from benchmarks.failover import rss_mb, summary
from singleton_election import contract
from singleton_testbed import images, node_pods
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ClusterInfo, ControlPlane, wait_established
from singleton_testbed.harness.kubehelpers import save_pod_logs
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import PROMETHEUS_ACCEPT
from singleton_testbed.node import Node
from singleton_testbed.node_config import NodeLayout
from singleton_testbed.oci import busybox_image, write_archive
from singleton_testbed.postgres import PostgresInfo, PostgresServer

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "singleton.dev_singletonservices.yaml"
FAULTS = ("delete-pod", "evict-pod", "sidecar-kill", "sidecar-kill-again", "pod-kill", "partition")
DEFAULT_FAULTS = ("delete-pod", "evict-pod", "sidecar-kill", "partition")
KILLS = ("sidecar-kill", "sidecar-kill-again", "pod-kill")
POD_CONTAINERS = ("app", "singleton-sidecar")
"""A pod-kill's containers: the app's and the sidecar's (the group's pod template)."""
NAMESPACE = "bench"
SIDECAR_PORT = 7450
POLL = 0.003  # the default of --poll-ms


@dataclass
class Run:
    backend: str
    fault: str
    seconds: float
    old: str
    new: str
    restart: float | None = None
    """sidecar-kill, the same pod leading again: SIGKILL -> the new incarnation's first log line
    (the kubelet noticing and restarting the container, and Python starting)."""
    start_to_lead: float | None = None
    """... -> that incarnation's log line saying it acquired the lock."""
    restarts_before: int = 0
    """sidecar-kill: how often the killed container had restarted before (0: an isolated crash)."""
    phases: dict[str, float] | None = None
    """delete-pod, evict-pod: seconds from the fault to each step of the handover, read from the
    sidecars' logs on the node (``PHASES``); a step not logged is missing."""


@dataclass
class Footprint:
    backend: str
    pod: str
    leader: bool
    rss_mb: float
    """VmRSS of the sidecar container's main process after the rest."""
    start_seconds: float | None
    """That process's start -> its first log line."""


@dataclass
class AtRest:
    """A backend's group of 3 at rest, its sidecars scraped once a second: their API requests."""

    backend: str
    seconds: float
    requests: int
    """Distinct auditIDs of the user agent ``singleton-sidecar`` (every pod's sidecar)."""
    by_kind: dict[str, int]

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


class Bed:
    """Everything the benchmark starts, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.layout = NodeLayout()
        binaries = find_all()
        add_to_path(binaries)
        self.postgres = PostgresServer(serve_pods=True)
        self.control_plane = ControlPlane(binaries, advertise_address=self.layout.node_ip)
        self.node = Node(self.control_plane, binaries, layout=self.layout)
        self.operator: OperatorProcess | None = None
        self.info: ClusterInfo | None = None
        self.pg: PostgresInfo | None = None
        self.image = ""
        self.busybox = ""

    def start(self) -> None:
        self.pg = self.postgres.start()
        self.info = self.control_plane.start()
        self.control_plane.start_controllers()
        print("[bench] building (or finding) the project's image", file=sys.stderr, flush=True)
        archive, self.image = images.build_project_image()
        self.node.start()
        self.node.import_image(archive)
        busybox = busybox_image()
        self.busybox = busybox.name
        self.node.import_image(write_archive(busybox, self.workdir / "busybox.tar"))
        kubectl = self.control_plane.kubectl
        kubectl("apply", "--server-side", "-f", str(CRD))
        wait_established(kubectl, "crd/singletonservices.singleton.dev")
        kubectl("create", "namespace", NAMESPACE)
        kubectl("create", "serviceaccount", "default", "-n", NAMESPACE, check=False)
        pod_dsn = PostgresInfo(host=self.layout.node_ip, port=self.pg.port, superuser=self.pg.superuser).dsn
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db", "namespace": NAMESPACE},
                  "data": {"dsn": base64.b64encode(pod_dsn.encode()).decode()}}
        kubectl("apply", "-f", "-", input_text=json.dumps(secret))
        self.operator = OperatorProcess(self.info.kubeconfig, NAMESPACE, self.workdir / "operator.log",
                                        extra_args=["--namespace", NAMESPACE, "--sidecar-image", self.image]).start()

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.node.stop()
        self.control_plane.stop()
        self.postgres.cleanup()

    # --- the API, directly (kubectl's start would blur the figures) ---------------------

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self.info is not None
        request = urllib.request.Request(self.info.server + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.info.token}",
                                                  "Content-Type": "application/json"})
        context = ssl.create_default_context(cafile=str(self.info.ca_file))
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return json.loads(response.read())

    def pods(self, group: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.api(
            "GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={contract.LABEL_GROUP}%3D{group}")["items"]
        return found


def leader_doc(ip: str) -> dict[str, Any] | None:
    """The sidecar's ``/leader`` when its ``/readyz`` says it leads, else None."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/readyz", timeout=0.5) as response:
            if response.status != 200:
                return None
        with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/leader", timeout=0.5) as response:
            doc: dict[str, Any] = json.loads(response.read())
            return doc
    except (urllib.error.URLError, OSError, ValueError):
        return None


def scrape_during(bed: Bed, group: str, seconds: float) -> None:
    """Scrape every pod's ``/metrics`` as Prometheus does, once a second for ``seconds``: a
    sidecar at rest is a scraped one."""
    ips = [p["status"]["podIP"] for p in live_pods(bed.pods(group))]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for ip in ips:
            request = urllib.request.Request(f"http://{ip}:{SIDECAR_PORT}/metrics",
                                             headers={"Accept": PROMETHEUS_ACCEPT})
            with urllib.request.urlopen(request, timeout=2) as response:
                kind = response.headers["Content-Type"]
                if not kind.startswith("application/openmetrics-text;"):
                    raise AssertionError(f"{ip}: /metrics answered {kind} to Prometheus's Accept")
                response.read()
        time.sleep(max(0.0, min(1.0, end - time.monotonic())))


def live_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")]


def all_ready(pod: dict[str, Any]) -> bool:
    statuses = [*(pod["status"].get("initContainerStatuses") or []), *(pod["status"].get("containerStatuses") or [])]
    return bool(statuses) and all(s.get("ready") for s in statuses)


def settle(bed: Bed, group: str, timeout: float = 180) -> tuple[dict[str, Any], int]:
    """The leader pod and its token once 3 pods are ready and exactly one leads."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = live_pods(bed.pods(group))
        if len(pods) == 3 and all(all_ready(p) for p in pods):
            leading = [(p, doc) for p in pods if (doc := leader_doc(p["status"]["podIP"])) is not None]
            if len(leading) == 1:
                return leading[0][0], int(leading[0][1]["token"])
        time.sleep(0.3)
    raise TimeoutError(f"group {group} did not settle in {timeout:.0f}s")


def wait_new_leader(bed: Bed, group: str, old_token: int, *, exclude: str | None,
                    poll: float = POLL, timeout: float = 60) -> tuple[str, float]:
    """The first pod (name) whose sidecar leads with a token newer than ``old_token``, and when.
    Every pod of the group counts but ``exclude`` (the deleted or cut-off one), a replacement
    pod too: its sidecar may win the lock. The pod list is read anew every 0.25 s."""
    deadline = time.monotonic() + timeout
    ips: dict[str, str] = {}
    listed = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - listed > 0.25:
            ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in live_pods(bed.pods(group))
                   if p["metadata"]["name"] != exclude}
            listed = time.monotonic()
        for name, ip in ips.items():
            doc = leader_doc(ip)
            if doc is not None and int(doc.get("token") or 0) > old_token:
                return name, time.monotonic()
        time.sleep(poll)
    raise TimeoutError(f"no new leader within {timeout:.0f}s: {({n: describe(ip) for n, ip in ips.items()})}")


def describe(ip: str) -> str:
    """What a sidecar says, for an error message."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/leader", timeout=0.5) as response:
            return str(response.read()[:300])
    except (urllib.error.URLError, OSError) as exc:
        return repr(exc)


def group_manifest(bed: Bed, backend: str, gating: str = "cooperative", app_cpu: str | None = None) -> dict[str, Any]:
    """The group: 3 replicas of a busybox app; ``app_cpu``: the app container's CPU request (none:
    its cgroup gets the kernel's least CPU share while the sidecar's 10m request is busy beside it)."""
    app: dict[str, Any] = {
        "name": "app", "image": bed.busybox, "imagePullPolicy": "Never",
        # "acting" first: its line's time in the container's log is when this app began to act
        # (file gate: gate.sh starts it on the leader only). The sleep in the background: a shell
        # runs its trap only once a foreground command ends, so `sleep 0.1` in the foreground
        # made the app take up to 0.1 s to exit on SIGTERM.
        "command": ["sh", "-c", "echo acting; trap 'exit 0' TERM; while true; do sleep 0.1 & wait $!; done"]}
    if app_cpu is not None:
        app["resources"] = {"requests": {"cpu": app_cpu}}
    spec: dict[str, Any] = {"replicas": 3, "backend": backend, "template": {"spec": {"containers": [app]}}}
    if gating != "cooperative":
        spec["gating"] = {"mode": gating}
    if backend != "lease":
        spec["postgres"] = {"secretRef": {"name": "db"}}
    return {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
            "metadata": {"name": f"bench-{backend}", "namespace": NAMESPACE}, "spec": spec}


def cut_targets(bed: Bed, backend: str) -> list[tuple[str, int | None]]:
    """What a partition cuts the leader pod off from: (address, port) as the pod dials them."""
    assert bed.pg is not None
    api = bed.api("GET", "/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
    postgres: list[tuple[str, int | None]] = [(bed.layout.node_ip, bed.pg.port)]
    lease: list[tuple[str, int | None]] = [(api, None)]
    return {"postgres": postgres, "lease": lease}.get(backend, postgres + lease)


def sidecar_restarts(pod: dict[str, Any]) -> int:
    """The restart count of the pod's sidecar container (a native sidecar: an init container)."""
    statuses = [*(pod["status"].get("initContainerStatuses") or []), *(pod["status"].get("containerStatuses") or [])]
    return sum(int(s.get("restartCount") or 0) for s in statuses if s.get("name") == "singleton-sidecar")


def settle_on_fresh_sidecar(bed: Bed, group: str) -> tuple[dict[str, Any], int]:
    """``settle``, on a leader whose sidecar container has never restarted: a leader whose
    sidecar has is deleted (the group hands over; its ReplicaSet makes a new pod) until one leads."""
    for _ in range(8):
        leader, token = settle(bed, group)
        if sidecar_restarts(leader) == 0:
            return leader, token
        bed.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{leader['metadata']['name']}")
    raise TimeoutError(f"group {group}: no leader on a pod whose sidecar never restarted after 8 deletions")


# The steps of a handover at a pod's deletion, as the sidecars log them: (name, whose log, what
# the JSON line says). The old leader's steps come from the deleted pod, the last from the new one.
PHASES: tuple[tuple[str, str, Callable[[dict[str, Any]], bool]], ...] = (
    ("old drains", "old", lambda doc: doc.get("msg") == "drain requested"),
    ("old app stopped", "old", lambda doc: str(doc.get("msg", "")).startswith(
        ("draining: the gate says the app has stopped", "app stopped"))),
    ("old released", "old", lambda doc: doc.get("msg") == "released"),
    ("new leads", "new", lambda doc: str(doc.get("msg", "")).startswith("role") and doc.get("role") == "leader"),
)


class HeldLogs:
    """The sidecar's and the app's log files of a group's pods, opened before a fault: the
    kubelet removes a deleted pod's files with the pod, and an open handle still reads them."""

    def __init__(self, bed: Bed, pods: list[dict[str, Any]]) -> None:
        self.handles: dict[tuple[str, str], Any] = {}
        for pod in pods:
            meta = pod["metadata"]
            for container in ("singleton-sidecar", "app"):
                folder = bed.node.paths.pod_logs / f"{NAMESPACE}_{meta['name']}_{meta['uid']}" / container
                files = sorted(folder.glob("*.log"), key=lambda f: f.stat().st_mtime)
                # The app of a standby behind the file gate has not started: no file yet, and the
                # kubelet names its first one 0.log.
                path = files[-1] if files else folder / "0.log"
                if path.exists():
                    handle = path.open("rb")
                    handle.seek(0, os.SEEK_END)
                    self.handles[meta["name"], container] = handle
                else:
                    self.handles[meta["name"], container] = path

    def lines_since(self, pod: str) -> list[dict[str, Any]]:
        """The JSON log lines the pod's sidecar wrote since the files were opened (CRI format:
        ``<time> <stream> <tag> <line>``)."""
        docs = []
        for _, line in self._cri_lines(pod, "singleton-sidecar"):
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and _doc_time(doc) is not None:
                    docs.append(doc)
        return docs

    def app_acting(self, pod: str) -> float | None:
        """When the pod's app printed "acting" since the files were opened: the time the node's
        containerd stamped on the line (wall clock, read from the app's stdout as it came)."""
        return next((stamp for stamp, line in self._cri_lines(pod, "app") if line == "acting"), None)

    def _cri_lines(self, pod: str, container: str) -> list[tuple[float, str]]:
        held = self.handles.get((pod, container))
        if isinstance(held, Path):  # not there at the fault: a file begun since holds only new lines
            if not held.exists():
                return []
            held = self.handles[pod, container] = held.open("rb")
        if held is None:  # not a pod of the group at the fault (the ReplicaSet's replacement)
            return []
        found = []
        for raw in held.read().decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError, IndexError):
                stamp, _, _, line = raw.split(" ", 3)
                found.append((_cri_time(stamp), line))
        return found

    def close(self) -> None:
        for handle in self.handles.values():
            if not isinstance(handle, Path):
                handle.close()


def handover_phases(held: HeldLogs, old: str, new: str, fault_at: float) -> dict[str, float]:
    """Seconds from the fault (wall clock) to each of ``PHASES``, the first matching line each."""
    time.sleep(0.3)  # the last lines reach the node's log files a little after the fact
    lines = {"old": held.lines_since(old), "new": held.lines_since(new)}
    found: dict[str, float] = {}
    for name, whose, matches in PHASES:
        stamp = next((t for doc in lines[whose] if matches(doc) and (t := _doc_time(doc)) is not None), None)
        if stamp is not None:
            found[name] = stamp - fault_at
    acting = held.app_acting(new)
    if acting is not None:
        found["new app acting"] = acting - fault_at
    return found


def one_run(bed: Bed, backend: str, fault: str, *, crash_loop: bool = False, poll: float = POLL) -> Run:
    group = f"bench-{backend}"
    fresh = fault in ("sidecar-kill", "pod-kill") and not crash_loop  # sidecar-kill-again: a crash loop's kill
    leader, token = settle_on_fresh_sidecar(bed, group) if fresh else settle(bed, group)
    name = leader["metadata"]["name"]
    if fault in ("delete-pod", "evict-pod"):
        held = HeldLogs(bed, live_pods(bed.pods(group)))
        try:
            if fault == "delete-pod":
                started, fault_at = time.monotonic(), time.time()
                bed.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
            else:
                started = evict(bed, name)
                fault_at = time.time() - (time.monotonic() - started)
            new, at = wait_new_leader(bed, group, token, exclude=name, poll=poll)
            phases = handover_phases(held, name, new, fault_at)
        finally:
            held.close()
        phases["new ready seen"] = at - started
        return Run(backend, fault, at - started, name, new, phases=phases)
    elif fault in KILLS:
        containers = POD_CONTAINERS if fault == "pod-kill" else ("singleton-sidecar",)
        for container in containers:  # all stopped first: one instant for the whole pod
            node_pods.signal_container(leader, container, signal.SIGSTOP, layout=bed.layout)
        for container in containers:
            node_pods.signal_container(leader, container, signal.SIGKILL, layout=bed.layout)
        started, killed = time.monotonic(), time.time()
        new, at = wait_new_leader(bed, group, token, exclude=None, poll=poll)
        if new == name:
            restart, start_to_lead = incarnation_times(bed, name, killed)
            return Run(backend, fault, at - started, name, new, restart, start_to_lead, sidecar_restarts(leader))
        return Run(backend, fault, at - started, name, new, restarts_before=sidecar_restarts(leader))
    else:
        targets = cut_targets(bed, backend)
        for address, port in targets:
            node_pods.partition(leader, address, port=port, layout=bed.layout)
        started = time.monotonic()
        try:
            new, at = wait_new_leader(bed, group, token, exclude=name, poll=poll)
        finally:
            for address, port in targets:
                node_pods.heal(leader, address, port=port, layout=bed.layout)
    return Run(backend, fault, at - started, name, new)


def evict(bed: Bed, pod: str, timeout: float = 60.0) -> float:
    """Evict ``pod`` through the Eviction API; returns when the eviction was accepted (a 429
    from the PodDisruptionBudget, while a replacement is not ready yet, is tried again)."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NAMESPACE}}
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        try:
            bed.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/eviction", body)
            return started
        except urllib.error.HTTPError as exc:
            if exc.code != 429 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _log_time(line: str) -> float | None:
    """The wall-clock time of a sidecar's JSON log line (its ``time`` field), or None."""
    with contextlib.suppress(ValueError):
        return _doc_time(json.loads(line))
    return None


CRI_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def _cri_time(stamp: str) -> float:
    """A CRI log line's RFC 3339 time (containerd writes local time with its offset, or Z),
    nanoseconds cut to the microseconds Python parses; ValueError if it is none."""
    found = CRI_TIME.match(stamp)
    if found is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    whole, fraction, zone = found.groups()
    offset = "+00:00" if zone == "Z" else zone
    return datetime.fromisoformat(f"{whole}.{((fraction or '') + '000000')[:6]}{offset}").timestamp()


def _doc_time(doc: Any) -> float | None:
    """The wall-clock time of a sidecar's parsed log line, or None."""
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        return datetime.fromisoformat(doc["time"].replace("Z", "+00:00")).timestamp()
    return None


def sidecar_log_times(bed: Bed, pod: str) -> list[tuple[float, str]]:
    """(time, line) of the JSON log lines of the pod's current sidecar container."""
    assert bed.info is not None
    request = urllib.request.Request(
        f"{bed.info.server}/api/v1/namespaces/{NAMESPACE}/pods/{pod}/log?container=singleton-sidecar",
        headers={"Authorization": f"Bearer {bed.info.token}"})
    context = ssl.create_default_context(cafile=str(bed.info.ca_file))
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        lines = response.read().decode(errors="replace").splitlines()
    return [(stamp, line) for line in lines if (stamp := _log_time(line)) is not None]


def process_start(pid: int) -> float:
    """The wall-clock start of a process: now, less the time since its start (its start in
    clock ticks after boot against ``/proc/uptime``; ``btime`` is whole seconds, too coarse)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    now, uptime = time.time(), float(Path("/proc/uptime").read_text().split()[0])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def footprints(bed: Bed, backend: str, rest: float) -> tuple[list[Footprint], AtRest]:
    """Every pod's sidecar after ``rest`` seconds of the settled group, and the group's API
    requests during them (see the module docstring)."""
    leader, _ = settle(bed, f"bench-{backend}")
    audit_from = audit_size(bed.control_plane)
    scrape_during(bed, f"bench-{backend}", rest)
    requests, kinds = count_requests(bed.control_plane, audit_from, audit_size(bed.control_plane), SIDECAR_AGENT)
    at_rest = AtRest(backend, rest, requests, kinds)
    print(f"[{backend:8} at rest] {at_rest.per_second:.3f} API requests/s over {rest:g} s: "
          + ", ".join(f"{kind}: {count}" for kind, count in kinds.items()), flush=True)
    found = []
    for pod in live_pods(bed.pods(f"bench-{backend}")):
        name = pod["metadata"]["name"]
        pid = node_pods.container_main_pid(pod, "singleton-sidecar", layout=bed.layout)
        times = sidecar_log_times(bed, name)
        start = times[0][0] - process_start(pid) if times else None
        found.append(footprint := Footprint(backend, name, name == leader["metadata"]["name"], rss_mb(pid), start))
        shown = "?" if start is None else f"{start * 1000:.0f} ms"
        print(f"[{backend:8} footprint] {name} ({'leader' if footprint.leader else 'standby'}): "
              f"{footprint.rss_mb:.1f} MB at rest, process start -> first log line {shown}", flush=True)
    return found, at_rest


def print_footprints(backends: list[str], rest: float, found: list[Footprint], at_rest: list[AtRest]) -> None:
    if not found:
        return
    print(f"\nthe sidecars in the image after {rest:g} s at rest (median / p99 / max over the pods)")
    for group in at_rest:
        print(f"  {group.backend} group of 3: {group.per_second:.3f} API requests/s ({group.requests} in {rest:g} s)")
    for backend in backends:
        print("  " + summary(f"{backend} RSS", [f.rss_mb for f in found if f.backend == backend], "MB", 1.0))
        starts = [f.start_seconds for f in found if f.backend == backend and f.start_seconds is not None]
        if starts:
            print("  " + summary(f"{backend} process start -> first log line", starts))


def incarnation_times(bed: Bed, pod: str, killed: float) -> tuple[float | None, float | None]:
    """(killed -> first log line, first log line -> "acquired" line) of the pod's restarted sidecar,
    from its log (the node's clock is this machine's)."""
    # The kill may be answered (another pod leads) before the kubelet has restarted the
    # container, whose log is then still the killed one's: wait for lines of the new one.
    deadline = time.monotonic() + 15
    while not (times := [(stamp, line) for stamp, line in sidecar_log_times(bed, pod) if stamp >= killed]):
        if time.monotonic() > deadline:
            return None, None
        time.sleep(0.2)
    first = times[0][0]
    acquired = next((stamp for stamp, line in times if "acquired" in line), None)
    return first - killed, None if acquired is None else acquired - first


def keep_evidence(bed: Bed) -> None:
    """The pods' logs, objects and events, and the node's logs, in a folder that outlives the run."""
    folder = Path(tempfile.mkdtemp(prefix="node-bench-failed-"))
    save_pod_logs(bed.control_plane, NAMESPACE, folder)
    for log in ("kubelet.log", "containerd.log"):
        with contextlib.suppress(OSError):
            shutil.copy(bed.node.paths.work / log, folder / log)
    with contextlib.suppress(OSError):
        shutil.copy(bed.workdir / "operator.log", folder / "operator.log")
    print(f"[bench] logs kept in {folder}", file=sys.stderr, flush=True)


def print_runs(backends: list[str], faults: list[str], runs: list[Run]) -> None:
    if not runs:
        return
    print("\nfault -> another pod's sidecar ready as leader (median / p99 / max over the runs)")
    for backend in backends:
        for fault in faults:
            values = [r.seconds for r in runs if r.backend == backend and r.fault == fault]
            if not values:  # none asked for (``--runs-per-fault lease/partition=0``)
                continue
            print("  " + summary(f"{backend} {fault}", values))
            restarts = [r for r in runs if r.backend == backend and r.fault == fault and r.restart is not None]
            if restarts:
                print("    " + summary("kill -> restarted sidecar's log", [r.restart or 0.0 for r in restarts]))
            leads = [r.start_to_lead for r in restarts if r.start_to_lead is not None]
            if leads:
                print("    " + summary("its first log line -> acquired", leads))
            phased = [r.phases for r in runs if r.backend == backend and r.fault == fault and r.phases]
            for phase in [*(name for name, _, _ in PHASES), "new app acting", "new ready seen"]:
                values = [p[phase] for p in phased if phase in p]
                if values:
                    print("    " + summary(f"-> {phase}", values))


def parse_args() -> tuple[argparse.Namespace, Callable[[str, str], int]]:
    """The command line, and the runs of each (backend, fault)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node_failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs per backend and fault (default 10)")
    parser.add_argument("--backend", nargs="+", choices=("postgres", "lease", "both"),
                        default=["postgres", "lease", "both"])
    parser.add_argument("--fault", nargs="+", choices=FAULTS, default=list(DEFAULT_FAULTS),
                        help=f"faults, in this order (default: {' '.join(DEFAULT_FAULTS)})")
    parser.add_argument("--runs-per-fault", nargs="+", default=[], metavar="[BACKEND/]FAULT=N",
                        help="runs of one fault instead of --runs, on every backend or on one (BACKEND/FAULT=N "
                             "wins over FAULT=N), e.g. sidecar-kill=3 partition=0 postgres/partition=4")
    parser.add_argument("--rest-seconds", type=float, default=30.0,
                        help="rest of each settled group before its sidecars' footprint is read (default 30; 0: skip)")
    parser.add_argument("--gating", choices=("cooperative", "file"), default="cooperative",
                        help="how the groups gate their app (default cooperative: an app that registers nothing)")
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--crash-loop", action="store_true",
                        help="sidecar-kill: kill the same leader container run after run, the kubelet's crash-loop "
                             "back-off included (default: each run kills a container that never restarted)")
    parser.add_argument("--poll-ms", type=float, default=POLL * 1000,
                        help="pause between rounds of /readyz requests to every pod while a new leader is awaited "
                             f"(default {POLL * 1000:g}; each round opens a connection per pod, which costs the "
                             "sidecars CPU: with --gating file a deletion's figure is the app's own log line, so a "
                             "slower poll measures it with less of the observer's load)")
    parser.add_argument("--app-cpu", metavar="QUANTITY",
                        help="the app container's CPU request, e.g. 100m (default none, as a container without "
                             "resources; with --gating file gate.sh runs in it, on the handover's path)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the pods', the node's (kubelet, containerd) and the operator's logs in a folder")
    args = parser.parse_args()
    if args.runs < 0:
        parser.error("--runs must be at least 0 (0: the footprint only)")
    if args.poll_ms <= 0:
        parser.error("--poll-ms must be more than 0")
    if args.rest_seconds < 0:
        parser.error("--rest-seconds must be 0 or more")
    try:
        runs_of = run_counts(args.runs_per_fault, args.runs)
    except ValueError as exc:
        parser.error(str(exc))
    return args, runs_of


def main() -> int:
    args, runs_of = parse_args()
    with tempfile.TemporaryDirectory(prefix="node-bench-") as folder:
        bed = Bed(Path(folder))
        runs: list[Run] = []
        rests: list[Footprint] = []
        at_rest: list[AtRest] = []
        try:
            bed.start()
            for backend in args.backend:
                manifest = group_manifest(bed, backend, args.gating, args.app_cpu)
                bed.control_plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
                if args.rest_seconds:
                    found, group_at_rest = footprints(bed, backend, args.rest_seconds)
                    rests += found
                    at_rest.append(group_at_rest)
                for fault in args.fault:
                    count = runs_of(backend, fault)
                    for index in range(count):
                        try:
                            run = one_run(bed, backend, fault, crash_loop=args.crash_loop, poll=args.poll_ms / 1000)
                        except TimeoutError:
                            keep_evidence(bed)
                            raise
                        runs.append(run)
                        before = f" (sidecar restarted {run.restarts_before}x before)" if run.restarts_before else ""
                        steps = "" if not run.phases else " (" + ", ".join(
                            f"{phase} {seconds * 1000:.0f}" for phase, seconds in run.phases.items()) + ")"
                        print(f"[{backend:8} {fault:12} {index + 1:2}/{count}] {run.old} -> {run.new}: "
                              f"{run.seconds * 1000:.0f} ms{before}{steps}", flush=True)
                if args.keep_logs:
                    keep_evidence(bed)
                bed.control_plane.kubectl("delete", "sgl", f"bench-{backend}", "-n", NAMESPACE, "--wait=true")
        finally:
            with contextlib.suppress(Exception):
                bed.stop()
    if args.json:  # first: the figures are kept whatever the printing below meets
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "footprints": [asdict(r) for r in rests],
                                         "at_rest": [asdict(r) for r in at_rest]}, indent=1))
    print_footprints(args.backend, args.rest_seconds, rests, at_rest)
    print_runs(args.backend, args.fault, runs)
    return 0


def run_counts(overrides: list[str], default: int) -> Callable[[str, str], int]:
    """``--runs-per-fault``: the runs of (backend, fault), from ``FAULT=N`` and ``BACKEND/FAULT=N``
    (the backend's wins), else ``default``. ValueError names a malformed or unknown entry."""
    counts: dict[tuple[str | None, str], int] = {}
    for entry in overrides:
        key, _, number = entry.partition("=")
        backend, _, fault = key.rpartition("/")
        if fault not in FAULTS or backend not in ("", "postgres", "lease", "both") or not number.isdigit():
            raise ValueError(f"--runs-per-fault takes [BACKEND/]FAULT=N with a fault of {', '.join(FAULTS)}: "
                             f"got {entry!r}")
        counts[backend or None, fault] = int(number)

    def runs(backend: str, fault: str) -> int:
        return counts.get((backend, fault), counts.get((None, fault), default))

    return runs


if __name__ == "__main__":
    sys.exit(main())

