"""The client-go peer of the benchmarks (benchmarks/clientgo): our own tiny Go elector on
client-go's leaderelection, built from Go modules, against the test bed's API server.
Checks that the comparison tooling measures what it claims: one leader, the /readyz and
/leader shape, and a prompt handover on SIGTERM (ReleaseOnCancel)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from benchmarks.clientgo.elector import USER_AGENT, BuildError, ClientGoProcess, build, one_clientgo_leader
from benchmarks.clientgo.unfenced_worker import term_of
from benchmarks.compare_partition import OnNode, PodPeer, partition_runs

from singleton_testbed.harness.kubehelpers import get_json
from singleton_testbed.harness.sidecars import SidecarProcess, wait_for, wait_serving
from singleton_testbed.ledger import check_ledger, read_acts
from tests.conftest import REAL_NODE_TOLERATION, Cluster, RealNode

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
    assert lead_doc["ready"] is True and lead_doc["token"] == term_of(lead_doc)  # the term's start, epoch ms
    assert [m.ready() for m in members] == [m is leader for m in members]
    assert standby_doc["isLeader"] is False and standby_doc["since"] is None
    assert standby_doc["ready"] is False and standby_doc["token"] is None
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


@pytest.mark.timeout(240)
def test_partition_failover_is_measured_for_both_peers(real_node: RealNode, project_image: str,
                                                      clientgo_binary: Path, tmp_path: Path) -> None:
    """``benchmarks/compare_partition.py`` on the session's real node: each peer's leader pod is
    cut off from the API server, another member takes over, and the margin between the old
    leader's last ready answer and the new one's first is measured (ours must be positive:
    our leader stops at its renew deadline, before the lease can expire)."""
    assert real_node.cluster.control_plane is not None
    peers = [PodPeer("ours", "ours", FAST, FAST[2]), PodPeer("clientgo", "client-go", FAST, FAST[2] * 2.2,
                                                            clientgo_binary)]
    runs = partition_runs(real_node.cluster.control_plane, tmp_path, peers, runs=1, rng=random.Random(1),
                          progress=lambda _text: None,
                          on_node=OnNode(real_node.node, project_image, [REAL_NODE_TOLERATION]))
    (ours,), (clientgo,) = runs["ours"], runs["clientgo"]
    for run in (ours, clientgo):
        assert run.new_pod != run.old_pod
    lease_duration, renew_deadline, retry_period = FAST
    # Expiry counts from the last renewal the standbys saw, at most a retry period before the cut.
    assert lease_duration - retry_period - 0.5 < ours.failover < lease_duration + 1.0, ours
    assert ours.margin > (lease_duration - renew_deadline) / 2, ours
    assert lease_duration - retry_period - 0.5 < clientgo.failover < lease_duration + 2.2 * retry_period + 1.0


@pytest.mark.postgres
@pytest.mark.parametrize("fenced", [False, True], ids=["unfenced", "fenced"])
def test_the_clientgo_worker_logs_its_acts_as_ours_does(cluster: Cluster, namespace: str, clientgo_binary: Path,
                                                        tmp_path: Path, *, pg_dsn: str, fenced: bool) -> None:
    """``benchmarks/compare_clientgo.py`` judges both peers' workers by one act log: the client-go
    worker logs every write as an act of the elector's term (its start, epoch ms), through
    ``singleton_testbed.actlog`` as ``tests/data/ledger_worker.py`` does, fenced or not."""
    lease = "cg-" + uuid.uuid4().hex[:8]
    members = [ClientGoProcess(f"w{i}", {}, tmp_path / f"w{i}.log", binary=clientgo_binary,
                               kubeconfig=cluster.kubeconfig, namespace=namespace, lease=lease,
                               identity=f"w{i}-{uuid.uuid4().hex[:6]}", timings=FAST, ledger_dsn=pg_dsn,
                               fence=fenced).start() for i in range(2)]
    leader: ClientGoProcess | None = None
    try:
        wait_serving(list[SidecarProcess](members), 10)
        leader = one_clientgo_leader(members, timeout=15)
        term = term_of(leader.leader_doc())
        assert term is not None

        def acts() -> int:
            return len(asyncio.run(read_acts(pg_dsn, lease)) or [])  # None: no worker made the table yet

        wait_for(lambda: acts() >= 10, 20, "the leader's worker to act", interval=0.2)
    finally:
        # The standby first: the leader releases the Lease as it stops, and a standby still
        # running would take it at once and act under a second term.
        for member in sorted(members, key=lambda m: m is leader):
            member.stop()
    judged = asyncio.run(check_ledger(pg_dsn, lease))
    assert judged.acts_checked and judged.safe, judged.summary()
    assert [(a.token, a.identity) for a in judged.acting.actors] == [(term, leader.identity)]
    assert {token for token, *_ in judged.terms} == {term}
    assert "fenced out" not in leader.log()
