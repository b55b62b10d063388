"""End to end on the test bed: the operator, the controllers, the session's real node running
the pods as containers of the project's image (the injected sidecar + the sample poller
writing a fenced ledger), and PostgreSQL.

One group lives through the whole module, as a user's would: it comes up with one leader,
loses its leader pod, loses its leader's sidecar container (SIGKILL of the container's
processes, found in its cgroup by ``node_pods``), rolls out a spec change, and is deleted.
The ledger, written by every acting leader, must show no overlap and no lost item.

``USE_EXISTING_CLUSTER=true`` runs the same suite against the cluster of ``KUBECONFIG``:
see ``ledger_database`` for ``SINGLETON_E2E_POD_DSN`` and docs/development.md."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from singleton_election import contract
from singleton_testbed import node_pods
from singleton_testbed.harness.kubehelpers import (
    bound_token,
    get_json,
    pod_ready,
    pod_role,
    save_pod_logs,
    token_kubeconfig,
)
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from singleton_testbed.ledger import LedgerReport, check_ledger
from singleton_testbed.node_config import NodeLayout
from singleton_testbed.postgres import PostgresInfo
from singleton_testbed.procs import free_port
from tests.conftest import REAL_NODE_TOLERATION, Cluster, RealNode, phase_failed, use_existing_cluster
from tests.integration.kube.test_rbac import helm_template

# On the test bed pods run on the session's real node (``real_node``: root and containerd
# needed, skipped otherwise), from the project's image built and imported for the session; on
# an existing cluster (USE_EXISTING_CLUSTER=true) they run on its nodes, from the image
# SINGLETON_E2E_IMAGE (built and loaded beforehand: see docs/development.md).
REAL_CLUSTER = use_existing_cluster()
pytestmark = [pytest.mark.k8s, pytest.mark.controlplane]
IMAGE = os.environ.get("SINGLETON_E2E_IMAGE", "ghcr.io/singleton-dev/singleton:0.1.0")
# The operator checks a postgres backend's DSN from where it runs (here: this machine), which
# cannot resolve a cluster's Service names; on an existing cluster the group elects through a Lease.
BACKEND = "lease" if REAL_CLUSTER else "postgres"
POD_DSN_ENV = "SINGLETON_E2E_POD_DSN"
LEDGER_DSN_ENV = "SINGLETON_E2E_LEDGER_DSN"

GROUP = "e2e-" + secrets.token_hex(3)
# Faster than the defaults, yet with room for a loaded CI machine: a renewal that misses its
# deadline is a real step-down, a second handover in the rollout, an item lost in flight.
FAST = {"leaseDuration": "4s", "renewDeadline": "3s", "retryPeriod": "1s"}


@dataclasses.dataclass
class Bed:
    cluster: Cluster
    namespace: str
    image: str
    """The project's image: the pollers' and the injected sidecars'."""
    placement: dict[str, object]
    """What the pod template adds to run on the intended node (``RealNode.pod_placement``)."""
    operator: OperatorProcess
    ledger_dsn: str
    """Where this test process reads the ledger."""
    workdir: Path
    """The operator's log, and the pods' logs saved when a test fails."""
    node_work: Path | None
    """The test bed's real node's folder (its kubelet's and containerd's logs), None elsewhere."""
    sidecar_kills: int = 0
    """Leader sidecars SIGKILLed (each ends a term)."""

    def kubectl(self, *args: str, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, "-n", self.namespace, check=check)

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(self.cluster, "pods", "-n", self.namespace, "-l",
                                               f"{contract.LABEL_GROUP}={GROUP}")["items"]
        return items

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = get_json(self.cluster, "sgl", GROUP, "-n", self.namespace).get("status") or {}
        return result


def settled(bed: Bed, replicas: int) -> dict[str, Any] | None:
    """The leader pod once the group is settled: every pod ready, one leader, the rest standbys,
    and the status saying the same."""
    pods = [p for p in bed.pods() if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != replicas or not all(pod_ready(p) for p in pods):
        return None
    leaders = [p for p in pods if pod_role(p) == "leader"]
    if len(leaders) != 1 or sum(pod_role(p) == "standby" for p in pods) != replicas - 1:
        return None
    status = bed.status()
    leader = leaders[0]
    token = int(leader["metadata"]["annotations"][contract.ANNOTATION_TOKEN])
    if status.get("leader") != leader["metadata"]["name"] or status.get("token") != token:
        return None
    if status.get("readyStandbys") != replicas - 1 or status.get("phase") != "Running":
        return None
    return leader


def group_manifest(bed: Bed, extra_env: dict[str, str] | None = None) -> str:
    env = [{"name": "LEDGER_DSN", "valueFrom": {"secretKeyRef": {"name": "ledger-db", "key": "dsn"}}},
           *({"name": k, "value": v} for k, v in (extra_env or {}).items())]
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": GROUP},
            "spec": {"replicas": 3, "backend": BACKEND,
                     **({"postgres": {"secretRef": {"name": "ledger-db"}}} if BACKEND == "postgres" else {}),
                     "timings": FAST, "drain": {"timeout": "5s"}, "terminationGracePeriodSeconds": 10,
                     "service": {"ports": [{"port": 80, "targetPort": 7450}]},
                     "template": {"spec": {**bed.placement, "containers": [
                         {"name": "poller", "image": bed.image,
                          "command": ["singleton-sample-poller"], "env": env}]}}}}
    return json.dumps(body)


POSTGRES_IN_CLUSTER = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: ledger-pg}
spec:
  selector: {matchLabels: {app: ledger-pg}}
  template:
    metadata: {labels: {app: ledger-pg}}
    spec:
      containers:
      - name: postgres
        image: postgres:16-alpine
        env: [{name: POSTGRES_PASSWORD, value: ledger}]
        ports: [{containerPort: 5432}]
        readinessProbe: {exec: {command: [pg_isready, -U, postgres]}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: ledger-pg}
spec: {selector: {app: ledger-pg}, ports: [{port: 5432}]}
"""


@contextlib.contextmanager
def ledger_database(cluster: Cluster, namespace: str, pg_info: PostgresInfo | None) -> Iterator[tuple[str, str]]:
    """(DSN for the pods, DSN for this process).

    Test bed: the session's PostgreSQL, which admits the real node's pods (and the node IP) at
    the node IP. Existing cluster: ``SINGLETON_E2E_POD_DSN`` when set, a database reachable
    from the cluster's pods (and from this machine, or give ``SINGLETON_E2E_LEDGER_DSN`` for
    the same database as this machine reaches it); otherwise a ``postgres:16-alpine`` pod,
    read through a port-forward."""
    if not REAL_CLUSTER:
        if pg_info is None:
            pytest.skip("needs the session's own PostgreSQL (reachable from the pod network)")
        yield dataclasses.replace(pg_info, host=NodeLayout().node_ip).dsn, pg_info.dsn
        return
    if pod_dsn := os.environ.get(POD_DSN_ENV):
        yield pod_dsn, os.environ.get(LEDGER_DSN_ENV, pod_dsn)
        return
    cluster.apply(POSTGRES_IN_CLUSTER, namespace=namespace)
    cluster.kubectl("rollout", "status", "deployment/ledger-pg", "-n", namespace, "--timeout=180s")
    port = free_port()
    forward = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, "svc/ledger-pg", f"{port}:5432"],
                               env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        local = f"postgresql://postgres:ledger@127.0.0.1:{port}/postgres"
        wait_for(lambda: asyncio.run(_reachable(local)), 30, "the port-forward to PostgreSQL", 0.5)
        yield "postgresql://postgres:ledger@ledger-pg:5432/postgres", local
    finally:
        forward.terminate()
        forward.wait(10)


async def _reachable(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


@pytest.fixture(scope="module")
def bed(controllers: Cluster, singleton_crd: Path, pg_info: PostgresInfo | None, request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    cluster = controllers
    if REAL_CLUSTER:
        # Tolerating the test bed's taint costs nothing elsewhere, and lets the suite run on
        # a test bed's node through its kubeconfig alone (make e2e-existing).
        placement: dict[str, object] = {"tolerations": [REAL_NODE_TOLERATION]}
        image, node_work = IMAGE, None
    else:
        real_node: RealNode = request.getfixturevalue("real_node")
        image, placement = request.getfixturevalue("project_image"), real_node.pod_placement()
        node_work = real_node.node.paths.work
    namespace = "e2e-" + secrets.token_hex(3)
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "serviceaccount", "default", "-n", namespace, check=False)
    workdir = tmp_path_factory.mktemp("e2e-operator")
    # The operator runs with the chart's RBAC, and the chart's admission policy guards the pods.
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
        yaml.safe_dump({"admissionPolicy": {"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": namespace}}}}, values)
        values.flush()
        objects = helm_template("e2e-" + secrets.token_hex(3), namespace, "--values", values.name,
                                *[f"--show-only=templates/{t}.yaml" for t in
                                  ("serviceaccount", "clusterrole", "role", "admission-policy")])
    try:
        with ledger_database(cluster, namespace, pg_info) as (pod_dsn, local_dsn):
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ledger-db"},
                      "data": {"dsn": base64.b64encode(pod_dsn.encode()).decode()}}
            cluster.apply(json.dumps(secret), namespace=namespace)
            cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
            account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
            kubeconfig = token_kubeconfig(cluster, bound_token(cluster, namespace, account), namespace,
                                          workdir / "operator.kubeconfig")
            operator = OperatorProcess(kubeconfig, namespace, workdir / "operator.log",
                                       extra_args=["--namespace", namespace, "--sidecar-image", image])
            operator.start()
            try:
                yield Bed(cluster, namespace, image, placement, operator, local_dsn, workdir, node_work)
            finally:
                operator.stop()
    finally:
        cluster.kubectl("delete", *[f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects
                                    if o["kind"].startswith(("Cluster", "ValidatingAdmission"))],
                        "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        if cluster.control_plane is not None:
            # Kept beside the pods' logs, for reading after a failure.
            for log in ("audit.log", "kube-apiserver.log", "etcd.log"):
                source = cluster.control_plane.workdir / log
                if source.exists():
                    shutil.copy(source, workdir / log)


@pytest.fixture(autouse=True)
def _pod_logs_on_failure(bed: Bed, request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test leaves every container's log (the node's folder goes with the node), and
    prints the sidecars' last lines, which CI shows."""
    yield
    if not phase_failed(request):
        return
    folder = bed.workdir / f"pods-{request.node.name}"
    written = save_pod_logs(bed.cluster, bed.namespace, folder)
    if bed.node_work is not None:
        for log in ("kubelet.log", "containerd.log"):
            with contextlib.suppress(OSError):
                shutil.copy(bed.node_work / log, folder / log)
    (folder / "ledger-sessions.txt").write_text(asyncio.run(_ledger_sessions(bed.ledger_dsn)))
    print(f"\n[e2e] pods' logs and objects, events (and the node's logs) saved in {folder}")
    print((folder / "ledger-sessions.txt").read_text())
    print((folder / "events.txt").read_text()[-4000:])
    for path in written:
        if ".singleton-sidecar" in path.name:
            print(f"--- {path.name} (last 40 lines)")
            print("\n".join(path.read_text().splitlines()[-40:]))


async def _ledger_sessions(dsn: str) -> str:
    """The ledger database's sessions and who waits for whom: a poller that never writes may
    be waiting for a lock."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT pid, client_addr, state, wait_event_type, wait_event, pg_blocking_pids(pid) AS blocked_by, "
            "now() - xact_start AS in_transaction, left(query, 120) AS query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() ORDER BY pid")
    finally:
        await conn.close()
    return "\n".join(str(dict(row)) for row in rows) + "\n"


def test_1_three_replicas_one_leader_status_and_leader_endpoints(bed: Bed) -> None:
    bed.cluster.apply(group_manifest(bed), namespace=bed.namespace)
    leader = wait_for(lambda: settled(bed, 3), 90, "3 ready pods, one leader, status in agreement", 0.3)
    ip = leader["status"]["podIP"]

    def leader_endpoints() -> list[str]:
        slices = get_json(bed.cluster, "endpointslices", "-n", bed.namespace, "-l",
                          f"kubernetes.io/service-name={GROUP}-leader")["items"]
        return sorted(a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]
                      if (e.get("conditions") or {}).get("ready"))

    wait_for(lambda: leader_endpoints() == [ip], 20, "the leader Service to list only the leader", 0.3)
    conditions = {c["type"]: c for c in bed.status()["conditions"]}
    available = conditions["Available"]
    assert (available["status"], available["reason"]) == ("True", "LeaderReady"), conditions
    assert leader["metadata"]["name"] in available["message"], conditions
    assert conditions["Degraded"]["status"] == "False", conditions


def leader_name(bed: Bed) -> str:
    """The current leader, once its poller has written the ledger: a term ended before its app
    wrote anything would not show in the ledger, which test 5 counts on (a new pod's poller
    takes a moment to start)."""
    status = bed.status()
    token = int(status["token"])

    def written() -> bool:
        try:
            report = asyncio.run(check_ledger(bed.ledger_dsn, GROUP))
        except asyncpg.UndefinedTableError:
            return False  # the first leader's poller has not created the ledger yet
        return any(term[0] == token for term in report.terms)

    wait_for(written, 30, f"the leader (token {token}) to write the ledger", 0.3)
    name: str = status["leader"]
    return name


def test_2_deleting_the_leader_pod_hands_over(bed: Bed) -> None:
    old = leader_name(bed)
    old_token = bed.status()["token"]
    bed.kubectl("delete", "pod", old, "--wait=false")
    started = time.monotonic()
    wait_for(lambda: (s := bed.status()).get("leader") not in (None, old) and s.get("token", 0) > old_token, 30,
             "a new leader in the status", 0.1)
    handover = time.monotonic() - started
    assert handover < 10, handover
    wait_for(lambda: settled(bed, 3), 60, "the group to settle again", 0.3)


def test_3_killing_the_leaders_sidecar_fails_over(bed: Bed) -> None:
    old = leader_name(bed)
    old_token = bed.status()["token"]
    pod = get_json(bed.cluster, "pod", old, "-n", bed.namespace)
    if REAL_CLUSTER and not node_pods.on_this_machine(pod):
        pytest.skip("the leader's containers are not on this machine: node_pods signals containers of "
                    "the node running here only")
    # Every process of the sidecar container (its PID 1 included), not the poller's.
    killed = node_pods.signal_container(pod, "singleton-sidecar", signal.SIGKILL)
    assert killed
    bed.sidecar_kills += 1
    # A new term: on another pod, or on this one when its restarted sidecar takes over its own
    # predecessor's term at once (SINGLETON_SOLE_CANDIDATE_IN_POD, docs/concepts.md).
    wait_for(lambda: (s := bed.status()).get("leader") is not None and s.get("token", 0) > old_token, 30,
             "a new term", 0.1)
    # The killed sidecar is restarted by the kubelet: it leads again if its pod won the new term,
    # else it stands by.
    def restarted() -> bool:
        pod = get_json(bed.cluster, "pod", old, "-n", bed.namespace)
        statuses = pod["status"].get("initContainerStatuses") or []
        expected = "leader" if bed.status().get("leader") == old else "standby"
        return any(s["name"] == "singleton-sidecar" and s["restartCount"] >= 1 for s in statuses) and \
            pod_role(pod) == expected

    wait_for(restarted, 30, "the sidecar to restart as a standby", 0.3)
    wait_for(lambda: settled(bed, 3), 60, "the group to settle again", 0.3)


def test_4_a_spec_change_rolls_out_with_exactly_one_handover_to_a_new_pod(bed: Bed) -> None:
    leader_name(bed)  # the current term has written before the rollout ends it
    before = {p["metadata"]["name"] for p in bed.pods()}
    transitions = bed.status()["transitions"]
    bed.cluster.apply(group_manifest(bed, {"SAMPLE_ITEM_SECONDS": "0.03"}), namespace=bed.namespace)
    leaders_seen: list[str] = []
    history: list[str] = []

    def rolled() -> dict[str, Any] | None:
        pods = bed.pods()
        history.append(" ".join(f"{p['metadata']['name'][-5:]}:{pod_role(p)}" for p in pods))
        name = next((p["metadata"]["name"] for p in pods if pod_role(p) == "leader"), None)
        if name and (not leaders_seen or leaders_seen[-1] != name):
            leaders_seen.append(name)
        leader = settled(bed, 3)
        if leader is None:
            return None
        if leaders_seen[-1:] != [leader["metadata"]["name"]]:
            leaders_seen.append(leader["metadata"]["name"])
        names = {p["metadata"]["name"] for p in bed.pods()}
        return leader if not names & before else None

    leader = wait_for(rolled, 120, "the rollout to complete (no deadlock)", 0.2)
    assert leader["metadata"]["name"] not in before
    assert len(leaders_seen) == 2, f"leaders during the rollout: {leaders_seen}; history: {history}"
    assert bed.status()["transitions"] == transitions + 1
    deployment = get_json(bed.cluster, "deployment", GROUP, "-n", bed.namespace)
    assert deployment["status"].get("updatedReplicas") == 3


def test_5_the_ledger_shows_no_overlap_and_no_lost_item(bed: Bed) -> None:
    # The last term (the rollout's new leader) counts once its poller has written: the group
    # settles (status, readiness) before that first write, which takes the poller a moment.
    token = int(bed.status()["token"])

    def written() -> LedgerReport | None:
        report = asyncio.run(check_ledger(bed.ledger_dsn, GROUP))
        return report if any(term[0] == token for term in report.terms) else None

    report = wait_for(written, 30, f"the current leader (token {token}) to write", 0.5)
    # One term to begin with, one per handover: deletion, sidecar kill (when it ran), rollout.
    assert len(report.terms) >= 3 + bed.sidecar_kills, f"{report.terms}; {report.summary()}"
    assert not report.overlaps, report.overlaps
    assert not report.regressions, report.regressions
    # Every term but the last has ended, and none left an item started and not done: a deleted
    # or rolled-out leader drains (its sidecar releases only once the poller's container, told
    # to stop, has finished its item), and a takeover from a killed sidecar acts only once the
    # old lease has expired (a cooperative app declares no shorter stop bound), by when the old
    # poller's item in flight, 20-30 ms of work, is long done. The last term may be mid-item.
    lost = report.lost_at_handover
    assert len(lost) == 0, f"{len(lost)} items lost at handovers: {lost}; {report.summary()}"


def test_6_deleting_the_service_removes_everything(bed: Bed) -> None:
    bed.kubectl("delete", "sgl", GROUP)
    account = f"singleton-sidecar-{GROUP}"
    for kind, name in [("deployment", GROUP), ("service", f"{GROUP}-leader"), ("pdb", GROUP),
                       ("serviceaccount", account), ("role", account), ("rolebinding", account)]:
        wait_for(lambda k=kind, n=name: bed.kubectl("get", k, n, check=False).returncode != 0, 60,
                 f"{kind} {name} to go", 0.3)
    wait_for(lambda: not bed.pods(), 60, "the pods to go", 0.3)
