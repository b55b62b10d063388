"""Whole-node faults on two real nodes, for a test (``tests/node/test_node_faults.py``) and a
benchmark (``benchmarks/node_faults.py``) alike.

One group of two pods made by the operator, one on each node (a required anti-affinity), the
file gate, the lease backend, a leader Service; each pod's app (``tests/data/acting_app.py``)
records every moment it acts in one file on this machine, which no fence hides. Before each
fault the leader is moved to the second node (``kubectl singleton handover``), whose node
the fault then hits:

- ``cut-off``: its link goes down; kubelet, kube-proxy and the pods run on, unreachable;
- ``power-off``: every process of it stops at one instant and is killed (``Node.power_off``);
- ``kubelet-stop``: its kubelet alone stops; the pods run on and reach everything. The node
  turns NotReady after the node lifecycle controller's grace period, and the pods' toleration
  of that (``EVICT_AFTER`` seconds, the group's own; Kubernetes gives 300 s by default) ends
  in their eviction, which the leader hands over on;
- ``drain``: ``kubectl drain`` of the whole node, through the group's PodDisruptionBudget.

A run measures, from the fault's instant: the new leader's app acting (its first act), the
group's status naming it, and the leader Service's endpoints holding it alone. Then the node
comes back (link up, booted, kubelet started, uncordoned) and the group settles with two
ready pods again; the old leader's app must never act once the new one has.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singleton_election import contract
from singleton_testbed.harness.acts import spans
from singleton_testbed.harness.kubehelpers import KubectlRunner, pod_ready, pod_role
from singleton_testbed.harness.sidecars import wait_for
from singleton_testbed.node import Node

FAULTS = ("cut-off", "power-off", "kubelet-stop", "drain")
SIDECAR_PORT = 7450
EVICT_AFTER = 5
"""Seconds the group's pods tolerate a NotReady or unreachable node before they are evicted."""
LEASE_SECONDS = 2.0
"""The group's lease duration; its renew deadline is 3/4 of it, its retry period 1/4."""


def timings(lease_seconds: float) -> dict[str, str]:
    return {"leaseDuration": f"{lease_seconds * 1000:.0f}ms", "renewDeadline": f"{lease_seconds * 750:.0f}ms",
            "retryPeriod": f"{lease_seconds * 250:.0f}ms"}


def node_tolerations(evict_after: int) -> list[dict[str, Any]]:
    """Tolerating a NotReady or unreachable node for ``evict_after`` seconds, then evicted."""
    return [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": evict_after}
            for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")]
PLUGIN = Path(sys.executable).parent / "kubectl-singleton"


def group_manifest(name: str, image: str, acts: Path, nodes: Sequence[str],
                   tolerations: Sequence[Mapping[str, Any]], *, lease_seconds: float = LEASE_SECONDS,
                   evict_after: int = EVICT_AFTER) -> dict[str, Any]:
    """The group: one pod per node of ``nodes``, tolerating ``tolerations`` (the nodes'
    taints) and a lost node for ``evict_after`` seconds; its app acts while it leads."""
    app = {"name": "app", "image": image, "imagePullPolicy": "Never",
           "command": ["python", "/opt/singleton-tests/data/acting_app.py"],
           "env": [{"name": "ACT_LOG", "value": "/acts/acts.log"}],
           "volumeMounts": [{"name": "acts", "mountPath": "/acts"}]}
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {contract.LABEL_GROUP: name}}, "topologyKey": "kubernetes.io/hostname"}]},
    }
    return {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"replicas": len(nodes), "backend": "lease", "gating": {"mode": "file"},
                     "timings": timings(lease_seconds),
                     "drain": {"timeout": "5s"}, "terminationGracePeriodSeconds": 10,
                     "service": {"ports": [{"port": 80, "targetPort": SIDECAR_PORT}]},
                     "template": {"spec": {
                         "affinity": affinity, "tolerations": [*tolerations, *node_tolerations(evict_after)],
                         "containers": [app],
                         "volumes": [{"name": "acts", "hostPath": {"path": str(acts), "type": "Directory"}}]}}}}


@dataclass(frozen=True)
class FaultRun:
    fault: str
    old_pod: str
    new_pod: str
    old_token: int
    new_token: int
    new_acting: float
    """Seconds from the fault to the new leader's first act."""
    status_followed: float
    """Seconds from the fault to the group's status naming the new leader."""
    service_followed: float
    """Seconds from the fault to the leader Service's ready endpoints being the new leader alone."""
    old_last_act: float
    new_first_act: float
    """Both on the act file's clock (CLOCK_MONOTONIC)."""

    @property
    def overlap(self) -> float:
        """Seconds the old leader acted after the new one began (> 0: two apps acted at once)."""
        return self.old_last_act - self.new_first_act


def leads(ip: str) -> int | None:
    """The token of the sidecar at ``ip`` when its ``/readyz`` says it leads, else None."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/readyz", timeout=0.5) as response:
            if response.status != 200:
                return None
        with urllib.request.urlopen(f"http://{ip}:{SIDECAR_PORT}/leader", timeout=0.5) as response:
            return int(json.loads(response.read()).get("token") or 0)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def token_of(pod: dict[str, Any]) -> int | None:
    try:
        return int((pod["metadata"].get("annotations") or {})[contract.ANNOTATION_TOKEN])
    except (KeyError, ValueError):
        return None


class TwoNodeGroup:
    """The group of ``group_manifest`` and the faults of its second node."""

    def __init__(self, kubectl: KubectlRunner, namespace: str, name: str, acts: Path, *, first: Node,
                 second: Node, lease_seconds: float = LEASE_SECONDS) -> None:
        self.cluster = kubectl
        self.namespace = namespace
        self.name = name
        self.acts = acts
        self.first = first
        self.second = second
        self.lease_seconds = lease_seconds

    @property
    def act_log(self) -> Path:
        return self.acts / "acts.log"

    def _get(self, *args: str) -> dict[str, Any]:
        result = self.cluster.kubectl("get", *args, "-n", self.namespace, "-o", "json")
        found: dict[str, Any] = json.loads(result.stdout)
        return found

    def pods(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._get("pods", "-l", f"{contract.LABEL_GROUP}={self.name}")["items"]
        return [p for p in found if not p["metadata"].get("deletionTimestamp")]

    def settled(self) -> dict[str, Any] | None:
        """The leader pod once there is one ready pod per node, one leads (its label, its
        annotation and its ``/readyz`` agree, and its app has acted), the other stands by."""
        pods = self.pods()
        nodes = {p["spec"].get("nodeName") for p in pods}
        if len(pods) != 2 or nodes != {self.first.layout.name, self.second.layout.name} \
                or not all(pod_ready(p) for p in pods):
            return None
        if sorted(pod_role(p) or "" for p in pods) != ["leader", "standby"]:
            return None
        leader = next(p for p in pods if pod_role(p) == "leader")
        token = token_of(leader)
        if leader["metadata"]["labels"].get(contract.LABEL_ROLE) != contract.ROLE_LEADER or token is None \
                or leads(leader["status"]["podIP"]) != token:
            return None
        return leader if any(s.token == token for s in spans(self.act_log)) else None

    def lead_from_second_node(self, timeout: float = 180) -> tuple[str, int]:
        """Settle, and hand over to the second node's pod if the first node's leads."""
        leader = wait_for(self.settled, timeout, "a settled group: a pod per node, one leading and acting", 0.3)
        if leader["spec"]["nodeName"] != self.second.layout.name:
            target = next(p["metadata"]["name"] for p in self.pods()
                          if p["spec"].get("nodeName") == self.second.layout.name)
            handover = subprocess.run([str(PLUGIN), "--kubeconfig", self._kubeconfig(), "handover", self.name,
                                       "-n", self.namespace, "--to", target],
                                      capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
            if handover.returncode != 0:
                raise AssertionError(f"kubectl singleton handover failed: {handover.stdout}{handover.stderr}")
            leader = wait_for(lambda: (found := self.settled()) and found["metadata"]["name"] == target and found,
                              60, f"{target} to lead after the handover", 0.3)
            # The leader that stepped down stands aside for a lease duration (so that the target
            # takes the lock); a fault within it would measure that pause, not the failover.
            time.sleep(self.lease_seconds + 0.5)
        token = token_of(leader)
        assert token is not None
        return leader["metadata"]["name"], token

    def _kubeconfig(self) -> str:
        return str(self.first.control_plane.info.kubeconfig)

    # --- the faults -------------------------------------------------------------------------

    def _fault(self, fault: str) -> tuple[Callable[[], None], Callable[[], None]]:
        """(the fault, the recovery) of the second node."""
        node = self.second
        if fault == "cut-off":
            return node.cut_off, node.reconnect
        if fault == "power-off":
            return node.power_off, node.power_on
        if fault == "kubelet-stop":
            return node.stop_kubelet, node.start_kubelet
        if fault == "drain":
            drain: list[subprocess.Popen[str]] = []

            def start_drain() -> None:
                drain.append(subprocess.Popen(
                    [str(self.first.binaries["kubectl"]), "--kubeconfig", self._kubeconfig(), "drain", node.layout.name,
                     "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL))

            def end_drain() -> None:
                try:
                    out, _ = drain[0].communicate(timeout=150)
                except subprocess.TimeoutExpired:
                    drain[0].kill()
                    out, _ = drain[0].communicate()
                finally:
                    self.cluster.kubectl("uncordon", node.layout.name)
                if drain[0].returncode != 0:
                    raise AssertionError(f"kubectl drain failed: {out}")

            return start_drain, end_drain
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")

    def run(self, fault: str, timeout: float = 120, *, old_log: Path | None = None) -> FaultRun:
        """One fault of the second node, under its leader; returns once the group has settled
        again with the node back. ``old_log``: where to keep the old leader's sidecar log
        (followed from before the fault: the pod and its logs may be gone after it)."""
        apply, recover = self._fault(fault)
        old_pod, old_token = self.lead_from_second_node()
        successor = next(p["metadata"]["name"] for p in self.pods() if p["metadata"]["name"] != old_pod)
        follower = None if old_log is None else self._follow(old_pod, old_log)
        began = time.monotonic()
        try:
            apply()
            new_span = wait_for(lambda: next((s for s in spans(self.act_log) if s.token > old_token), None), timeout,
                                f"a new leader's app to act after {fault}", 0.005)
            new_acting = time.monotonic() - began
            new_first_act = new_span.first
            status_followed = wait_for(lambda: self._status_leader() == successor and time.monotonic() - began,
                                       30, f"the status to name {successor}", 0.05)
            successor_ip = next(p["status"]["podIP"] for p in self.pods() if p["metadata"]["name"] == successor)
            service_followed = wait_for(lambda: self._endpoints() == {successor_ip} and time.monotonic() - began,
                                        60, f"the leader Service's endpoints to be {successor_ip} alone", 0.05)
        finally:
            try:
                recover()
            finally:
                if follower is not None:
                    follower.terminate()
                    follower.wait(10)
        new_leader = wait_for(self.settled, 180, f"the group to settle after {fault} with the node back", 0.3)
        assert new_leader["metadata"]["name"] == successor, \
            f"{successor} led after {fault}, then {new_leader['metadata']['name']}"
        time.sleep(1)  # an old leader's app that acted once the node came back would have by now
        by_token = {s.token: s for s in spans(self.act_log)}
        return FaultRun(fault=fault, old_pod=old_pod, new_pod=successor, old_token=old_token,
                        new_token=new_span.token, new_acting=new_acting, status_followed=status_followed,
                        service_followed=service_followed, old_last_act=by_token[old_token].last,
                        new_first_act=new_first_act)

    def _follow(self, pod: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen([str(self.first.binaries["kubectl"]), "--kubeconfig", self._kubeconfig(), "logs",
                                     "-f", "-n", self.namespace, pod, "-c", "singleton-sidecar", "--since=5s"],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _status_leader(self) -> str | None:
        status = self._get("sgl", self.name).get("status") or {}
        leader: str | None = status.get("leader")
        return leader

    def _endpoints(self) -> set[str]:
        """The ready addresses of the leader Service's EndpointSlices."""
        slices = self._get("endpointslices", "-l", f"kubernetes.io/service-name={self.name}-leader")["items"]
        return {address for piece in slices for endpoint in piece.get("endpoints") or []
                if (endpoint.get("conditions") or {}).get("ready")
                for address in endpoint.get("addresses") or []}
