"""Partition failover side by side: groups of 3 pods of each peer (our sidecar on a Lease, and
client-go's elector) on the test bed's stand-in kubelet, each pod in its own network
namespace. The leader's pod is cut off from the API server (its packets dropped, as a broken
route or a dead node would), at a random phase of the peer's retry cycle, and stays cut off
until another member has answered ready for 1 s and the cut-off one has stopped answering
ready (or 3 lease durations passed). Then the partition heals and the group settles again
(a client-go elector exits when it loses the lease and is restarted by the kubelet).

Per run:
- **failover**: partition start -> the first ``/readyz`` 200 of another member with a newer term
  (``/readyz`` is polled over the pod IPs every 10 ms, as in ``benchmarks/campaign.py``);
- **margin**: the new leader's first ready answer minus the cut-off leader's last one. Positive:
  the old one had stopped acting before the new one began; negative: both answered ready at
  once (an overlap).

Called from ``benchmarks/compare_clientgo.py`` (``--partition-runs``) on its control plane.
Needs root and ``ip netns`` (``singleton_testbed.netns.netns_supported``).
"""

from __future__ import annotations

import random
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.kubelet_fixtures import Api

from benchmarks.campaign_bed import CampaignError, admin_call, create_account, sidecar_pod_env, watch_running
from benchmarks.campaign_poll import PORT, Poller, Sample
from singleton_sidecar import contract
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.kubelet_control import StandInKubelet
from singleton_testbed.netns import PodNetworkConfig, netns_supported

NET = PodNetworkConfig()
MEMBERS = 3
ACCOUNT = "elector"
SETTLE_TIMEOUT = 120.0  # a client-go elector that lost its lease exits; the kubelet's back-off delays its return


@dataclass(frozen=True)
class PodPeer:
    key: str
    label: str
    timings: tuple[float, float, float]
    """Lease duration, renew deadline, retry period (s)."""
    cycle: float
    """How long one retry cycle lasts: the partition comes at a random phase of it."""
    clientgo_binary: Path | None = None
    """The client-go elector; None: our sidecar."""

    def container(self, pod: str, namespace: str, group: str) -> dict[str, Any]:
        lease_duration, renew_deadline, retry_period = self.timings
        if self.clientgo_binary is not None:
            command = [str(self.clientgo_binary), f"--namespace={namespace}", f"--name={group}",
                       f"--identity={pod}", f"--listen=0.0.0.0:{PORT}", f"--lease-duration={lease_duration:g}s",
                       f"--renew-deadline={renew_deadline:g}s", f"--retry-period={retry_period:g}s"]
            return {"name": "elector", "command": command}

        env = sidecar_pod_env(group, "lease", {contract.ENV_LEASE_DURATION: f"{lease_duration:g}",
                                               contract.ENV_RENEW_DEADLINE: f"{renew_deadline:g}",
                                               contract.ENV_RETRY_PERIOD: f"{retry_period:g}"})
        return {"name": "elector", "command": [sys.executable, "-m", "singleton_sidecar.cli", "run"], "env": env}


@dataclass
class PartitionRun:
    failover: float
    margin: float
    """New leader's first ready answer (sent) minus the old leader's last (received); < 0 is an overlap."""
    old_pod: str
    new_pod: str


@dataclass
class PodGroup:
    api: Api
    standin: StandInKubelet
    poller: Poller
    peer: PodPeer
    name: str = ""
    pods: dict[str, str] = field(default_factory=dict)
    """Pod name → IP (empty until it runs)."""

    def __post_init__(self) -> None:
        self.name = self.name or f"part-{self.peer.key}-{secrets.token_hex(3)}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return admin_call(self.api, method, path, body)

    def setup(self) -> None:
        create_account(self.call, self.name, ACCOUNT, self.name)
        for index in range(MEMBERS):
            pod = f"{self.name}-{index}"
            self.call("POST", f"/api/v1/namespaces/{self.name}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"nodeName": self.standin.node, "serviceAccountName": ACCOUNT,
                         "terminationGracePeriodSeconds": 5,
                         "containers": [{**self.peer.container(pod, self.name, self.name),
                                         "image": "bench.invalid/elector:0"}]}})
            self.pods[pod] = ""

    def teardown(self) -> None:
        for pod in self.pods:
            self.poller.forget(pod)
        try:
            self.call("DELETE", f"/api/v1/namespaces/{self.name}")
        except CampaignError:
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.namespace == self.name for p in self.standin.pods()):
            time.sleep(0.2)

    def settled(self) -> Sample:
        """Every member answers, exactly one ready: its sample."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while time.monotonic() < deadline:
            watch_running(self.standin, self.poller, self.name, self.pods)
            leader = self.poller.settled(set(self.pods)) if all(self.pods.values()) else None
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise CampaignError(f"{self.name} did not settle within {SETTLE_TIMEOUT:g}s: "
                            f"{ {p: (s.status, s.token) for p, s in self.poller.latest().items()} }")

    def partition_once(self, rng: random.Random) -> PartitionRun:
        lease_duration = self.peer.timings[0]
        leader = self.settled()
        assert leader.token is not None
        time.sleep(0.3 + rng.uniform(0, self.peer.cycle))
        self.poller.set_fast(True)
        t0 = time.time()
        self.standin.partition(self.name, leader.pod, NET.api_ip, mode="drop")
        try:
            new = self.poller.wait_ready(t0, leader.token, 3 * lease_duration + 10)
            if new is None or new.pod == leader.pod:
                raise CampaignError(f"{self.name}: no other member led within {3 * lease_duration + 10:g}s "
                                    f"of cutting off {leader.pod}")
            time.sleep(1.0)
            deadline = time.monotonic() + 3 * lease_duration
            while time.monotonic() < deadline and (latest := self.poller.latest().get(leader.pod)) and latest.ready:
                time.sleep(0.05)
            old = self.poller.last_ready(leader.pod, t0)
        finally:
            self.standin.heal(self.name, leader.pod, NET.api_ip)
            self.poller.set_fast(False)
        margin = new.sent - (old.received if old is not None else t0)
        return PartitionRun(failover=new.received - t0, margin=margin, old_pod=leader.pod, new_pod=new.pod)


@contextmanager
def pod_bed(plane: ControlPlane, workdir: Path) -> Iterator[tuple[Api, StandInKubelet, Poller]]:
    """A stand-in kubelet on ``plane`` and a poller of its pods."""
    if (reason := netns_supported()) is not None:
        raise CampaignError(f"partitions need network namespaces: {reason}")
    kubelet = StandInKubelet(kubeconfig=plane.info.kubeconfig, node=f"bench-{secrets.token_hex(3)}",
                             state_dir=workdir / "standin")
    poller = Poller(slow=0.05, fast=0.01)
    kubelet.start()
    try:
        poller.start()
        yield Api(plane.info.kubeconfig), kubelet, poller
    finally:
        poller.stop()
        kubelet.stop()


def partition_runs(plane: ControlPlane, workdir: Path, peers: list[PodPeer], *, runs: int, rng: random.Random,
                   progress: Callable[[str], None]) -> dict[str, list[PartitionRun]]:
    """``runs`` partitions of each peer's leader, one peer after the other, on one stand-in kubelet."""
    results: dict[str, list[PartitionRun]] = {}
    with pod_bed(plane, workdir) as (api, kubelet, poller):
        for peer in peers:
            progress(f"{peer.key}: partition from the API server x{runs}")
            group = PodGroup(api, kubelet, poller, peer)
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
