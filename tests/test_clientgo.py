"""The client-go peer of the benchmarks (benchmarks/clientgo): our own tiny Go elector on
client-go's leaderelection, built from Go modules, against the test bed's API server.
Checks that the comparison tooling measures what it claims: one leader, the /readyz and
/leader shape, and a prompt handover on SIGTERM (ReleaseOnCancel)."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from benchmarks.clientgo.elector import USER_AGENT, BuildError, ClientGoProcess, build, one_clientgo_leader

from tests.conftest import Cluster
from tests.kubehelpers import get_json
from tests.sidecars import SidecarProcess, wait_for, wait_serving

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

FAST = (4.0, 3.0, 1.0)  # lease duration, renew deadline, retry period (s)
Factory = Callable[[int], list[ClientGoProcess]]


@pytest.fixture(scope="session")
def clientgo_binary() -> Path:
    try:
        return build()
    except BuildError as exc:
        pytest.skip(f"cannot build the client-go elector: {exc}")


@pytest.fixture
def electors(cluster: Cluster, namespace: str, clientgo_binary: Path, tmp_path: Path) -> Iterator[Factory]:
    lease = "cg-" + uuid.uuid4().hex[:8]
    started: list[ClientGoProcess] = []

    def make(count: int) -> list[ClientGoProcess]:
        for _ in range(count):
            name = f"e{len(started)}"
            started.append(ClientGoProcess(
                name, {}, tmp_path / f"{name}.log", binary=clientgo_binary, kubeconfig=cluster.kubeconfig,
                namespace=namespace, lease=lease, identity=f"{name}-{uuid.uuid4().hex[:6]}", timings=FAST,
            ).start())
        wait_serving(list[SidecarProcess](started), 10)
        return list(started)

    yield make
    for elector in started:
        elector.stop()


def test_one_leader_and_sigterm_hands_over_at_once(electors: Factory, cluster: Cluster, namespace: str) -> None:
    members = electors(2)
    leader = one_clientgo_leader(members, timeout=15)
    standby = next(m for m in members if m is not leader)
    docs = {m.name: m.leader_doc() for m in members}
    lead_doc, standby_doc = docs[leader.name], docs[standby.name]
    assert lead_doc is not None and standby_doc is not None
    assert lead_doc["isLeader"] is True and lead_doc["identity"] == leader.identity
    assert lead_doc["leader"] == leader.identity and lead_doc["since"]
    assert [m.ready() for m in members] == [m is leader for m in members]
    assert standby_doc["isLeader"] is False and standby_doc["since"] is None
    wait_for(lambda: (standby.leader_doc() or {}).get("leader") == leader.identity, 5, "the standby to see the leader")
    lease = get_json(cluster, "lease", leader.lease, "-n", namespace)
    assert lease["spec"]["holderIdentity"] == leader.identity
    assert lease["spec"]["leaseDurationSeconds"] == int(FAST[0])

    started = time.monotonic()
    leader.signal(signal.SIGTERM)
    assert leader.wait_exit(10) == 0  # released the Lease (ReleaseOnCancel), then exited
    # Released, the standby takes it at its next retry (period 1 s, jitter up to 1.2x more);
    # without the release it would first wait for the lease to expire (4 s).
    wait_for(standby.ready, FAST[0] - 0.5, "the standby to lead", interval=0.005)
    assert time.monotonic() - started < FAST[0] - 0.5
    doc = standby.leader_doc()
    assert doc is not None and doc["isLeader"] is True and doc["leader"] == standby.identity
    lease = get_json(cluster, "lease", leader.lease, "-n", namespace)
    assert lease["spec"]["holderIdentity"] == standby.identity
    assert lease["spec"]["leaseTransitions"] >= 1


def test_requests_are_counted_by_user_agent(electors: Factory, cluster: Cluster) -> None:
    """The benchmark counts each peer's API requests in the audit log by user agent."""
    if cluster.control_plane is None:
        pytest.skip("the audit log belongs to the test bed's API server")
    members = electors(1)
    leader = one_clientgo_leader(members, timeout=15)
    audit = cluster.control_plane.workdir / "audit.log"

    def renewals() -> int:
        entries = [json.loads(line) for line in audit.read_text().splitlines() if USER_AGENT in line]
        return len({e["auditID"] for e in entries if e.get("userAgent", "").startswith(USER_AGENT)
                    and e["verb"] == "update" and e.get("objectRef", {}).get("name") == leader.lease})

    wait_for(lambda: renewals() >= 2, 10, "two renewals by the elector in the audit log", interval=0.2)
