"""Helpers for the stand-in kubelet tests (``test_kubelet``): a small synchronous API client
(faster than kubectl where tests measure latency), manifests of pods running
``tests/data/kubelet/app.py``, and HTTP calls to pods from the host."""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from singleton_sidecar.kube import load_kube_config

APP = Path(__file__).parent / "data" / "kubelet" / "app.py"
T = TypeVar("T")
Obj = dict[str, Any]


class Api:
    """Just enough of the Kubernetes API, with the admin kubeconfig."""

    def __init__(self, kubeconfig: Path) -> None:
        config = load_kube_config(str(kubeconfig))
        self.server = config.server
        self.token = config.bearer_token() or ""
        self.ssl = ssl.create_default_context(cadata=(config.ca_data or b"").decode())

    def request(self, method: str, path: str, body: Obj | None = None,
                content_type: str = "application/json") -> tuple[int, Obj]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.ssl, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def get(self, path: str) -> Obj | None:
        status, body = self.request("GET", path)
        if status == 404:
            return None
        assert status == 200, (path, status, body)
        return body

    def create(self, path: str, body: Obj) -> Obj:
        status, created = self.request("POST", path, body)
        assert status == 201, (path, status, created)
        return created

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> None:
        body = {} if grace is None else {"gracePeriodSeconds": grace}
        status, answer = self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)
        # Both mean the request was accepted: 200 (deleted, or graceful deletion begun) or 202
        # (the API server's answer when the deletion completes asynchronously, e.g. with
        # orphanDependents=false). What becomes of the pod is what the callers check.
        assert status in (200, 202), answer


def wait_for(what: str, check: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def condition(pod: Obj | None, kind: str) -> str | None:
    for cond in ((pod or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return str(cond["status"])
    return None


def container_status(pod: Obj, name: str) -> Obj:
    status = pod.get("status") or {}
    for entry in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if entry["name"] == name:
            return dict(entry)
    raise KeyError(name)


def app_container(name: str = "app", *, env: dict[str, str] | None = None, port: int = 8080, **extra: Any) -> Obj:
    """A container running app.py with the venv's Python (images are ignored)."""
    variables = [{"name": "PORT", "value": str(port)}, *({"name": k, "value": v} for k, v in (env or {}).items())]
    return {"name": name, "image": "registry.invalid/app:1", "command": [sys.executable, str(APP)],
            "env": variables, "ports": [{"name": "http", "containerPort": port}], **extra}


def pod_manifest(name: str, node: str, containers: list[Obj], **spec: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"test": name}},
            "spec": {"nodeName": node, "containers": containers, **spec}}


def http(ip: str, path: str, *, method: str = "GET", port: int = 8080, timeout: float = 5.0) -> tuple[int, Obj]:
    """Call a pod's app.py from the host."""
    request = urllib.request.Request(f"http://{ip}:{port}{path}", method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def serving(ip: str, port: int = 8080) -> bool:
    try:
        return http(ip, "/healthz", port=port, timeout=1)[0] == 200
    except OSError:
        return False


def quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")
