"""Partition failover side by side: groups of 3 pods of each peer (our sidecar on a Lease, and
client-go's elector) on the test bed's real node (``singleton_testbed.node``: containerd, runc,
kubelet, kube-proxy), every pod bound to it (``nodeName``). Our peer runs the project's image
(``singleton_testbed.images``, ``singleton-sidecar run``); client-go's runs a one-file image
holding the static ``clientgo-elector`` binary (``singleton_testbed.oci``), which finds the API
server with ``rest.InClusterConfig`` (the ``KUBERNETES_SERVICE_*`` variables the kubelet sets and
the projected ServiceAccount token). Both use a ServiceAccount limited to the sidecar's rules
(``contract.sidecar_rbac_rules``: creating Leases, and get/update of the group's one), which
covers client-go's ``LeaseLock`` (get, create, update).

The leader's pod is cut off from the API server (iptables inside its network namespace,
``node_pods.partition``: packets to and from the ``kubernetes`` Service's ClusterIP dropped, as a
broken route or a dead node would), at a random phase of the peer's retry cycle, and stays cut
off until another member has answered ready for 1 s and the cut-off one has stopped answering
ready (or 3 lease durations passed). Then the partition heals (``node_pods.heal``) and the group
settles again (a client-go elector exits when it loses the lease; the kubelet restarts its
container, its back-off capped at 1 s on the test bed's node).

Per run:
- **failover**: partition in place -> the first ``/readyz`` 200 of another member with a newer
  term (``/readyz`` is polled from this machine over the pod IPs every 10 ms, as in
  ``benchmarks/campaign.py``);
- **margin**: the new leader's first ready answer minus the cut-off leader's last one. Positive:
  the old one had stopped acting before the new one began; negative: both answered ready at
  once (an overlap).

Called from ``benchmarks/compare_clientgo.py`` (``--partition-runs``) on its control plane, which
must advertise the node IP (``ControlPlane(advertise_address=NodeLayout().node_ip)``); it starts
the controllers (ServiceAccount tokens need the root CA published in each namespace) and a node
of its own, stopped at the end. Or on a node already running (``OnNode``: a test session's).
Needs root; only one real node runs per machine (``/run/singleton-node/lock``).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.campaign_bed import CampaignError, admin_call, create_account, sidecar_pod_env, watch_running
from benchmarks.campaign_poll import PORT, Poller, Sample
from singleton_election import contract
from singleton_testbed import images, node_pods
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.harness.kubehelpers import AdminApi, save_pod_logs
from singleton_testbed.node import Node, NodeError, unavailable_reason
from singleton_testbed.node_config import NodeLayout
from singleton_testbed.oci import ImageFile, ImageSpec, write_archive

MEMBERS = 3
ACCOUNT = "elector"
CONTAINER = "elector"
SETTLE_TIMEOUT = 120.0  # a client-go elector that lost its lease exits; the kubelet's back-off delays its return
ELECTOR_PATH = "clientgo-elector"
"""Where the elector binary sits in its image (at the root)."""
ELECTOR_USER = "65532:65532"
"""Not root, as the project's image (user 10001): the elector needs no privilege."""


@dataclass(frozen=True)
class PodPeer:
    key: str
    label: str
    timings: tuple[float, float, float]
    """Lease duration, renew deadline, retry period (s)."""
    cycle: float
    """How long one retry cycle lasts: the partition comes at a random phase of it."""
    clientgo_binary: Path | None = None
    """The client-go elector (a static binary, put in an image of its own); None: our sidecar."""

    def container(self, pod: str, namespace: str, group: str, image: str) -> dict[str, Any]:
        """The pod's one container, of ``image`` (imported into the node: never pulled)."""
        lease_duration, renew_deadline, retry_period = self.timings
        base = {"name": CONTAINER, "image": image, "imagePullPolicy": "Never"}
        if self.clientgo_binary is not None:
            # No --kubeconfig: the elector takes rest.InClusterConfig, as a controller in a pod does.
            command = [f"/{ELECTOR_PATH}", f"--namespace={namespace}", f"--name={group}",
                       f"--identity={pod}", f"--listen=0.0.0.0:{PORT}", f"--lease-duration={lease_duration:g}s",
                       f"--renew-deadline={renew_deadline:g}s", f"--retry-period={retry_period:g}s"]
            return {**base, "command": command}
        env = sidecar_pod_env(group, "lease", {contract.ENV_LEASE_DURATION: f"{lease_duration:g}",
                                               contract.ENV_RENEW_DEADLINE: f"{renew_deadline:g}",
                                               contract.ENV_RETRY_PERIOD: f"{retry_period:g}"})
        return {**base, "command": ["singleton-sidecar", "run"], "env": env}


@dataclass
class PartitionRun:
    failover: float
    margin: float
    """New leader's first ready answer (sent) minus the old leader's last (received); < 0 is an overlap."""
    old_pod: str
    new_pod: str


@dataclass(frozen=True)
class OnNode:
    """A real node that already runs (a test session's), joined to the control plane given to
    ``partition_runs``, with the project's image imported; the elector's image is imported here."""

    node: Node
    project_image: str
    tolerations: list[dict[str, str]] = field(default_factory=list)
    """What the pods need to run on that node (its taints)."""


@dataclass
class PodBed:
    """Where the groups run: the real node, the API as admin, the images and a poller of the
    pods' ``/readyz``."""

    api: AdminApi
    plane: ControlPlane
    node: Node
    poller: Poller
    workdir: Path
    api_ip: str
    """The ``kubernetes`` Service's ClusterIP: where the pods dial the API server."""
    project_image: str
    elector_images: dict[Path, str] = field(default_factory=dict)
    """client-go elector binary → its image."""
    tolerations: list[dict[str, str]] = field(default_factory=list)

    def image_of(self, peer: PodPeer) -> str:
        return self.project_image if peer.clientgo_binary is None else self.elector_images[peer.clientgo_binary]


def elector_image(binary: Path, workdir: Path) -> tuple[Path, str]:
    """An image holding only the static ``clientgo-elector`` (``CGO_ENABLED=0``: no libc needed),
    named by its content so that another build is another image; (archive, reference)."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:16]
    spec = ImageSpec(name=f"singleton.dev/bench/clientgo-elector:{digest}",
                     files={ELECTOR_PATH: ImageFile(source=binary)}, entrypoint=(f"/{ELECTOR_PATH}",),
                     user=ELECTOR_USER)
    return write_archive(spec, workdir / f"clientgo-elector-{digest}.tar"), spec.name


@dataclass
class PodGroup:
    bed: PodBed
    peer: PodPeer
    name: str = ""
    pods: dict[str, str] = field(default_factory=dict)
    """Pod name → IP (empty until its container runs)."""

    def __post_init__(self) -> None:
        self.name = self.name or f"part-{self.peer.key}-{secrets.token_hex(3)}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return admin_call(self.bed.api, method, path, body)

    def setup(self) -> None:
        create_account(self.call, self.name, ACCOUNT, self.name)
        image = self.bed.image_of(self.peer)
        for index in range(MEMBERS):
            pod = f"{self.name}-{index}"
            spec: dict[str, Any] = {
                "nodeName": self.bed.node.layout.name, "serviceAccountName": ACCOUNT,
                "terminationGracePeriodSeconds": 5,
                "containers": [self.peer.container(pod, self.name, self.name, image)]}
            if self.bed.tolerations:
                spec["tolerations"] = self.bed.tolerations
            self.call("POST", f"/api/v1/namespaces/{self.name}/pods",
                      {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod}, "spec": spec})
            self.pods[pod] = ""

    def teardown(self) -> None:
        """Save the pods' logs (restarted containers' previous ones too), delete the namespace and
        wait until its pods are gone, so the next group does not share the CPU with them."""
        for pod in self.pods:
            self.bed.poller.forget(pod)
        try:
            save_pod_logs(self.bed.plane, self.name, self.bed.workdir / "pods" / self.name)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            print(f"  could not save the logs of {self.name}: {exc}", flush=True)
        try:
            self.call("DELETE", f"/api/v1/namespaces/{self.name}")
        except CampaignError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, answer = self.bed.api.request("GET", f"/api/v1/namespaces/{self.name}/pods", timeout=5)
            if status != 200 or not answer.get("items"):
                return
            time.sleep(0.2)

    def settled(self) -> Sample:
        """Every member answers, exactly one ready: its sample."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while time.monotonic() < deadline:
            watch_running(self.bed.api, self.bed.poller, self.name, CONTAINER, self.pods)
            leader = self.bed.poller.settled(set(self.pods)) if all(self.pods.values()) else None
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise CampaignError(f"{self.name} did not settle within {SETTLE_TIMEOUT:g}s: "
                            f"{ {p: (s.status, s.token) for p, s in self.bed.poller.latest().items()} }")

    def partition_once(self, rng: random.Random) -> PartitionRun:
        lease_duration = self.peer.timings[0]
        leader = self.settled()
        assert leader.token is not None
        # Read before the cut: the pod object names the cgroup whose pause process holds the
        # pod's network namespace, and reading it takes an API round trip.
        pod = self.call("GET", f"/api/v1/namespaces/{self.name}/pods/{leader.pod}")
        layout = self.bed.node.layout
        time.sleep(0.3 + rng.uniform(0, self.peer.cycle))
        self.bed.poller.set_fast(True)
        try:
            node_pods.partition(pod, self.bed.api_ip, mode="drop", layout=layout)
        except (LookupError, OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self._heal(pod)
            self.bed.poller.set_fast(False)
            raise CampaignError(f"{self.name}: cannot cut {leader.pod} off: {exc}") from exc
        # Both rules are in place now (a few ms of nsenter + iptables after the first took
        # effect): time from here, when the pod surely has no path to the API server.
        t0 = time.time()
        try:
            new = self.bed.poller.wait_ready(t0, leader.token, 3 * lease_duration + 10)
            if new is None or new.pod == leader.pod:
                raise CampaignError(f"{self.name}: no other member led within {3 * lease_duration + 10:g}s "
                                    f"of cutting off {leader.pod}")
            time.sleep(1.0)
            deadline = time.monotonic() + 3 * lease_duration
            while time.monotonic() < deadline and (latest := self.bed.poller.latest().get(leader.pod)) and latest.ready:
                time.sleep(0.05)
            old = self.bed.poller.last_ready(leader.pod, t0)
        finally:
            self._heal(pod)
            self.bed.poller.set_fast(False)
        margin = new.sent - (old.received if old is not None else t0)
        return PartitionRun(failover=new.received - t0, margin=margin, old_pod=leader.pod, new_pod=new.pod)

    def _heal(self, pod: dict[str, Any]) -> None:
        # The pod's sandbox (and its network namespace with the rules) outlives container
        # restarts, so the object read before the cut still finds it.
        with contextlib.suppress(LookupError, OSError, RuntimeError, subprocess.SubprocessError):
            node_pods.heal(pod, self.bed.api_ip, layout=self.bed.node.layout)


def _own_node(plane: ControlPlane, progress: Callable[[str], None]) -> tuple[Node, str]:
    """Start the controllers and a real node on ``plane``, with the project's image imported;
    (node, image). Every failure is a one-line ``CampaignError`` (another node holding the
    machine's lock included)."""
    layout = NodeLayout()
    if (reason := unavailable_reason(plane.binaries)) is not None:
        raise CampaignError(reason)
    if plane.advertise_address != layout.node_ip:
        raise CampaignError(f"the control plane advertises {plane.advertise_address or '127.0.0.1'}, "
                            f"not the node IP {layout.node_ip}: pods could not reach the API server")
    progress("partition: building (or finding) the project's image")
    try:
        archive, image = images.build_project_image()
    except (images.ImageBuildError, OSError, subprocess.SubprocessError) as exc:
        raise CampaignError(f"the project's image: {exc}") from exc
    # ServiceAccount tokens are projected with the namespace's root CA (kube-root-ca.crt),
    # which kube-controller-manager publishes.
    plane.start_controllers()
    node = Node(plane, plane.binaries, layout=layout)
    progress("partition: starting the real node")
    try:
        node.start()
    except NodeError as exc:
        raise CampaignError(str(exc)) from None
    try:
        node.import_image(archive)
    except NodeError as exc:
        node.stop()
        raise CampaignError(str(exc)) from None
    return node, image


@contextlib.contextmanager
def pod_bed(plane: ControlPlane, workdir: Path, peers: list[PodPeer], on_node: OnNode | None,
            progress: Callable[[str], None]) -> Iterator[PodBed]:
    """The node (``on_node``'s, or one started here and stopped on the way out) with every
    peer's image, and a poller of the pods (polled from this machine: pod IPs route through
    the node's bridge)."""
    own = on_node is None
    if on_node is None:
        node, project_image = _own_node(plane, progress)
        tolerations: list[dict[str, str]] = []
    else:
        node, project_image, tolerations = on_node.node, on_node.project_image, on_node.tolerations
    poller = Poller(slow=0.05, fast=0.01)
    api: AdminApi | None = None
    try:
        api = AdminApi(plane.info.kubeconfig)
        bed = PodBed(api, plane, node, poller, workdir, "", project_image, tolerations=tolerations)
        for binary in {p.clientgo_binary for p in peers if p.clientgo_binary is not None}:
            archive, reference = elector_image(binary, workdir)
            try:
                node.import_image(archive)
            except NodeError as exc:
                raise CampaignError(str(exc)) from None
            bed.elector_images[binary] = reference
        bed.api_ip = str(admin_call(bed.api, "GET", "/api/v1/namespaces/default/services/kubernetes")
                         ["spec"]["clusterIP"])
        poller.start()
        yield bed
    finally:
        poller.stop()
        if api is not None:
            api.close()
        if own:
            node.stop()


def partition_runs(plane: ControlPlane, workdir: Path, peers: list[PodPeer], *, runs: int, rng: random.Random,
                   progress: Callable[[str], None], on_node: OnNode | None = None) -> dict[str, list[PartitionRun]]:
    """``runs`` partitions of each peer's leader, one peer after the other, on one real node:
    ``on_node``'s, or (None) one started on ``plane`` for these runs."""
    results: dict[str, list[PartitionRun]] = {}
    with pod_bed(plane, workdir, peers, on_node, progress) as bed:
        for peer in peers:
            progress(f"{peer.key}: partition from the API server x{runs}")
            group = PodGroup(bed, peer)
            group.setup()
            try:
                results[peer.key] = []
                for _ in range(runs):
                    run = group.partition_once(rng)
                    print(f"  {peer.key}: {run}", flush=True)
                    results[peer.key].append(run)
            finally:
                group.teardown()
    return results
