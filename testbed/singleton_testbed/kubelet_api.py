"""The stand-in kubelet's API calls: its Node and node Lease, its pods' status and final
deletion, and the objects pod specs refer to (Secrets, ConfigMaps, tokens).

Called by ``kubelet`` and ``kubelet_pods``; the only module of the stand-in that talks to the
API server, through the project's small aiohttp client (``singleton_sidecar.kube``).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from singleton_sidecar.kube import KubeClient, KubeConflict, KubeNotFound
from singleton_testbed.kubelet_spec import ConfigError, decode_data

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
KUBELET_VERSION = "v1.34.0-standin"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
USER_AGENT = "singleton-standin-kubelet"

Obj = dict[str, Any]


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def now_micro() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


@dataclass(frozen=True)
class NodeSpec:
    """How the stand-in presents itself as a Node."""

    name: str
    host_ip: str
    """InternalIP of the node, and every pod's ``hostIP``."""
    capacity: Mapping[str, str] = field(default_factory=lambda: {"cpu": "16", "memory": "32Gi", "pods": "110"})
    """Advertised capacity (= allocatable); nothing is enforced."""
    labels: Mapping[str, str] = field(default_factory=dict)


class StandInClient(KubeClient):
    """The project's client, with a User-Agent of its own: benchmarks count the sidecars'
    requests in the audit log by theirs (``singleton-sidecar``)."""

    def _headers(self, content_type: str | None) -> dict[str, str]:
        return {**super()._headers(content_type), "User-Agent": USER_AGENT}


class KubeletApi:
    """API calls of one stand-in node."""

    def __init__(self, client: KubeClient, node: NodeSpec) -> None:
        self.client = client
        self.node = node
        self._node_uid = ""

    # --- the Node and its Lease ---------------------------------------------------------------

    async def register_node(self) -> None:
        """Create the Node (or adopt an existing one), report it Ready, lift the not-ready taint."""
        labels = {"kubernetes.io/hostname": self.node.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", "singleton.dev/stand-in": "true", **self.node.labels}
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node.name, "labels": labels}}
        try:
            created = await self.client.request("POST", "/api/v1/nodes", body=body, timeout=CALL_TIMEOUT)
            self._node_uid = created["metadata"]["uid"]
        except KubeConflict:
            existing = await self.client.request("GET", self._node_path, timeout=CALL_TIMEOUT)
            self._node_uid = existing["metadata"]["uid"]
        await self.report_node_status()
        await self._lift_not_ready_taints()
        await self.renew_lease()
        log.info("node registered node=%s hostIP=%s", self.node.name, self.node.host_ip)

    @property
    def _node_path(self) -> str:
        return f"/api/v1/nodes/{self.node.name}"

    def _node_status(self) -> Obj:
        now = now_rfc3339()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "stand-in kubelet is posting ready status", "lastHeartbeatTime": now}
        pressure = [{"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}", "lastHeartbeatTime": now}
                    for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        uname = platform.uname()
        return {
            "capacity": dict(self.node.capacity), "allocatable": dict(self.node.capacity),
            "conditions": [ready, *pressure],
            "addresses": [{"type": "InternalIP", "address": self.node.host_ip},
                          {"type": "Hostname", "address": self.node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": self.node.name, "systemUUID": self.node.name, "bootID": str(os.getpid()),
                "kernelVersion": uname.release, "osImage": "singleton test bed", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "standin://0.1",
                "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "",
            },
        }

    async def report_node_status(self) -> None:
        """Ready and capacity; also the heartbeat (``lastHeartbeatTime``) of the Ready condition."""
        await self.client.request("PATCH", self._node_path + "/status", body={"status": self._node_status()},
                                  content_type="application/strategic-merge-patch+json", timeout=CALL_TIMEOUT)

    async def _lift_not_ready_taints(self) -> None:
        """TaintNodesByCondition taints every new Node not-ready; a kubelet's readiness lifts it."""
        for _ in range(5):
            node = await self.client.request("GET", self._node_path, timeout=CALL_TIMEOUT)
            taints = node["spec"].get("taints") or []
            kept = [t for t in taints if t.get("key") not in NOT_READY_TAINTS]
            if len(kept) == len(taints):
                return
            patch = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": kept}}
            try:
                await self.client.request("PATCH", self._node_path, body=patch,
                                          content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
                return
            except KubeConflict:
                continue

    async def renew_lease(self) -> None:
        """Renew (or create) the node's Lease in ``kube-node-lease``, the kubelet's heartbeat."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node.name}"
        spec = {"holderIdentity": self.node.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()}
        try:
            lease = await self.client.request("GET", path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node.name, "uid": self._node_uid}
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.node.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                    "spec": spec}
            await self.client.request("POST", path.rsplit("/", 1)[0], body=body, timeout=CALL_TIMEOUT)
            return
        lease["spec"] = {**lease.get("spec", {}), **spec}
        await self.client.request("PUT", path, body=lease, timeout=CALL_TIMEOUT)

    async def node_exists(self) -> bool:
        try:
            node = await self.client.request("GET", self._node_path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return False
        return bool(node["metadata"]["uid"] == self._node_uid)

    async def delete_node(self) -> None:
        for path in (self._node_path,
                     f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node.name}"):
            try:
                await self.client.request("DELETE", path, timeout=CALL_TIMEOUT)
            except KubeNotFound:
                continue
        log.info("node deleted node=%s", self.node.name)

    # --- pods -----------------------------------------------------------------------------

    @property
    def _pod_selector(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node.name}"}

    async def list_pods(self) -> tuple[list[Obj], str]:
        result = await self.client.request("GET", "/api/v1/pods", params=self._pod_selector, timeout=CALL_TIMEOUT)
        return list(result.get("items") or []), str(result["metadata"]["resourceVersion"])

    def watch_pods(self, resource_version: str, timeout: float) -> AsyncGenerator[tuple[str, Obj], None]:
        params = {**self._pod_selector, "resourceVersion": resource_version, "allowWatchBookmarks": "true"}
        return self.client.watch("/api/v1/pods", params=params, timeout=timeout)

    @staticmethod
    def _pod_path(pod: Obj) -> str:
        return f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"

    async def patch_pod_status(self, pod: Obj, status: Obj) -> None:
        """Strategic merge: conditions merge by type, so others' conditions (readiness gates) stay.
        The uid in the patch is a precondition: a new pod of the same name is never touched."""
        body = {"metadata": {"uid": pod["metadata"]["uid"]}, "status": status}
        await self.client.request("PATCH", self._pod_path(pod) + "/status", body=body,
                                  content_type="application/strategic-merge-patch+json", timeout=CALL_TIMEOUT)

    async def delete_pod(self, pod: Obj) -> None:
        """Remove the pod for good (grace 0), only if it is still this very pod (uid)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": pod["metadata"]["uid"]}}
        try:
            await self.client.request("DELETE", self._pod_path(pod), body=body, timeout=CALL_TIMEOUT)
        except (KubeNotFound, KubeConflict):
            return

    # --- what pod specs refer to (kubelet_spec.ObjectReader) -----------------------------------

    async def _get(self, path: str) -> Obj | None:
        try:
            return await self.client.request("GET", path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return None

    async def secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = await self._get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        return None if obj is None else decode_data(obj)

    async def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = await self._get(f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        return None if obj is None else decode_data(obj)

    async def service_account(self, namespace: str, name: str) -> Obj | None:
        return await self._get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")

    async def token(self, pod: Obj, *, audience: str | None, expiration_seconds: int) -> str:
        """A token of the pod's service account bound to the pod (TokenRequest), as the kubelet gets."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        spec: Obj = {"expirationSeconds": expiration_seconds,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        try:
            result = await self.client.request("POST", path, body=body, timeout=CALL_TIMEOUT)
        except KubeNotFound as exc:
            raise ConfigError(f"service account {account!r} not found") from exc
        return str(result["status"]["token"])
