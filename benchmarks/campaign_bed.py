"""The campaign's test bed and groups: PostgreSQL (admitting the pod network), etcd +
kube-apiserver (with the SingletonService CRD) and controllers, and the real node (containerd,
runc, kubelet, kube-proxy: ``singleton_testbed.node``) with the project's image and the
test-apps image (``singleton_testbed.apps_image``: the project's image plus the tests' workers);
all the campaign's own (it restarts them), started from the main thread (servers die with the
thread that started them), or borrowed from a test session (``Bed(..., borrowed=...)``: its
control plane, node and images; the campaign still restarts that control plane, and starts its
own PostgreSQL). Per backend and segment, a group of 3 pods of one ``Variant``.

A group's pods, in a namespace of their own, bound to the node (``nodeName``), with the
downward-API environment, a ServiceAccount limited to ``contract.sidecar_rbac_rules(group)``
(its token projected by the kubelet) and short timings (lease 2 s, renew deadline 1.5 s, retry
0.5 s), run the ledger worker (``tests/data/ledger_worker.py`` in the test-apps image) gated one
of two ways:

- **exec gate**: one container of the test-apps image, ``singleton-sidecar run -- python
  ledger_worker.py`` (through its launcher, below; the keeper runs the worker in a process group
  of its own and gives it ``SINGLETON_DEADLINE_FILE``);
- **file gate**: the pod the operator builds for ``gating: {mode: file}``
  (``singleton_operator.model.resources.pod_template``): the sidecar of the project's image as a
  native sidecar, with the operator's probes, the worker (test-apps image) as the main container
  wrapped by ``gate.sh`` from a shared ``emptyDir``; the worker follows the gate's flag
  (``LEDGER_GATE_DIR``) for its deadline.

Every group also has a ``SingletonService`` object (``singletonctl`` finds groups through it;
for file-gated groups it is what their pods are built from; no operator runs, so nothing
reconciles it) and a Secret with the DSN. The worker writes fenced or not (the variant); each pod
draws how long its app takes to finish after SIGTERM (``LEDGER_FINISH_SECONDS``, 0..1 s), how
many children act beside it (``LEDGER_CHILDREN``, 0..2) and how it **detaches** one more worker
(``DETACH_IDIOMS``): the app's command is a launcher (``APP_COMMAND``) that starts a copy of the
worker outside the app's process group and session, as apps in the wild do (a forked child
calling ``setsid``; ``subprocess.Popen(..., start_new_session=True)``; a daemon's double fork,
whose middle process exits so that the worker is orphaned), then becomes the worker itself
(``exec``: the gate's child is the worker). The detached worker is the same app: it checks its
term's deadline before each act, logs its acts in the act log with its own pid (its items from
``DETACHED_CHILD * CHILD_ITEMS``), and finishes on SIGTERM as the app does; no signal sent to the
app's process group reaches it. Only the gate can stop it: the exec gate's keeper (a child
subreaper: the worker is reparented to it once its parent is gone, and the keeper exits only when
no such process is left), ``gate.sh`` as PID 1 of its container (every process outside its own
session). A gate that left it behind would show in the act log as an acting overlap: under the
exec gate the keeper's exit removes the deadline file, which the worker then no longer finds (and
acts on); under the file gate it acts until the flag is gone. One pod of each group (and each pod that
replaces it) is **slow**: its app takes 0.5..1 s to finish and its sidecar's drain timeout is
0.2 s, so a planned ending of its term hits the drain timeout. A killed container is restarted by
the kubelet (the test bed's node caps its back-off at 1 s); a deleted pod is replaced by a new
one (with the same role, slow or not), as a ReplicaSet would. Before a group is torn down its
pods' logs (previous containers' included) are saved under ``<workdir>/pods/<namespace>/``; a
deleted pod's are saved as it is deleted (``<pod>.before-deletion.log``) and followed until its
containers end (``<pod>.after-deletion.log``: its drain).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import os
import random
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import asyncpg

from benchmarks.campaign_pods import Frozen, freeze_pod, loopback_request, thaw_pod
from benchmarks.campaign_poll import PORT, Poller, Sample
from singleton_election import contract
from singleton_election.core.elector import DRAIN_TIMEOUT_PASSED
from singleton_election.kube import KubeUnavailable
from singleton_operator.model import resources
from singleton_operator.model.spec import read_spec
from singleton_testbed import images, node_pods
from singleton_testbed.apps_image import APPS_ROOT, build_test_apps_image
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane, wait_established
from singleton_testbed.harness.kubehelpers import AdminApi, save_pod_logs
from singleton_testbed.node import Node
from singleton_testbed.node_config import SECOND_NODE, NodeLayout
from singleton_testbed.postgres import PostgresServer

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "singleton.dev_singletonservices.yaml"
WORKER = f"{APPS_ROOT}/data/ledger_worker.py"
"""The ledger worker inside the test-apps image."""
CONTAINER = "sidecar"
"""The exec-gated pod's one container (sidecar, keeper and worker)."""
APP_CONTAINER = "worker"
"""The file-gated pod's main container (``gate.sh`` and the worker); its sidecar is
``resources.SIDECAR_CONTAINER``."""
LEASE, RENEW, RETRY = 2.0, 1.5, 0.5
TIMINGS = {contract.ENV_LEASE_DURATION: "2", contract.ENV_RENEW_DEADLINE: "1.5", contract.ENV_RETRY_PERIOD: "0.5"}
CONTROL_PORT = PORT + 1
DRAIN_TIMEOUT = 5.0
SLOW_DRAIN_TIMEOUT = 0.2
"""The slow pod's drain timeout: shorter than its app's finishing time (``SLOW_FINISH``)."""
FINISH_MAX = 1.0
SLOW_FINISH = (0.5, 1.0)
CHILDREN_MAX = 2
DETACH_IDIOMS = ("setsid", "popen", "daemon")
"""How a pod's app detaches its extra worker (``APP_COMMAND``), drawn per pod."""
CHILD_ITEMS = 1_000_000_000
"""As in ``tests/data/ledger_worker.py``: child ``n`` numbers its items from ``n * CHILD_ITEMS``."""
DETACHED_CHILD = CHILDREN_MAX + 1
"""The detached worker's child number: its items are told apart from the app's and its children's."""
LAUNCHER = """\
import os, subprocess, sys
argv = [sys.executable, sys.argv[1]]
idiom = os.environ.pop("LEDGER_DETACH", "")
if idiom:
    env = {**os.environ, "LEDGER_CHILDREN": "0", "LEDGER_CHILD": os.environ["LEDGER_DETACHED_CHILD"]}
    if idiom == "popen":
        subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    elif idiom in ("setsid", "daemon"):
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                if idiom == "daemon" and os.fork() != 0:
                    os._exit(0)
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        if idiom == "daemon":
            os.waitpid(pid, 0)
    else:
        sys.exit(f"LEDGER_DETACH: unknown idiom {idiom!r}")
    print(f"launcher: detached a worker ({idiom})", file=sys.stderr, flush=True)
os.execv(sys.executable, argv)
"""
"""The app's launcher (``python -S -c LAUNCHER WORKER``): detaches a copy of the worker the way
``LEDGER_DETACH`` says (``DETACH_IDIOMS``; none when empty), then execs the worker itself."""
APP_COMMAND = ["python", "-S", "-c", LAUNCHER, WORKER]
GRACE = 8
REPLICAS = 3
DSN_SECRET = "ledger-db"
T = TypeVar("T")
THAW_STAGGER = 0.1
"""A frozen pod's app is thawed this long before its sidecar and gate (``campaign_pods``)."""


class CampaignError(Exception):
    """The bed or a group got into a state the campaign cannot go on from."""


def admin_call(api: AdminApi, method: str, path: str, body: dict[str, Any] | None = None, *,
               ok: tuple[int, ...] = (200, 201, 202), attempts: int = 20) -> dict[str, Any]:
    """An admin API call, retried while the API server is coming back."""
    for _ in range(attempts):
        try:
            status, answer = api.request(method, path, body)
        except KubeUnavailable:  # no answer: refused or timed out
            time.sleep(0.5)
            continue
        if status in ok:
            return answer
        if status < 500 and status != 429:
            raise CampaignError(f"{method} {path}: {status} {answer}")
        time.sleep(0.5)
    raise CampaignError(f"{method} {path}: the API server did not answer")


ROOT_CA_WAIT = 180.0
"""Seconds a new namespace may wait for its ``kube-root-ca.crt``. The kubelet cannot mount a
pod's service account token without it, and the controller-manager publishes it late after an
API server restart: its informers reconnect with back-off (58 s measured on 2026-11-27, when a
segment's pods then never started within the 60 s settle bound)."""


def create_account(call: Callable[..., dict[str, Any]], namespace: str, account: str, group: str) -> None:
    """A namespace, and in it a ServiceAccount bound to a Role with only the sidecar's rules
    for ``group`` (``contract.sidecar_rbac_rules``); ``call`` is ``Bed.call``. Returns once the
    namespace's root CA is published (pods can mount their token)."""
    call("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    wait_root_ca(call, namespace)
    call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": account}})
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    call("POST", f"{rbac}/roles", {"metadata": {"name": account}, "rules": contract.sidecar_rbac_rules(group)})
    call("POST", f"{rbac}/rolebindings", {
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})


def wait_root_ca(call: Callable[..., dict[str, Any]], namespace: str) -> None:
    deadline = time.monotonic() + ROOT_CA_WAIT
    while True:
        try:
            call("GET", f"/api/v1/namespaces/{namespace}/configmaps/kube-root-ca.crt")  # 404: CampaignError
            return
        except CampaignError as exc:
            if time.monotonic() > deadline:
                raise CampaignError(f"namespace {namespace}: no kube-root-ca.crt within {ROOT_CA_WAIT:g} s "
                                    f"(is kube-controller-manager running?): {exc}") from exc
            time.sleep(0.5)


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


def _started_at(state: dict[str, Any]) -> float | None:
    stamp = ((state.get("state") or {}).get("running") or {}).get("startedAt")
    return dt.datetime.fromisoformat(str(stamp)).timestamp() if stamp else None


def running_ips(api: AdminApi, namespace: str, container: str,
                started_after: Mapping[str, float] | None = None) -> dict[str, str]:
    """Pod name → IP of the namespace's pods whose ``container`` runs now (not being deleted);
    for a pod of ``started_after``, only once that container started after the moment given
    (a node that booted again: until its kubelet reports the new sandbox, the pod's status is
    the old one's, its IP gone)."""
    status, answer = api.request("GET", f"/api/v1/namespaces/{namespace}/pods", timeout=5)
    if status != 200:
        return {}
    found = {}
    for pod in answer.get("items") or []:
        name, pod_status = pod["metadata"]["name"], pod.get("status") or {}
        states = [*(pod_status.get("initContainerStatuses") or []), *(pod_status.get("containerStatuses") or [])]
        running = [s for s in states if s.get("name") == container and "running" in (s.get("state") or {})]
        if not running or not pod_status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
            continue
        after = (started_after or {}).get(name)
        started = _started_at(running[0])
        if after is not None and (started is None or started < int(after)):  # startedAt has whole seconds
            continue
        found[name] = str(pod_status["podIP"])
    return found


def watch_running(api: AdminApi, poller: Poller, namespace: str, container: str, pods: dict[str, str], *,
                  started_after: dict[str, float] | None = None) -> None:
    """Fill in the IP of every pod of ``pods`` (name → IP, empty until known) whose
    ``container`` runs now (for a pod of ``started_after``, started after the moment given,
    which is then forgotten), and give it to the poller."""
    if all(pods.values()):
        return
    try:
        ips = running_ips(api, namespace, container, started_after)
    except KubeUnavailable:
        return  # the API server is being restarted: next time
    for pod, ip in ips.items():
        if pod in pods and not pods[pod]:
            pods[pod] = ip
            poller.watch(pod, ip)
            if started_after is not None:
                started_after.pop(pod, None)


@dataclasses.dataclass(frozen=True)
class Borrowed:
    """A test session's control plane and real node, with both images already imported."""

    control_plane: ControlPlane
    node: Node
    project_image: str
    apps_image: str
    tolerations: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """What the pods need to run on that node (its taints)."""


class Bed:
    def __init__(self, workdir: Path, borrowed: Borrowed | None = None, *, two_nodes: bool = False) -> None:
        """``two_nodes``: also a second real node (``SECOND_NODE``), for whole-node faults; the
        groups' pods are spread over both. Not with a borrowed bed."""
        if two_nodes and borrowed is not None:
            raise ValueError("a borrowed bed has one node")
        self.workdir = workdir
        self.borrowed = borrowed
        self.pg = PostgresServer(serve_pods=True)  # its own folder: the server runs as user postgres
        self.layout = borrowed.node.layout if borrowed else NodeLayout()
        if borrowed is None:
            binaries = find_all()
            add_to_path(binaries)
            self.cp = ControlPlane(binaries, workdir / "k8s", advertise_address=self.layout.node_ip)
            self.node = Node(self.cp, binaries, layout=self.layout)
            self.second = Node(self.cp, binaries, layout=SECOND_NODE) if two_nodes else None
            self.project_image = self.apps_image = ""
            self.tolerations: list[dict[str, str]] = []
        else:
            self.cp, self.node = borrowed.control_plane, borrowed.node
            self.second = None
            self.project_image, self.apps_image = borrowed.project_image, borrowed.apps_image
            self.tolerations = borrowed.tolerations
        self.api: AdminApi | None = None
        self.kubeconfig: Path | None = None
        self.api_service_ip = ""
        """The ``kubernetes`` Service's ClusterIP: where the pods' sidecars dial the API server."""

    def __repr__(self) -> str:
        return f"<Bed {self.workdir}>"

    def start(self) -> None:
        (self.workdir / "k8s").mkdir(parents=True, exist_ok=True)
        self.pg.start()
        if self.borrowed is None:
            info = self.cp.start()
            self.cp.start_controllers()  # service-account tokens' root CA in each namespace
            self.node.start()
            project_archive, self.project_image = images.build_project_image()
            apps_archive, self.apps_image = build_test_apps_image()
            if self.second is not None:
                self.second.start()
                self.cp.start_node_lifecycle()
            for node in self.nodes:
                node.import_image(project_archive)
                node.import_image(apps_archive)
            self.kubeconfig = info.kubeconfig
        else:
            assert self.cp.info is not None, "a borrowed control plane runs"
            self.kubeconfig = self.cp.info.kubeconfig
        self.api = AdminApi(self.kubeconfig)
        self.cp.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=singleton-campaign",
                        "-f", str(CRD))
        wait_established(self.cp.kubectl, "crd/singletonservices.singleton.dev")
        self.api_service_ip = str(self.call("GET", "/api/v1/namespaces/default/services/kubernetes")
                                  ["spec"]["clusterIP"])

    def stop(self) -> None:
        try:
            if self.api is not None:
                self.api.close()
        finally:
            if self.borrowed is None:
                if self.second is not None:
                    self.second.stop()
                self.node.stop()
                self.cp.stop()
            self.pg.cleanup()

    @property
    def nodes(self) -> list[Node]:
        return [self.node] if self.second is None else [self.node, self.second]

    @property
    def admin(self) -> AdminApi:
        assert self.api is not None
        return self.api

    @property
    def pod_dsn(self) -> str:
        """The DSN pods use: PostgreSQL at the node IP."""
        return dataclasses.replace(self.pg.info, host=self.layout.node_ip).dsn

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


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a group's pods run: the gate (``exec`` or ``file``) and whether the worker fences its
    writes (unfenced: an app whose acts no store can refuse; the act log is then the only judge)."""

    gate: str
    fence: bool

    def __str__(self) -> str:
        return f"{self.gate} gate, {'fenced' if self.fence else 'unfenced'}"


VARIANTS = (Variant("exec", True), Variant("file", False), Variant("file", True), Variant("exec", False))
"""In the order segments take them (``campaign.variant_for``)."""


@dataclasses.dataclass(frozen=True)
class PodProfile:
    """One pod's app and drain: seconds its app acts on after SIGTERM, children acting beside it,
    its sidecar's drain timeout."""

    finish: float
    children: int
    drain_timeout: float
    detach: str = ""
    """How its app detaches a worker (``DETACH_IDIOMS``); "" for none."""

    @property
    def slow(self) -> bool:
        """A planned ending of its term hits the drain timeout."""
        return self.drain_timeout < self.finish

    def __str__(self) -> str:
        detached = f", detaches a worker ({self.detach})" if self.detach else ""
        return (f"finish {self.finish:g}s, {self.children} children{detached}, drain timeout "
                f"{self.drain_timeout:g}s" + (" (slow)" if self.slow else ""))


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _with_env(env: list[dict[str, Any]], values: dict[str, str]) -> list[dict[str, Any]]:
    """``env`` with ``values`` set (replacing entries of the same name)."""
    return [*(e for e in env if e.get("name") not in values), *(_env(k, v) for k, v in values.items())]


@dataclasses.dataclass
class Group:
    """One segment's group of sidecar pods, of one variant."""

    bed: Bed
    backend: str
    poller: Poller
    variant: Variant = VARIANTS[0]
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    """Draws each pod's profile."""
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    name: str = ""
    namespace: str = ""
    pods: dict[str, str] = dataclasses.field(default_factory=dict)
    """Current members: pod name → IP (empty while it is starting)."""
    profiles: dict[str, PodProfile] = dataclasses.field(default_factory=dict)
    """Every pod the group ever had → its profile (deleted pods stay: faults refer to them)."""
    created: int = 0
    service: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The SingletonService object as the API server returned it."""
    uids: dict[str, str] = dataclasses.field(default_factory=dict)
    """Every pod the group ever had → its UID (names its log folder on the node)."""
    followers: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    """``kubectl logs -f`` of each deleted pod, until its containers end."""
    held_logs: dict[str, list[BinaryIO]] = dataclasses.field(default_factory=dict)
    """Each deleted pod's sidecar log files, opened before its deletion (``hold_logs``)."""
    node_of: dict[str, Node] = dataclasses.field(default_factory=dict)
    """Every pod the group ever had → the node it was bound to."""
    booted: dict[str, float] = dataclasses.field(default_factory=dict)
    """Members whose node booted again → when: their address is known once they run again."""

    def __post_init__(self) -> None:
        self.name = self.name or f"camp-{self.backend}-{secrets.token_hex(3)}"
        self.namespace = self.namespace or self.name
        self.account = "singleton-sidecar"

    @property
    def fence(self) -> bool:
        return self.variant.fence

    @property
    def sidecar_container(self) -> str:
        return CONTAINER if self.variant.gate == "exec" else resources.SIDECAR_CONTAINER

    def slow(self, pod: str) -> bool:
        profile = self.profiles.get(pod)
        return profile is not None and profile.slow

    def setup(self) -> None:
        create_account(self.bed.call, self.namespace, self.account, self.name)
        dsn = base64.b64encode(self.bed.pod_dsn.encode()).decode()
        self.bed.call("POST", f"/api/v1/namespaces/{self.namespace}/secrets",
                      {"metadata": {"name": DSN_SECRET}, "data": {"dsn": dsn}})
        self.service = self.bed.call(
            "POST", f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/namespaces/{self.namespace}/{contract.PLURAL}",
            self.service_body())
        for index in range(REPLICAS):
            self.add_pod(slow=index == 0)

    def service_body(self) -> dict[str, Any]:
        """The group as a SingletonService: what ``singletonctl`` reads, and for the file gate what
        the pods are built from (the operator's ``pod_template``)."""
        spec: dict[str, Any] = {
            "replicas": REPLICAS, "backend": self.backend,
            "timings": {"leaseDuration": "2s", "renewDeadline": "1500ms", "retryPeriod": "500ms"},
            "drain": {"timeout": f"{DRAIN_TIMEOUT:g}s"}, "terminationGracePeriodSeconds": GRACE,
            "gating": {"mode": "file" if self.variant.gate == "file" else "cooperative"},
            "sidecar": {"port": PORT, "image": self.bed.project_image},
            "template": {"spec": {"containers": [{"name": APP_CONTAINER, "image": self.bed.apps_image,
                                                  "imagePullPolicy": "Never", "command": APP_COMMAND}]}},
        }
        if self.backend != "lease":
            spec["postgres"] = {"secretRef": {"name": DSN_SECRET, "key": "dsn"}}
        return {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}

    def draw_profile(self, slow: bool) -> PodProfile:
        children = self.rng.randint(0, CHILDREN_MAX)
        detach = self.rng.choice(DETACH_IDIOMS)
        if slow:
            return PodProfile(round(self.rng.uniform(*SLOW_FINISH), 2), children, SLOW_DRAIN_TIMEOUT, detach)
        return PodProfile(round(self.rng.uniform(0.0, FINISH_MAX), 2), children, DRAIN_TIMEOUT, detach)

    def app_env(self, profile: PodProfile) -> dict[str, str]:
        """The worker's environment (beside what its gate gives it)."""
        env = {"LEDGER_DSN": self.bed.pod_dsn, "PYTHONUNBUFFERED": "1",
               "LEDGER_FINISH_SECONDS": f"{profile.finish:g}", "LEDGER_CHILDREN": str(profile.children),
               "LEDGER_DETACH": profile.detach, "LEDGER_DETACHED_CHILD": str(DETACHED_CHILD)}
        if not self.fence:
            env["LEDGER_FENCE"] = "off"
        return {**env, **self.worker_env}

    def manifest(self, pod: str, profile: PodProfile) -> dict[str, Any]:
        body = self._exec_manifest(pod, profile) if self.variant.gate == "exec" else self._file_manifest(pod, profile)
        body["spec"]["nodeName"] = self.node_of[pod].layout.name
        return body

    def _exec_manifest(self, pod: str, profile: PodProfile) -> dict[str, Any]:
        env = [
            *sidecar_pod_env(self.name, self.backend, TIMINGS),
            _env(contract.ENV_DRAIN_TIMEOUT, f"{profile.drain_timeout:g}"),
            *(_env(k, v) for k, v in self.app_env(profile).items()),
        ]
        if self.backend != "lease":
            env.append(_env(contract.ENV_POSTGRES_DSN, self.bed.pod_dsn))
        command = ["singleton-sidecar", "run", "--", *APP_COMMAND]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "labels": {"app": self.name, contract.LABEL_GROUP: self.name}},
                "spec": {**self._placement(), "serviceAccountName": self.account,
                         "terminationGracePeriodSeconds": GRACE,
                         "containers": [{"name": CONTAINER, "image": self.bed.apps_image, "imagePullPolicy": "Never",
                                         "command": command, "env": env,
                                         "ports": [{"name": "probes", "containerPort": PORT}]}]}}

    def _placement(self) -> dict[str, Any]:
        """Bound to a node of the bed (``manifest``: no scheduler needed), tolerating its taints."""
        placement: dict[str, Any] = {}
        if self.bed.tolerations:
            placement["tolerations"] = self.bed.tolerations
        return placement

    def _file_manifest(self, pod: str, profile: PodProfile) -> dict[str, Any]:
        """The operator's pod for ``gating: {mode: file}``, with this pod's profile."""
        template = resources.pod_template(read_spec(self.service, default_sidecar_image=self.bed.project_image))
        spec = template["spec"]
        sidecar = next(c for c in spec["initContainers"] if c["name"] == resources.SIDECAR_CONTAINER)
        sidecar["env"] = _with_env(sidecar["env"], {contract.ENV_DRAIN_TIMEOUT: f"{profile.drain_timeout:g}",
                                                    contract.ENV_LOG_FORMAT: "text"})
        main = next(c for c in spec["containers"] if c["name"] == APP_CONTAINER)
        main["env"] = [
            *_with_env(main.get("env") or [], {
                **self.app_env(profile), "LEDGER_GATE_DIR": resources.GATE_DIR,
                "SINGLETON_FENCE_KEY": contract.lock_key(self.name, self.namespace)}),
            # gate.sh exports only the token: the worker's identity is its pod's name.
            {"name": "SINGLETON_IDENTITY", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ]
        spec.update(self._placement())
        spec["serviceAccountName"] = self.account
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "labels": {**template["metadata"]["labels"], "app": self.name}},
                "spec": spec}

    def add_pod(self, *, slow: bool = False) -> str:
        pod = f"{self.name}-{self.created}"
        self.created += 1
        # Spread as a ReplicaSet with a topology spread would: on the node with the fewest members.
        members = [self.node_of[member] for member in self.pods]
        self.node_of[pod] = min(self.bed.nodes, key=members.count)
        profile = self.draw_profile(slow)
        created = self.bed.call("POST", f"/api/v1/namespaces/{self.namespace}/pods", self.manifest(pod, profile))
        self.uids[pod] = str(created["metadata"]["uid"])
        self.profiles[pod] = profile
        self.pods[pod] = ""
        return pod

    def delete_pod(self, pod: str) -> None:
        """Graceful deletion (the pod's grace period), and a replacement pod (slow if it was), as a
        ReplicaSet would. The pod's logs so far are saved first: the pods still there at the
        segment's end are saved then, a deleted one's would be gone."""
        folder = self.bed.workdir / "pods" / self.namespace
        folder.mkdir(parents=True, exist_ok=True)
        logs = self.bed.cp.kubectl("logs", "-n", self.namespace, pod, "--all-containers", "--prefix", "--timestamps",
                                   check=False)
        (folder / f"{pod}.before-deletion.log").write_text(logs.stdout + logs.stderr)
        self.follow_logs(pod, folder / f"{pod}.after-deletion.log")
        self.hold_logs(pod)
        self.bed.call("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod}", {})
        self.pods.pop(pod, None)
        self.poller.forget(pod)
        self.add_pod(slow=self.slow(pod))

    def follow_logs(self, pod: str, path: Path) -> None:
        """What the pod's containers log from now until they end (its drain, after the deletion:
        the pod and its logs are gone once it ends)."""
        since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        argv = [str(self.bed.cp.binaries["kubectl"]), "logs", "-f", "-n", self.namespace, pod, "--all-containers",
                "--prefix", "--timestamps", f"--since-time={since}"]
        with path.open("wb") as out:
            self.followers.append(subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "KUBECONFIG": str(self.bed.cp.info.kubeconfig)}))

    def stop_following(self) -> None:
        for follower in self.followers:
            try:
                follower.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait()
        self.followers.clear()
        for files in self.held_logs.values():
            for file in files:
                file.close()
        self.held_logs.clear()

    def hold_logs(self, pod: str) -> None:
        """Open the pod's sidecar log files before it is deleted: an open file stays readable
        after the kubelet removes it, and the container goes on writing to it until it ends."""
        files: list[BinaryIO] = []
        for path in self.sidecar_log_files(pod):
            with contextlib.suppress(OSError):  # rotated away meanwhile
                files.append(path.open("rb"))
        self.held_logs[pod] = files

    # --- what the faults do to a pod's processes (``campaign_pods``, ``node_pods``) ------------

    def pod_object(self, pod: str) -> dict[str, Any]:
        """The pod as the API server has it now (container IDs change with restarts)."""
        return self.bed.call("GET", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")

    def on_pod(self, pod: str, action: Callable[[dict[str, Any]], T], what: str, timeout: float = 15.0) -> T:
        """``action`` on the pod object, read again and retried for ``timeout`` seconds while the
        node has no such container: the group settles by its sidecars' answers, and the API's
        container IDs can lag what runs. After a kubelet restart and an API server outage the
        kubelet posts a pod's status only at its status manager's next sync (every 10 s): a
        leader whose worker was writing still showed that container "not started" 3 s later (CI)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return action(self.pod_object(pod))
            except (LookupError, OSError) as exc:  # node_pods.NotOnThisNode is a LookupError
                if time.monotonic() > deadline:
                    raise CampaignError(f"pod {pod}: cannot {what}: {exc}") from exc
                time.sleep(0.1)

    def containers(self) -> list[str]:
        """The pod's containers, sidecar first."""
        return [CONTAINER] if self.variant.gate == "exec" else [resources.SIDECAR_CONTAINER, APP_CONTAINER]

    def layout(self, pod: str) -> NodeLayout:
        return self.node_of[pod].layout

    def on_second_node(self, pod: str) -> bool:
        return self.bed.second is not None and self.node_of.get(pod) is self.bed.second

    def forget_addresses(self, node: Node, booted: float) -> None:
        """The members on ``node`` get new addresses (their sandboxes made again after the node
        booted at ``booted``): found again once they run again."""
        for pod in self.pods:
            if self.node_of[pod] is node:
                self.pods[pod] = ""
                self.booted[pod] = booted
                self.poller.forget(pod)

    def sidecar_pid(self, pod: str) -> int:
        """The host PID of the sidecar process (its container's main process)."""
        return self.on_pod(pod, lambda found: node_pods.container_main_pid(found, self.sidecar_container,
                                                                           layout=self.layout(pod)), "find its sidecar")

    def kill_sidecar(self, pod: str) -> None:
        """SIGKILL of every process of the sidecar's container; the kubelet restarts it."""
        self.on_pod(pod, lambda found: node_pods.signal_container(found, self.sidecar_container, signal.SIGKILL,
                                                                  layout=self.layout(pod)), "kill its sidecar")

    def freeze(self, pod: str) -> Frozen:
        """Freeze the whole pod (its freezer cgroup); ``thaw`` undoes it."""
        return self.on_pod(pod, lambda found: freeze_pod(found, self.containers(), self.layout(pod)), "freeze it")

    def thaw(self, frozen: Frozen) -> None:
        """Thaw the pod: its app first, its sidecar and gate ``THAW_STAGGER`` later."""
        thaw_pod(frozen, THAW_STAGGER, self.layout(frozen.pod["metadata"]["name"]))

    def partition(self, pod: str, targets: list[tuple[str, int | None]]) -> dict[str, Any]:
        """Cut the pod off from each (address, port) inside its network namespace; returns the
        pod object, for ``heal``."""
        found = self.pod_object(pod)
        try:
            for address, port in targets:
                node_pods.partition(found, address, port=port, layout=self.layout(pod))
        except (LookupError, OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.heal(found, targets)  # no half-made cut left behind
            raise CampaignError(f"pod {pod}: cannot cut it off: {exc}") from exc
        return found

    def heal(self, found: dict[str, Any], targets: list[tuple[str, int | None]]) -> None:
        for address, port in targets:
            # A pod gone meanwhile took its rules with its network namespace.
            with contextlib.suppress(LookupError, OSError, RuntimeError, subprocess.SubprocessError):
                node_pods.heal(found, address, port=port, layout=self.layout(found["metadata"]["name"]))

    def step_down(self, pod: str) -> tuple[int, str]:
        """``POST /step-down`` on the sidecar's control port, on the pod's loopback."""
        netns = self.on_pod(pod, lambda found: node_pods.pod_netns(found, layout=self.layout(pod)),
                            "find its network namespace")
        return loopback_request(netns, CONTROL_PORT, "POST", "/step-down?reason=campaign")

    def sidecar_log_files(self, pod: str) -> list[Path]:
        """The node's log files of the pod's sidecar container: the current one and the previous ones'."""
        folder = self.node_of[pod].paths.pod_logs / f"{self.namespace}_{pod}_{self.uids.get(pod, '')}" / \
            self.sidecar_container
        return sorted(folder.glob("*.log"))

    def drain_timeouts(self, pod: str) -> int:
        """How often the pod's sidecar logged that its drain timeout passed. A deleted pod's log
        files are read through the handles taken before its deletion (``delete_pod``): the
        kubelet removes them with the pod, often before the fault's end is judged."""
        count = 0
        held = self.held_logs.get(pod)
        for log in held if held is not None else self.sidecar_log_files(pod):
            try:
                if isinstance(log, Path):
                    text = log.read_text(errors="replace")
                else:
                    log.seek(0)
                    text = log.read().decode(errors="replace")
            except OSError:
                continue  # rotated away meanwhile
            count += text.count(DRAIN_TIMEOUT_PASSED)
        return count

    def watch_started(self) -> None:
        """Give the poller the IP of every member whose sidecar runs now."""
        watch_running(self.bed.admin, self.poller, self.namespace, self.sidecar_container, self.pods,
                      started_after=self.booted)

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
            time.sleep(0.1)  # each round may list the pods and opens a database connection
        latest = {pod: (s.status, s.token) for pod, s in self.poller.latest().items()}
        raise CampaignError(f"group {self.name} did not settle within {timeout:g}s: members {self.pods}, "
                            f"last answers {latest}")

    def teardown(self) -> None:
        """Save the pods' logs, delete the pods (gracefully: their terms drain), wait until they
        are gone, and delete the namespace."""
        for pod in list(self.pods):
            self.poller.forget(pod)
        self.pods.clear()
        self.stop_following()
        try:
            save_pod_logs(self.bed.cp, self.namespace, self.bed.workdir / "pods" / self.namespace)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            print(f"[campaign] could not save the logs of {self.namespace}: {exc}")
        try:
            self.bed.call("DELETE", f"/api/v1/namespaces/{self.namespace}/pods", {}, attempts=5)
        except CampaignError:
            return
        deadline = time.monotonic() + GRACE + DRAIN_TIMEOUT + 10
        while time.monotonic() < deadline:
            try:
                if not self.bed.call("GET", f"/api/v1/namespaces/{self.namespace}/pods", attempts=2).get("items"):
                    break
            except CampaignError:
                break
            time.sleep(0.2)
        with contextlib.suppress(CampaignError):  # else left for the control plane's end
            self.bed.call("DELETE", f"/api/v1/namespaces/{self.namespace}", {}, attempts=5)
