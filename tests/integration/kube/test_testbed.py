"""The test bed is real: each test here would fail against a fake API server or database."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from singleton_testbed.binaries import kubernetes_version
from singleton_testbed.controlplane import wait_established
from tests.conftest import Cluster
from tests.support.paths import DATA

PROBE_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: probes.testbed.singleton.dev
spec:
  group: testbed.singleton.dev
  names: {kind: Probe, plural: probes, singular: probe}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - rule: "!has(self.min) || !has(self.max) || self.min <= self.max"
              message: "spec.min must not exceed spec.max"
            properties:
              min: {type: integer}
              max: {type: integer}
              size: {type: integer, minimum: 1}
          status:
            type: object
            x-kubernetes-preserve-unknown-fields: true
"""


@pytest.fixture(scope="module")
def probe_crd(cluster: Cluster) -> None:
    cluster.apply(PROBE_CRD)
    wait_established(cluster.kubectl, "crd/probes.testbed.singleton.dev", timeout=30)


def test_crd_cel_rule_rejects_with_its_message(cluster: Cluster, probe_crd: None, namespace: str) -> None:
    good = "apiVersion: testbed.singleton.dev/v1\nkind: Probe\nmetadata: {name: good}\nspec: {min: 1, max: 2}\n"
    cluster.apply(good, namespace=namespace)
    bad = "apiVersion: testbed.singleton.dev/v1\nkind: Probe\nmetadata: {name: bad}\nspec: {min: 3, max: 2}\n"
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bad, check=False)
    assert result.returncode != 0
    assert "spec.min must not exceed spec.max" in result.stderr


def _lease(namespace: str, holder: str, rv: str | None = None) -> str:
    meta: dict[str, object] = {"name": "probe", "namespace": namespace}
    if rv is not None:
        meta["resourceVersion"] = rv
    return json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                       "spec": {"holderIdentity": holder, "leaseDurationSeconds": 5}})


def test_stale_resource_version_gets_409(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "-f", "-", input_text=_lease(namespace, "a"))
    rv = json.loads(cluster.kubectl("get", "lease", "probe", "-n", namespace, "-o", "json").stdout)[
        "metadata"]["resourceVersion"]
    cluster.kubectl("replace", "-f", "-", input_text=_lease(namespace, "b", rv))
    stale = cluster.kubectl("replace", "-f", "-", input_text=_lease(namespace, "c", rv), check=False)
    assert stale.returncode != 0
    assert "the object has been modified" in stale.stderr  # the API server's 409 Conflict text
    holder = cluster.kubectl("get", "lease", "probe", "-n", namespace, "-o", "jsonpath={.spec.holderIdentity}")
    assert holder.stdout == "b"


def test_service_account_rbac_403_then_allowed(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token = cluster.kubectl("create", "token", "reader", "-n", namespace).stdout.strip()
    server = cluster.kubectl("config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}").stdout
    as_reader = ["--server", server, "--token", token, "--insecure-skip-tls-verify", "--kubeconfig", "/dev/null"]
    denied = cluster.kubectl("get", "configmaps", "-n", namespace, *as_reader, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr
    cluster.kubectl("create", "role", "cm-reader", "--verb=get,list", "--resource=configmaps", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "cm-reader", "--role=cm-reader",
                    f"--serviceaccount={namespace}:reader", "-n", namespace)
    deadline = time.monotonic() + 10
    while True:
        allowed = cluster.kubectl("get", "configmaps", "-n", namespace, *as_reader, check=False)
        if allowed.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert allowed.returncode == 0, allowed.stderr


def test_kopf_sees_object_created_by_kubectl(
    cluster: Cluster, probe_crd: None, namespace: str, tmp_path: Path
) -> None:
    seen = tmp_path / "seen.txt"
    operator = DATA / "kopf_probe" / "operator.py"
    env = {**cluster.env, "PROBE_SEEN_FILE": str(seen)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace, str(operator)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        obj = "apiVersion: testbed.singleton.dev/v1\nkind: Probe\nmetadata: {name: hello}\nspec: {size: 7}\n"
        cluster.apply(obj, namespace=namespace)
        deadline = time.monotonic() + 30
        while not (seen.exists() and seen.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen.exists(), "kopf never saw the object"
        assert seen.read_text().strip() == "hello 7"
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=20)
    assert "Traceback" not in output, output


NODE = """
apiVersion: v1
kind: Node
metadata:
  name: {name}
  labels: {{kubernetes.io/hostname: {name}}}
"""


def test_deployment_gets_replicaset_and_bound_pods(controllers: Cluster, namespace: str) -> None:
    cluster = controllers
    node = f"node-{namespace}"[:60]
    cluster.apply(NODE.format(name=node))
    status = {"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}],
        "allocatable": {"cpu": "8", "memory": "16Gi", "pods": "110"},
        "capacity": {"cpu": "8", "memory": "16Gi", "pods": "110"},
    }}
    cluster.kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    # The TaintNodesByCondition admission plugin taints every new node not-ready; with no
    # kubelet and no node-lifecycle controller, we lift it as a kubelet's readiness would.
    cluster.kubectl("taint", "node", node, "node.kubernetes.io/not-ready:NoSchedule-")
    try:
        cluster.kubectl("create", "deployment", "web", "--image=registry.invalid/web:1", "--replicas=2",
                        "-n", namespace)
        deadline = time.monotonic() + 60
        pods: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
            if len(pods) == 2 and all(p["spec"].get("nodeName") == node for p in pods):  # type: ignore[attr-defined]
                break
            time.sleep(0.3)
        assert len(pods) == 2
        assert all(p["spec"].get("nodeName") == node for p in pods)  # type: ignore[attr-defined]
        rs = json.loads(cluster.kubectl("get", "rs", "-n", namespace, "-o", "json").stdout)["items"]
        assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["name"] == "web"
    finally:
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)


CHART = {
    "Chart.yaml": "apiVersion: v2\nname: tiny\nversion: 0.1.0\nkubeVersion: '>=1.29.0-0'\n",
    "templates/cm.yaml": (
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  kube: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    ),
}


def test_helm_install_and_uninstall(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "tiny"
    for rel, text in CHART.items():
        (chart / rel).parent.mkdir(parents=True, exist_ok=True)
        (chart / rel).write_text(text)
    env = cluster.env
    subprocess.run(["helm", "install", "tiny", str(chart), "-n", namespace, "--wait", "--timeout", "60s"],
                   env=env, check=True, capture_output=True, text=True)
    version = cluster.kubectl("get", "cm", "tiny-cm", "-n", namespace, "-o", "jsonpath={.data.kube}").stdout
    assert version.startswith("v1.")
    subprocess.run(["helm", "uninstall", "tiny", "-n", namespace, "--wait"], env=env, check=True,
                   capture_output=True, text=True)
    gone = cluster.kubectl("get", "cm", "tiny-cm", "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


async def test_advisory_lock_is_exclusive_and_freed_on_disconnect(pg_dsn: str) -> None:
    holder = await asyncpg.connect(pg_dsn)
    other = await asyncpg.connect(pg_dsn)
    try:
        assert await holder.fetchval("SELECT pg_try_advisory_lock(4242)") is True
        assert await other.fetchval("SELECT pg_try_advisory_lock(4242)") is False
        await holder.close()
        assert await other.fetchval("SELECT pg_try_advisory_lock(4242)") is True
    finally:
        await other.close()
        if not holder.is_closed():
            await holder.close()


def test_server_is_not_a_fake(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    if os.environ.get("USE_EXISTING_CLUSTER"):
        return
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]
    assert version["serverVersion"]["gitVersion"] == kubernetes_version()


@pytest.mark.skipif(os.geteuid() != 0, reason="the real node's lock lives in /run (root)")
def test_busy_reason_says_who_holds_the_real_nodes_lock() -> None:
    """``singleton-testbed up`` starts without a node, saying why, while another holds the
    machine's lock (flock: a second open file conflicts even in the same process)."""
    from singleton_testbed import node

    node.RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(node.RUN_DIR / "lock", "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            ours = True
        except BlockingIOError:
            ours = False  # a real node runs (the session's): it holds the lock
        reason = node.busy_reason()
        assert reason is not None and reason.startswith("another real node runs on this machine"), reason
    if ours:
        assert node.busy_reason() is None  # closing the file released the lock
