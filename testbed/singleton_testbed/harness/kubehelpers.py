"""Test helpers for service accounts and pod objects on the cluster under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import yaml

from singleton_election import contract
from singleton_election.kube import KubeError, load_kube_config
from singleton_election.kube_blocking import BlockingKubeClient


class KubectlRunner(Protocol):
    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True) -> Any: ...


def bound_token(cluster: KubectlRunner, namespace: str, account: str, pod: dict[str, Any] | None = None, *,
                duration: str = "1h") -> str:
    """A fresh token of the ServiceAccount ``namespace/account``, bound to ``pod`` when given
    (the admission policy admits a sidecar's pod patches only with a token bound to its pod)."""
    args = ["create", "token", account, "-n", namespace, f"--duration={duration}"]
    if pod is not None:
        args += ["--bound-object-kind", "Pod", "--bound-object-name", pod["metadata"]["name"],
                 "--bound-object-uid", pod["metadata"]["uid"]]
    return str(cluster.kubectl(*args).stdout.strip())


def token_kubeconfig(cluster: KubectlRunner, token: str, namespace: str, path: Path) -> Path:
    """The cluster's kubeconfig, authenticating with ``token`` alone, ``namespace`` the default."""
    config = json.loads(cluster.kubectl("config", "view", "--minify", "--raw", "-o", "json").stdout)
    config["users"] = [{"name": "sa", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"] |= {"user": "sa", "namespace": namespace}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def service_account_kubeconfig(cluster: KubectlRunner, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as ``namespace/account`` with a fresh bound token."""
    return token_kubeconfig(cluster, bound_token(cluster, namespace, account, duration="2h"), namespace, path)


def grant(cluster: KubectlRunner, namespace: str, account: str, rules: list[dict[str, list[str]]]) -> None:
    """A ServiceAccount with a Role holding exactly ``rules``, bound to it."""
    cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": account, "namespace": namespace}, "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": account, "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
               "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List",
                                                               "items": [role, binding]}))


def create_pod(cluster: KubectlRunner, namespace: str, name: str, *, labels: dict[str, str] | None = None,
               node: str = "no-kubelet") -> dict[str, Any]:
    """A pod object bound to a node with no kubelet: it never runs, but deleting it is graceful
    (the deletionTimestamp stays until someone force-deletes it), as with a real kubelet."""
    # The node must exist, or the pod garbage collector removes the pod as an orphan.
    ensure_node(cluster, node)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
           "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                    "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}
    out = cluster.kubectl("create", "-f", "-", "-o", "json", input_text=json.dumps(pod)).stdout
    created: dict[str, Any] = json.loads(out)
    return created


def ensure_node(cluster: KubectlRunner, name: str) -> None:
    """A Node object with no kubelet behind it (the test bed runs no node-lifecycle controller)."""
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"singleton.dev/fake": "true"}}}
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(node))


def pod_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def pod_role(pod: dict[str, Any]) -> str | None:
    """The role its sidecar wrote on the pod (``singleton.dev/role``), None before it did."""
    role: str | None = (pod["metadata"].get("annotations") or {}).get(contract.ANNOTATION_ROLE)
    return role


def get_json(cluster: KubectlRunner, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return result


def save_pod_logs(cluster: KubectlRunner, namespace: str, folder: Path, *, selector: str | None = None) -> list[Path]:
    """Every container's log (and its previous incarnation's, when it restarted) of the pods in
    ``namespace`` into ``folder``, with the pods' objects beside them: what a failed test leaves
    to read, since the node's own folder goes with the node. Returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    selection = ["-l", selector] if selector else []
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, *selection, "-o", "json").stdout)
    (folder / "pods.json").write_text(json.dumps(pods, indent=1))
    events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", "-o", "wide", check=False)
    (folder / "events.txt").write_text(events.stdout + events.stderr)
    written = [folder / "pods.json", folder / "events.txt"]
    for pod in pods["items"]:
        name = pod["metadata"]["name"]
        status_of = pod["status"]
        statuses = [*(status_of.get("initContainerStatuses") or []), *(status_of.get("containerStatuses") or [])]
        for status in statuses:
            runs: list[tuple[str, list[str]]] = [("", [])]
            if status.get("restartCount"):
                runs.append((".previous", ["--previous"]))
            for suffix, extra in runs:
                result = cluster.kubectl("logs", "-n", namespace, name, "-c", status["name"], "--timestamps",
                                         *extra, check=False)
                path = folder / f"{name}.{status['name']}{suffix}.log"
                path.write_text(result.stdout + (f"\n[kubectl logs failed: {result.stderr.strip()}]\n"
                                                 if result.returncode else ""))
                written.append(path)
    return written


class AdminApi:
    """The API server with the admin kubeconfig's credentials, for callers that time things or
    call it in a loop (kubectl's start would blur the figures or slow the loop): the project's
    request client, driven synchronously, safe to call from any thread. ``close`` when done."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = BlockingKubeClient(load_kube_config(str(kubeconfig)), user_agent="singleton-testbed")

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 10) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer): an HTTP error is an answer too (its ``Status``), 200 stands for
        any success; no answer at all (refused, timed out) raises ``KubeUnavailable``."""
        try:
            return 200, self.client.request(method, path, body=body, timeout=timeout)
        except KubeError as exc:
            if exc.status == 0:
                raise
            return exc.status, {"kind": "Status", "code": exc.status, "reason": exc.reason, "message": exc.message}
