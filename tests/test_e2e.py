"""End to end on the test bed: the operator, the controllers, the kubelet stand-in running
real pods (sidecar + the sample poller writing a fenced ledger), and PostgreSQL.

One group lives through the whole module, as a user's would: it comes up with one leader,
loses its leader pod, loses a sidecar process, rolls out a spec change, and is deleted.
The ledger, written by every acting leader, must show no overlap and no lost item."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_sidecar import contract
from singleton_testbed.kubelet_control import StandInKubelet
from singleton_testbed.netns import PodNetworkConfig, netns_supported
from singleton_testbed.postgres import PostgresInfo
from tests.conftest import Cluster, use_existing_cluster
from tests.kubehelpers import get_json
from tests.ledger import check_ledger
from tests.operators import OperatorProcess
from tests.sidecars import wait_for
from tests.test_rbac import bound_token, helm_template, token_kubeconfig

_SKIP = netns_supported() or ("runs pods with the stand-in kubelet" if use_existing_cluster() else None)
pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

NET = PodNetworkConfig()
GROUP = "e2e-" + secrets.token_hex(3)
FAST = {"leaseDuration": "2s", "renewDeadline": "1500ms", "retryPeriod": "500ms"}


@dataclasses.dataclass
class Bed:
    cluster: Cluster
    namespace: str
    kubelet: StandInKubelet
    operator: OperatorProcess
    ledger_dsn: str

    def kubectl(self, *args: str, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, "-n", self.namespace, check=check)

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(self.cluster, "pods", "-n", self.namespace, "-l",
                                               f"{contract.LABEL_GROUP}={GROUP}")["items"]
        return items

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = get_json(self.cluster, "sgl", GROUP, "-n", self.namespace).get("status") or {}
        return result


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def role(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(contract.ANNOTATION_ROLE)


def settled(bed: Bed, replicas: int) -> dict[str, Any] | None:
    """The leader pod once the group is settled: every pod ready, one leader, the rest standbys,
    and the status saying the same."""
    pods = [p for p in bed.pods() if not p["metadata"].get("deletionTimestamp")]
    if len(pods) != replicas or not all(ready(p) for p in pods):
        return None
    leaders = [p for p in pods if role(p) == "leader"]
    if len(leaders) != 1 or sum(role(p) == "standby" for p in pods) != replicas - 1:
        return None
    status = bed.status()
    leader = leaders[0]
    token = int(leader["metadata"]["annotations"][contract.ANNOTATION_TOKEN])
    if status.get("leader") != leader["metadata"]["name"] or status.get("token") != token:
        return None
    if status.get("readyStandbys") != replicas - 1 or status.get("phase") != "Running":
        return None
    return leader


def group_manifest(extra_env: dict[str, str] | None = None) -> str:
    env = [{"name": "LEDGER_DSN", "valueFrom": {"secretKeyRef": {"name": "ledger-db", "key": "dsn"}}},
           *({"name": k, "value": v} for k, v in (extra_env or {}).items())]
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": GROUP},
            "spec": {"replicas": 3, "backend": "postgres", "postgres": {"secretRef": {"name": "ledger-db"}},
                     "timings": FAST, "drain": {"timeout": "5s"}, "terminationGracePeriodSeconds": 10,
                     "service": {"ports": [{"port": 80, "targetPort": 9090}]},
                     "template": {"spec": {"containers": [
                         {"name": "poller", "image": "ghcr.io/singleton-dev/singleton:0.1.0",
                          "command": ["singleton-sample-poller"], "env": env}]}}}}
    return json.dumps(body)


@pytest.fixture(scope="module")
def bed(controllers: Cluster, singleton_crd: Path, pg_info: PostgresInfo | None,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    if pg_info is None:
        pytest.skip("needs the session's own PostgreSQL (reachable from the pod network)")
    cluster = controllers
    namespace = "e2e-" + secrets.token_hex(3)
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "serviceaccount", "default", "-n", namespace, check=False)
    pod_dsn = dataclasses.replace(pg_info, host=NET.postgres_ip).dsn
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ledger-db"},
              "data": {"dsn": base64.b64encode(pod_dsn.encode()).decode()}}
    cluster.apply(json.dumps(secret), namespace=namespace)
    kubelet = StandInKubelet(kubeconfig=cluster.kubeconfig, node="e2e-" + secrets.token_hex(3),
                             state_dir=tmp_path_factory.mktemp("e2e-kubelet"))
    workdir = tmp_path_factory.mktemp("e2e-operator")
    # The operator runs with the chart's RBAC, and the chart's admission policy guards the pods.
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
        yaml.safe_dump({"admissionPolicy": {"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": namespace}}}}, values)
        values.flush()
        objects = helm_template("e2e-" + secrets.token_hex(3), namespace, "--values", values.name,
                                *[f"--show-only=templates/{t}.yaml" for t in
                                  ("serviceaccount", "clusterrole", "role", "admission-policy")])
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, bound_token(cluster, namespace, account), namespace,
                                  workdir / "operator.kubeconfig")
    operator = OperatorProcess(kubeconfig, namespace, workdir / "operator.log", extra_args=["--namespace", namespace])
    kubelet.start()
    operator.start()
    try:
        yield Bed(cluster, namespace, kubelet, operator, pod_dsn)
    finally:
        operator.stop()
        kubelet.stop()
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


def test_1_three_replicas_one_leader_status_and_leader_endpoints(bed: Bed) -> None:
    bed.cluster.apply(group_manifest(), namespace=bed.namespace)
    leader = wait_for(lambda: settled(bed, 3), 90, "3 ready pods, one leader, status in agreement", 0.3)
    ip = leader["status"]["podIP"]

    def leader_endpoints() -> list[str]:
        slices = get_json(bed.cluster, "endpointslices", "-n", bed.namespace, "-l",
                          f"kubernetes.io/service-name={GROUP}-leader")["items"]
        return sorted(a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]
                      if (e.get("conditions") or {}).get("ready"))

    wait_for(lambda: leader_endpoints() == [ip], 20, "the leader Service to list only the leader", 0.3)
    assert bed.status()["conditions"][0]["type"] == "Available"


def leader_name(bed: Bed) -> str:
    name: str = bed.status()["leader"]
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
    bed.kubelet.signal(bed.namespace, old, "singleton-sidecar", "SIGKILL")
    wait_for(lambda: (s := bed.status()).get("leader") not in (None, old) and s.get("token", 0) > old_token, 30,
             "another pod to lead", 0.1)
    # The killed sidecar is restarted by the kubelet and stands by.
    def restarted() -> bool:
        pod = get_json(bed.cluster, "pod", old, "-n", bed.namespace)
        statuses = pod["status"].get("initContainerStatuses") or []
        return any(s["name"] == "singleton-sidecar" and s["restartCount"] >= 1 for s in statuses) and \
            role(pod) == "standby"

    wait_for(restarted, 30, "the sidecar to restart as a standby", 0.3)
    wait_for(lambda: settled(bed, 3), 60, "the group to settle again", 0.3)


def test_4_a_spec_change_rolls_out_with_exactly_one_handover_to_a_new_pod(bed: Bed) -> None:
    before = {p["metadata"]["name"] for p in bed.pods()}
    transitions = bed.status()["transitions"]
    bed.cluster.apply(group_manifest({"SAMPLE_ITEM_SECONDS": "0.03"}), namespace=bed.namespace)
    leaders_seen: list[str] = []
    history: list[str] = []

    def rolled() -> dict[str, Any] | None:
        pods = bed.pods()
        history.append(" ".join(f"{p['metadata']['name'][-5:]}:{role(p)}" for p in pods))
        name = next((p["metadata"]["name"] for p in pods if role(p) == "leader"), None)
        if name and (not leaders_seen or leaders_seen[-1] != name):
            leaders_seen.append(name)
        leader = settled(bed, 3)
        if leader is None:
            return None
        names = {p["metadata"]["name"] for p in bed.pods()}
        return leader if not names & before else None

    leader = wait_for(rolled, 120, "the rollout to complete (no deadlock)", 0.2)
    assert leader["metadata"]["name"] not in before
    assert len(leaders_seen) == 2, f"leaders during the rollout: {leaders_seen}; history: {history}"
    assert bed.status()["transitions"] == transitions + 1
    deployment = get_json(bed.cluster, "deployment", GROUP, "-n", bed.namespace)
    assert deployment["status"].get("updatedReplicas") == 3


def test_5_the_ledger_shows_no_overlap_and_no_lost_item(bed: Bed) -> None:
    report = asyncio.run(check_ledger(bed.ledger_dsn.replace(NET.postgres_ip, "127.0.0.1"), GROUP))
    assert len(report.terms) >= 4, report.terms
    assert not report.overlaps, report.overlaps
    assert not report.regressions, report.regressions


def test_6_deleting_the_service_removes_everything(bed: Bed) -> None:
    bed.kubectl("delete", "sgl", GROUP)
    account = f"singleton-sidecar-{GROUP}"
    for kind, name in [("deployment", GROUP), ("service", f"{GROUP}-leader"), ("pdb", GROUP),
                       ("serviceaccount", account), ("role", account), ("rolebinding", account)]:
        wait_for(lambda k=kind, n=name: bed.kubectl("get", k, n, check=False).returncode != 0, 60,
                 f"{kind} {name} to go", 0.3)
    wait_for(lambda: not bed.pods(), 60, "the pods to go", 0.3)
