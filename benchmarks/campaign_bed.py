"""The campaign's test bed and groups: PostgreSQL, etcd + kube-apiserver and one stand-in
kubelet, all the campaign's own (it restarts them), started from the main thread (servers die
with the thread that started them); and, per backend, a group of sidecar pods.

Each pod is one container: ``singleton-sidecar run -- python tests/data/ledger_worker.py``
(the exec gate: the worker writes the fenced ledger only while its sidecar leads), in a network
namespace of its own, with the downward-API environment, a ServiceAccount limited to
``contract.sidecar_rbac_rules(group)`` (in-cluster token at the standard path), and short
timings (lease 2 s, renew deadline 1.5 s, retry 0.5 s). A killed container is restarted by the
stand-in; a deleted pod is replaced by a new one, as a ReplicaSet would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
from tests.kubelet_fixtures import Api

from benchmarks.campaign_poll import PORT, Poller, Sample
from singleton_sidecar import contract
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.kubelet_control import StandInKubelet
from singleton_testbed.netns import PodNetworkConfig
from singleton_testbed.postgres import PostgresServer

NET = PodNetworkConfig()
WORKER = Path(__file__).resolve().parent.parent / "tests" / "data" / "ledger_worker.py"
CONTAINER = "sidecar"
LEASE, RENEW, RETRY = 2.0, 1.5, 0.5
TIMINGS = {contract.ENV_LEASE_DURATION: "2", contract.ENV_RENEW_DEADLINE: "1.5", contract.ENV_RETRY_PERIOD: "0.5"}
DRAIN_TIMEOUT = 5
GRACE = 8
REPLICAS = 3


class CampaignError(Exception):
    """The bed or a group got into a state the campaign cannot go on from."""


def admin_call(api: Api, method: str, path: str, body: dict[str, Any] | None = None, *,
               ok: tuple[int, ...] = (200, 201, 202), attempts: int = 20) -> dict[str, Any]:
    """An admin API call, retried while the API server is coming back."""
    for _ in range(attempts):
        try:
            status, answer = api.request(method, path, body)
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
            continue
        if status in ok:
            return answer
        if status < 500 and status != 429:
            raise CampaignError(f"{method} {path}: {status} {answer}")
        time.sleep(0.5)
    raise CampaignError(f"{method} {path}: the API server did not answer")


def create_account(call: Callable[..., dict[str, Any]], namespace: str, account: str, group: str) -> None:
    """A namespace, and in it a ServiceAccount bound to a Role with only the sidecar's rules
    for ``group`` (``contract.sidecar_rbac_rules``); ``call`` is ``Bed.call``."""
    call("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": account}})
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    call("POST", f"{rbac}/roles", {"metadata": {"name": account}, "rules": contract.sidecar_rbac_rules(group)})
    call("POST", f"{rbac}/rolebindings", {
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})


def sidecar_pod_env(group: str, backend: str, timings: dict[str, str]) -> list[dict[str, Any]]:
    """A bench pod's sidecar environment: its group and backend, the downward API, probes on
    all addresses, text logs and ``timings`` (``contract.ENV_*`` → seconds)."""
    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [{"name": contract.ENV_GROUP, "value": group}, {"name": contract.ENV_BACKEND, "value": backend},
            field(contract.ENV_NAMESPACE, "metadata.namespace"), field(contract.ENV_POD_NAME, "metadata.name"),
            field(contract.ENV_POD_UID, "metadata.uid"), {"name": contract.ENV_LISTEN, "value": f"0.0.0.0:{PORT}"},
            {"name": contract.ENV_LOG_FORMAT, "value": "text"},
            *({"name": k, "value": v} for k, v in timings.items())]


def watch_running(standin: StandInKubelet, poller: Poller, namespace: str, pods: dict[str, str]) -> None:
    """Fill in the IP of every pod of ``pods`` (name → IP, empty until known) that runs now,
    and give it to the poller."""
    for pod, ip in list(pods.items()):
        if ip:
            continue
        try:
            info = standin.pod(namespace, pod)
        except (KeyError, LookupError):
            continue
        if info.ip and info.running:
            pods[pod] = info.ip
            poller.watch(pod, info.ip)


class Bed:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.suffix = secrets.token_hex(3)
        self.pg = PostgresServer(serve_pods=True)  # its own folder: the server runs as user postgres
        binaries = find_all()
        add_to_path(binaries)
        self.cp = ControlPlane(binaries, workdir / "k8s", serve_pods=True)
        self.kubelet: StandInKubelet | None = None
        self.api: Api | None = None

    def __repr__(self) -> str:
        return f"<Bed {self.workdir}>"

    def start(self) -> None:
        (self.workdir / "k8s").mkdir(parents=True, exist_ok=True)
        self.pg.start()
        info = self.cp.start()
        self.api = Api(info.kubeconfig)
        self.kubelet = StandInKubelet(kubeconfig=info.kubeconfig, node=f"campaign-{self.suffix}",
                                      state_dir=self.workdir / "standin")
        self.kubelet.start()

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        self.cp.stop()
        self.pg.cleanup()

    @property
    def standin(self) -> StandInKubelet:
        assert self.kubelet is not None
        return self.kubelet

    @property
    def admin(self) -> Api:
        assert self.api is not None
        return self.api

    @property
    def pod_dsn(self) -> str:
        return dataclasses.replace(self.pg.info, host=NET.postgres_ip).dsn

    def sql(self, query: str, *args: object) -> Any:
        """One value, as the superuser; None when the server does not answer."""
        async def fetch() -> Any:
            conn = await asyncpg.connect(self.pg.info.admin_dsn, timeout=2)
            try:
                return await conn.fetchval(query, *args, timeout=2)
            finally:
                await conn.close()

        try:
            return asyncio.run(fetch())
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             ok: tuple[int, ...] = (200, 201, 202), attempts: int = 20) -> dict[str, Any]:
        return admin_call(self.admin, method, path, body, ok=ok, attempts=attempts)


@dataclasses.dataclass
class Group:
    """One backend's group of sidecar pods."""

    bed: Bed
    backend: str
    poller: Poller
    fence: bool = True
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    name: str = ""
    namespace: str = ""
    pods: dict[str, str] = dataclasses.field(default_factory=dict)
    """Current members: pod name → IP (empty while it is starting)."""
    created: int = 0

    def __post_init__(self) -> None:
        self.name = self.name or f"camp-{self.backend}-{secrets.token_hex(3)}"
        self.namespace = self.namespace or self.name
        self.account = "singleton-sidecar"

    def setup(self) -> None:
        create_account(self.bed.call, self.namespace, self.account, self.name)
        for _ in range(REPLICAS):
            self.add_pod()

    def manifest(self, pod: str) -> dict[str, Any]:
        env = [
            *sidecar_pod_env(self.name, self.backend, TIMINGS),
            {"name": contract.ENV_DRAIN_TIMEOUT, "value": str(DRAIN_TIMEOUT)},
            {"name": "LEDGER_DSN", "value": self.bed.pod_dsn},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ]
        if self.backend != "lease":
            env.append({"name": contract.ENV_POSTGRES_DSN, "value": self.bed.pod_dsn})
        if not self.fence:
            env.append({"name": "LEDGER_FENCE", "value": "off"})
        env += [{"name": k, "value": v} for k, v in self.worker_env.items()]
        command = [sys.executable, "-m", "singleton_sidecar.cli", "run", "--", sys.executable, str(WORKER)]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "labels": {"app": self.name}},
                "spec": {"nodeName": self.bed.standin.node, "serviceAccountName": self.account,
                         "terminationGracePeriodSeconds": GRACE,
                         "containers": [{"name": CONTAINER, "image": "ghcr.io/singleton-dev/singleton:0.1.0",
                                         "command": command, "env": env,
                                         "ports": [{"name": "probes", "containerPort": PORT}]}]}}

    def add_pod(self) -> str:
        pod = f"{self.name}-{self.created}"
        self.created += 1
        self.bed.call("POST", f"/api/v1/namespaces/{self.namespace}/pods", self.manifest(pod))
        self.pods[pod] = ""
        return pod

    def delete_pod(self, pod: str) -> None:
        """Graceful deletion (the pod's grace period), and a replacement pod, as a ReplicaSet would."""
        self.bed.call("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod}", {})
        self.pods.pop(pod, None)
        self.poller.forget(pod)
        self.add_pod()

    def watch_started(self) -> None:
        """Give the poller the IP of every member that runs now."""
        watch_running(self.bed.standin, self.poller, self.namespace, self.pods)

    def wait_settled(self, timeout: float, since: float = 0.0) -> Sample:
        """Every member answers, one of them leads, and its worker has written the ledger."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch_started()
            leader = self.poller.settled(set(self.pods), since) if all(self.pods.values()) else None
            if leader is not None and leader.token is not None:
                written = self.bed.sql(  # the newest row (index scan): groups run one after the other
                    "SELECT token FROM ledger WHERE group_name = $1 ORDER BY id DESC LIMIT 1", self.name)
                if written is not None and written >= leader.token:
                    return leader
            time.sleep(0.05)
        latest = {pod: (s.status, s.token) for pod, s in self.poller.latest().items()}
        raise CampaignError(f"group {self.name} did not settle within {timeout:g}s: members {self.pods}, "
                            f"last answers {latest}")

    def teardown(self) -> None:
        for pod in list(self.pods):
            self.poller.forget(pod)
        self.pods.clear()
        try:
            self.bed.call("DELETE", f"/api/v1/namespaces/{self.namespace}/pods", {}, attempts=5)
        except CampaignError:
            return
        deadline = time.monotonic() + GRACE + DRAIN_TIMEOUT + 10
        while time.monotonic() < deadline:
            try:
                if not [p for p in self.bed.standin.pods() if p.namespace == self.namespace]:
                    break
            except (RuntimeError, OSError):
                break
            time.sleep(0.2)
