"""The operator's own work with many SingletonServices (issue 15's "operator at scale").

    .venv/bin/python -m benchmarks.operator_scale --groups 500 [--runs 1] [--rest-seconds 60]
        [--rate 50 | --kubectl client-side|server-side] [--namespaces 50] [--as-admin] [--foreign 0 5000 20000]

Starts the test bed's etcd + kube-apiserver (no controllers, no node) and one real operator
process (``singleton-operator run --kubeconfig``) as the ServiceAccount and RBAC the chart makes
for it (``chart_account``), or with ``--as-admin`` as the test bed's admin. Each group gets
two pods made by this script before its SingletonService exists, as a ReplicaSet, a kubelet and
the sidecars would have left them: Ready, one saying ``leader`` (token 1), one ``standby``. So
the operator's work is all that is measured, and the pods "run" from the start. The groups are
in one namespace, or with ``--namespaces`` spread over that many, as teams each in their own
would put them (the operator's access reviews are shared per namespace only). Then:
- create -> status with a leader: all SingletonServices created at once (``--parallel`` requests
  in flight), or ``--rate`` a second as a GitOps tool's client-side rate limit sends them; per
  group, the create's answer -> the watch showing ``status.leader`` with the group's generation
  applied (``status.observedGeneration``); or with ``--kubectl`` by one ``kubectl apply -f`` of a
  file holding them all, as a user applies a folder (kubectl makes one object after another,
  each timed from kubectl's line saying it was made); the operator's requests in that burst; then
  ``--one-more`` groups created one at a time beside the others (what a user creating a group
  sees from an operator that carries hundreds);
- at rest (``--rest-seconds`` after every group has settled): the operator's API requests per
  second (the API server's audit log, by user agent: ours and kopf's), its CPU and RSS;
- noticing a leader change on one group while the others idle (``--changes`` times, each on
  another group): the pods' annotations patched as the sidecars would -> ``status.leader``
  naming the new pod.
Prints medians and p99 (nearest rank) and every figure as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from benchmarks.failover import cpu_seconds, rss_mb
from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, load_kube_config
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane, wait_established, write_kubeconfig
from singleton_testbed.ledger import percentile
from singleton_testbed.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "bench"
FOREIGN_NAMESPACE = "foreign"
T = TypeVar("T")
ALL_CRS_PATH = f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/{contract.PLURAL}"
OPERATOR_AGENTS = ("singleton-operator", "kopf")
KUBECTL_APPLY = {"client-side": ((), "created"), "server-side": (("--server-side",), "serverside-applied")}
"""``--kubectl``: kubectl apply's extra arguments, and the word it prints after each object it made."""
CALL_TIMEOUT = 60.0
KUBECTL_TIMEOUT = 600.0
"""Seconds ``--kubectl``'s apply may take in all (each of its requests: ``CALL_TIMEOUT``)."""


def crs_path(namespace: str) -> str:
    return f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/namespaces/{namespace}/{contract.PLURAL}"


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


CR_PATH = crs_path(NAMESPACE)


@dataclass
class RunResult:
    groups: int
    rate: float | None = None
    """Creates a second in the burst (None: all at once, ``--parallel`` in flight)."""
    kubectl: str | None = None
    """The burst was one ``kubectl apply -f`` of every group, this way (``KUBECTL_APPLY``)."""
    namespaces: int = 1
    """The groups were spread over this many namespaces."""
    foreign: int = 0
    """Pods, and as many Deployments, of no group in the API server before the operator started."""
    foreign_seconds: float = 0.0
    """How long making them took."""
    create_to_leader: list[float] = field(default_factory=list)
    """Per group: the create's answer -> ``status.leader`` seen (seconds)."""
    all_settled: float = 0.0
    """The first create -> the last group's leader in its status (seconds)."""
    burst_cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds used during that burst, by process (operator, kube-apiserver, etcd)."""
    burst_requests: dict[str, int] = field(default_factory=dict)
    """The operator's requests from the first create until every group settled, by kind."""
    create_one_more: list[float] = field(default_factory=list)
    """Once all groups settled, groups created one at a time: create -> ``status.leader``."""
    requests_per_second: float = 0.0
    requests_by_kind: dict[str, int] = field(default_factory=dict)
    cpu_percent: float = 0.0
    rss_mb: float = 0.0
    notice_change: list[float] = field(default_factory=list)
    """Per change: the annotations patched -> ``status.leader`` naming the new pod (seconds)."""


def group_name(index: int) -> str:
    return f"g{index:04d}"


def group_namespaces(names: list[str], namespaces: int) -> dict[str, str]:
    """Each group's namespace: ``NAMESPACE`` for one, else spread in turn over ``bench-000``..."""
    if namespaces == 1:
        return dict.fromkeys(names, NAMESPACE)
    return {name: f"{NAMESPACE}-{i % namespaces:03d}" for i, name in enumerate(names)}


def cr_body(name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    return {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 2, "backend": "lease", "template": {"spec": {"containers": [
                {"name": "app", "image": "example.invalid/app:1", "command": ["sleep", "infinity"]}]}}}}


def pod_annotations(name: str, role: str, token: int | None) -> dict[str, str | None]:
    return {contract.ANNOTATION_ROLE: role, contract.ANNOTATION_TOKEN: None if token is None else str(token),
            contract.ANNOTATION_IDENTITY: f"{name}/bench", contract.ANNOTATION_GROUP: name.rsplit("-", 1)[0]}


async def make_pod(client: KubeClient, group: str, suffix: str, role: str, token: int | None, *,
                   namespace: str = NAMESPACE) -> None:
    """A pod as the group's ReplicaSet, the kubelet and its sidecar would have left it."""
    name = f"{group}-{suffix}"
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {contract.LABEL_GROUP: group},
                         "annotations": {k: v for k, v in pod_annotations(name, role, token).items() if v}},
            "spec": {"initContainers": [{"name": "singleton-sidecar", "image": "example.invalid/sidecar:1",
                                         "restartPolicy": "Always"}],
                     "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}
    await client.request("POST", pods_path(namespace), body=body, timeout=CALL_TIMEOUT)
    ready = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    await client.request("PATCH", f"{pods_path(namespace)}/{name}/status", body=ready,
                         content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)


def foreign_pod(index: int) -> dict[str, Any]:
    """A pod of some other team's app, as big as a small real one (labels, env, resources),
    never scheduled: no scheduler and no node run here, only its object is in the API server."""
    name = f"web-{index:05d}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "web", "team": f"t{index % 40}", "pod-index": str(index)},
                         "annotations": {"example.com/owner": f"team-{index % 40}@example.com"}},
            "spec": {"containers": [{
                "name": "web", "image": "example.invalid/web:1", "ports": [{"containerPort": 8080}],
                "env": [{"name": f"SETTING_{i}", "value": f"value-{i}"} for i in range(8)],
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}}


def foreign_deployment(index: int) -> dict[str, Any]:
    """A Deployment of no group (no controller runs here: it makes no pods)."""
    name = f"web-{index:05d}"
    labels = {"app": "web", "deployment-index": str(index)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": foreign_pod(index)["spec"]}}}


async def make_foreign(client: KubeClient, count: int, parallel: int) -> float:
    """``count`` foreign pods and as many Deployments in their own namespace; returns the seconds."""
    started = time.monotonic()
    await make_namespace(client, FOREIGN_NAMESPACE)
    await bounded(parallel, [client.request("POST", pods_path(FOREIGN_NAMESPACE), body=foreign_pod(i),
                                            timeout=CALL_TIMEOUT) for i in range(count)])
    await bounded(parallel, [client.request("POST", f"/apis/apps/v1/namespaces/{FOREIGN_NAMESPACE}/deployments",
                                            body=foreign_deployment(i), timeout=CALL_TIMEOUT)
                             for i in range(count)])
    return time.monotonic() - started


async def bounded(parallel: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(parallel)

    async def one(job: Any) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(job) for job in jobs))


class LeaderWatch:
    """One watch on every SingletonService of every namespace (their names differ): when each
    first shows the leader we wait for, with its generation applied."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.leaders: dict[str, str | None] = {}
        self.first_seen: dict[str, float] = {}
        """When the watch first showed each SingletonService."""
        self.waiting: dict[str, tuple[str, asyncio.Future[float]]] = {}

    def expect(self, name: str, pod: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self.leaders.get(name) == pod:
            future.set_result(time.monotonic())
        else:
            self.waiting[name] = (pod, future)
        return future

    async def run(self) -> None:
        version = (await self.client.request("GET", ALL_CRS_PATH, params={"limit": "1"},
                                             timeout=CALL_TIMEOUT))["metadata"]["resourceVersion"]
        while True:
            try:
                async with contextlib.aclosing(self.client.watch(
                        ALL_CRS_PATH, params={"resourceVersion": version, "allowWatchBookmarks": "true"},
                        timeout=120)) as events:
                    async for kind, obj in events:
                        version = obj["metadata"]["resourceVersion"]
                        if kind in ("ADDED", "MODIFIED"):
                            self._seen(obj)
            except KubeError as exc:
                print(f"  (watch: {exc}; watching again)", file=sys.stderr)
                await asyncio.sleep(0.2)

    def _seen(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.first_seen.setdefault(name, time.monotonic())
        status = obj.get("status") or {}
        # Reconciled too: the refresher may name the leader (from the pods) before the group's
        # objects are applied, and that work is part of what is measured.
        applied = status.get("observedGeneration", 0) >= obj["metadata"].get("generation", 1)
        leader = status.get("leader") if applied else None
        self.leaders[name] = leader
        wanted = self.waiting.get(name)
        if wanted is not None and wanted[0] == leader:
            del self.waiting[name]
            if not wanted[1].done():
                wanted[1].set_result(time.monotonic())


class Operator:
    """The operator as a process, as ``singleton_testbed.harness.operators`` runs it."""

    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        """``kubeconfig``: whom the operator runs as (the admin's, or ``chart_account``'s)."""
        self.port = free_port()
        self.log = workdir / "operator.log"
        argv = [sys.executable, "-m", "singleton_operator.cli", "run", "--kubeconfig", str(kubeconfig),
                "--lease-namespace", NAMESPACE, "--health-listen", f"127.0.0.1:{self.port}",
                "--identity", "bench-operator", "--log-format", "json"]
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)

    def leading(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as resp:
                return bool(resp.status == 200 and resp.read().decode().strip() == "leader")
        except OSError:
            return False

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)


def audit_requests(path: Path, offset: int) -> dict[str, int]:
    """The operator's requests after ``offset`` in the audit log, by verb and resource."""
    kinds: dict[str, set[str]] = {}
    with path.open("rb") as audit:
        audit.seek(offset)
        for line in audit.read().splitlines():
            entry = json.loads(line)
            if not entry.get("userAgent", "").startswith(OPERATOR_AGENTS):
                continue
            ref = entry.get("objectRef", {})
            sub = f"/{ref['subresource']}" if "subresource" in ref else ""
            kind = f"{entry['verb']} {ref.get('resource')}{sub}"
            kinds.setdefault(kind, set()).add(entry["auditID"])
    return {k: len(v) for k, v in sorted(kinds.items())}


async def make_namespace(client: KubeClient, name: str) -> None:
    """A namespace and its ``default`` ServiceAccount (no controller makes it here; pods need it)."""
    await client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}}, timeout=CALL_TIMEOUT)
    await client.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", body={"metadata": {"name": "default"}},
                         timeout=CALL_TIMEOUT)


@contextlib.contextmanager
def control_plane() -> Iterator[ControlPlane]:
    binaries = find_all()
    add_to_path(binaries)
    plane = ControlPlane(binaries)
    try:
        plane.start()
        plane.kubectl("create", "namespace", NAMESPACE)
        plane.kubectl("create", "serviceaccount", "default", "-n", NAMESPACE)
        plane.kubectl("apply", "-f", str(ROOT / "crds"))
        wait_established(plane.kubectl, f"crd/{contract.PLURAL}.{contract.API_GROUP}")
        yield plane
    finally:
        plane.stop()


def chart_account(plane: ControlPlane, workdir: Path) -> Path:
    """A kubeconfig for the operator's ServiceAccount as the chart makes it (its ClusterRole, its
    Role for the Lease), so that the API server checks the operator's requests as in a cluster:
    RBAC, and for each Role and RoleBinding it applies, that it holds what it grants (the
    chart gives it no "escalate" or "bind"). The admin user skips those checks."""
    version = json.loads(plane.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    rendered = subprocess.run(
        ["helm", "template", "singleton", str(ROOT / "charts" / "singleton"), "--namespace", NAMESPACE,
         "--kube-version", version,
         "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/clusterrole.yaml",
         "--show-only", "templates/role.yaml"],
        capture_output=True, text=True, check=True).stdout
    plane.kubectl("apply", "-f", "-", input_text=rendered)
    account = next(d["metadata"]["name"] for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ServiceAccount")
    token = plane.kubectl("create", "token", account, "-n", NAMESPACE, "--duration", "6h").stdout.strip()
    path = workdir / "operator.kubeconfig"
    write_kubeconfig(path, server=plane.info.server, ca_file=plane.info.ca_file, token=token,
                     user=f"system:serviceaccount:{NAMESPACE}:{account}")
    return path


@contextlib.asynccontextmanager
async def watching(client: KubeClient) -> AsyncIterator[LeaderWatch]:
    watch = LeaderWatch(client)
    task = asyncio.create_task(watch.run())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Bench:
    plane: ControlPlane
    client: KubeClient
    operator: Operator
    watch: LeaderWatch
    result: RunResult
    homes: dict[str, str] = field(default_factory=dict)
    """The namespace of each group of the burst (a group not here: see ``home``)."""
    created: dict[str, float] = field(default_factory=dict)

    @property
    def audit(self) -> Path:
        return self.plane.workdir / "audit.log"

    def home(self, name: str) -> str:
        """The group's namespace; a group created later joins the first group's (so that it
        finds the answers of that namespace's access reviews as a user's new group would)."""
        return self.homes.get(name) or self.homes.get(group_name(0), NAMESPACE)

    async def create(self, name: str) -> None:
        namespace = self.home(name)
        await self.client.request("POST", crs_path(namespace), body=cr_body(name, namespace), timeout=CALL_TIMEOUT)
        self.created[name] = time.monotonic()

    async def create_at(self, name: str, moment: float) -> None:
        await asyncio.sleep(max(moment - time.monotonic(), 0.0))
        await self.create(name)

    async def operator_answers(self, awaited: Awaitable[T], timeout: float) -> T:
        """``awaited``, or a clear error when the operator process exits first (with thousands of
        foreign objects, kopf's watches of every pod once starved its Lease renewals) or it
        takes more than ``timeout`` seconds."""
        task = asyncio.ensure_future(awaited)
        deadline = time.monotonic() + timeout
        try:
            while not task.done():
                if self.operator.popen.poll() is not None:
                    raise SystemExit(f"the operator exited ({self.operator.popen.returncode}); see {self.operator.log}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"no answer within {timeout:g} s; see {self.operator.log}")
                await asyncio.wait({task}, timeout=0.5)
            return task.result()
        finally:
            task.cancel()

    async def burst(self, names: list[str], parallel: int, rate: float | None = None) -> None:
        """Every group created at once (``rate``: that many creates a second, as a GitOps
        tool's client-side rate limit sends them); each timed until its status names its leader."""
        futures = [self.watch.expect(n, f"{n}-a") for n in names]
        first = time.monotonic()
        with self.measured() as measured:
            await bounded(parallel, [self.create(n) if rate is None else self.create_at(n, first + i / rate)
                                     for i, n in enumerate(names)])
            seen = await self.operator_answers(asyncio.gather(*futures), 600)
        self.settled(names, seen, first, measured)

    @contextlib.contextmanager
    def measured(self) -> Iterator[dict[str, Any]]:
        """The operator's requests (the audit log) and each process's CPU while the block runs."""
        offset = self.audit.stat().st_size
        assert self.plane.apiserver is not None and self.plane.etcd is not None
        pids = {"operator": self.operator.popen.pid, "kube-apiserver": self.plane.apiserver.pid,
                "etcd": self.plane.etcd.pid}
        cpu_from = {k: cpu_seconds(pid) for k, pid in pids.items()}
        measured: dict[str, Any] = {}
        yield measured
        measured["requests"] = audit_requests(self.audit, offset)
        measured["cpu"] = {k: cpu_seconds(pid) - cpu_from[k] for k, pid in pids.items()}

    def settled(self, names: list[str], seen: list[float], first: float, measured: dict[str, Any]) -> None:
        self.result.create_to_leader = [at - self.created[n] for n, at in zip(names, seen, strict=True)]
        self.result.all_settled = max(seen) - first
        self.result.burst_requests = measured["requests"]
        self.result.burst_cpu = measured["cpu"]
        print(f"  {len(names)} groups: every status names its leader {self.result.all_settled:.1f} s after the "
              f"first create; {sum(self.result.burst_requests.values())} operator requests", flush=True)

    async def burst_kubectl(self, names: list[str], way: str) -> None:
        """Every group in one file given to ``kubectl apply -f``, as the admin applies it: kubectl
        creates one object after another, each after the last one's answer, and prints each
        one's "created" line as it goes. A group's create moment is that line's arrival or,
        if sooner, the watch's first sight of it (so that a late read of kubectl's output never
        shortens what is measured)."""
        manifest = self.plane.workdir / "groups.yaml"
        manifest.write_text(yaml.safe_dump_all([cr_body(n, self.home(n)) for n in names]))
        futures = [self.watch.expect(n, f"{n}-a") for n in names]
        arguments, made = KUBECTL_APPLY[way]
        wanted = set(names)
        with self.measured() as measured:
            kubectl = await asyncio.create_subprocess_exec(
                "kubectl", "--kubeconfig", str(self.plane.info.kubeconfig), "apply", *arguments,
                f"--request-timeout={CALL_TIMEOUT:g}s", "-f", str(manifest),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            assert kubectl.stdout is not None and kubectl.stderr is not None
            errors = asyncio.create_task(kubectl.stderr.read())
            problem = None
            try:
                async with asyncio.timeout(KUBECTL_TIMEOUT):
                    async for raw in kubectl.stdout:
                        # "singletonservice.singleton.dev/g0000 created"
                        words = raw.decode().split()
                        name = words[0].rsplit("/", 1)[-1] if len(words) == 2 and words[1] == made else None
                        if name not in wanted:
                            problem = f"printed an unexpected line: {raw.decode().strip()!r}"
                            break
                        self.created[name] = time.monotonic()
                    else:
                        code = await kubectl.wait()
                        if code != 0 or len(self.created) < len(names):
                            problem = f"exited {code} having created {len(self.created)} of {len(names)}"
            except TimeoutError:
                problem = f"took more than {KUBECTL_TIMEOUT:g} s"
            finally:
                if kubectl.returncode is None:
                    kubectl.kill()
                    await kubectl.wait()
            if problem is not None:
                raise RuntimeError(f"kubectl apply {problem}; its errors: {(await errors).decode().strip()}")
            seen = await self.operator_answers(asyncio.gather(*futures), 600)
        for name in names:
            self.created[name] = min(self.created[name], self.watch.first_seen[name])
        self.settled(names, seen, min(self.created.values()), measured)

    async def one_more(self, count: int) -> None:
        """Groups created one at a time beside the others."""
        for i in range(count):
            name = f"more-{i:03d}"
            pods = (("a", contract.ROLE_LEADER, 1), ("b", contract.ROLE_STANDBY, None))
            await bounded(2, [make_pod(self.client, name, s, role, token, namespace=self.home(name))
                              for s, role, token in pods])
            arrived = self.watch.expect(name, f"{name}-a")
            await self.create(name)
            self.result.create_one_more.append(await self.operator_answers(arrived, 120) - self.created[name])
            await asyncio.sleep(0.5)

    async def rest(self, seconds: float) -> None:
        offset = self.audit.stat().st_size
        pid = self.operator.popen.pid
        cpu_before = cpu_seconds(pid)
        await asyncio.sleep(seconds)
        self.result.cpu_percent = 100 * (cpu_seconds(pid) - cpu_before) / seconds
        self.result.requests_by_kind = audit_requests(self.audit, offset)
        self.result.requests_per_second = sum(self.result.requests_by_kind.values()) / seconds
        self.result.rss_mb = rss_mb(pid)

    async def leader_changes(self, names: list[str]) -> None:
        """Per group, the sidecars' annotations as at a failover -> the status naming the new pod."""
        for name in names:
            new = f"{name}-b"
            arrived = self.watch.expect(name, new)
            patched = time.monotonic()
            await asyncio.gather(*(
                self.client.request("PATCH", f"{pods_path(self.home(name))}/{pod}",
                                    body={"metadata": {"annotations": pod_annotations(pod, role, token)}},
                                    content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
                for pod, role, token in ((f"{name}-a", contract.ROLE_STANDBY, None),
                                         (new, contract.ROLE_LEADER, 2))))
            self.result.notice_change.append(await self.operator_answers(arrived, 120) - patched)
            await asyncio.sleep(0.5)


async def run_once(plane: ControlPlane, *, groups: int, parallel: int, rest_seconds: float, changes: int,
                   one_more: int, workdir: Path, rate: float | None = None, kubectl: str | None = None,
                   as_admin: bool = False, namespaces: int = 1, foreign: int = 0) -> RunResult:
    result = RunResult(groups=groups, rate=rate, kubectl=kubectl, namespaces=namespaces, foreign=foreign)
    names = [group_name(i) for i in range(groups)]
    homes = group_namespaces(names, namespaces)
    async with KubeClient(load_kube_config(str(plane.info.kubeconfig)), user_agent="bench") as client:
        if foreign:
            result.foreign_seconds = await make_foreign(client, foreign, parallel)
            print(f"  {foreign} foreign pods and Deployments made in {result.foreign_seconds:.0f} s", flush=True)
        await bounded(parallel, [make_namespace(client, n) for n in sorted(set(homes.values()) - {NAMESPACE})])
        await bounded(parallel, [make_pod(client, n, s, role, token, namespace=homes[n]) for n in names
                                 for s, role, token in (("a", contract.ROLE_LEADER, 1),
                                                        ("b", contract.ROLE_STANDBY, None))])
        operator = Operator(plane.info.kubeconfig if as_admin else chart_account(plane, workdir), workdir)
        try:
            deadline = time.monotonic() + 60
            while not operator.leading():
                if time.monotonic() > deadline or operator.popen.poll() is not None:
                    raise RuntimeError(f"the operator did not lead within 60 s; see {operator.log}")
                await asyncio.sleep(0.1)
            async with watching(client) as watch:
                await asyncio.sleep(1)  # the watch is open
                bench = Bench(plane, client, operator, watch, result, homes)
                if kubectl is not None:
                    await bench.burst_kubectl(names, kubectl)
                else:
                    await bench.burst(names, parallel, rate)
                await asyncio.sleep(10)  # kopf's own follow-up patches settle
                await bench.one_more(one_more)
                await bench.rest(rest_seconds)
                await bench.leader_changes(random.sample(names, min(changes, len(names))))
        finally:
            operator.stop()
    return result


def line(name: str, values: list[float]) -> str:
    return (f"{name:<44} n={len(values):<4} median={statistics.median(values):8.3f} s  "
            f"p99={percentile(values, 0.99):8.3f} s  max={max(values):8.3f} s")


def report(results: list[RunResult]) -> None:
    groups = results[0].groups
    rate = results[0].rate
    paced = (f", created by one kubectl apply ({results[0].kubectl})" if results[0].kubectl
             else f", created {rate:g} a second" if rate else ", created at once")
    if results[0].namespaces > 1:
        paced += f", in {results[0].namespaces} namespaces"
    paced += f", {results[0].foreign} foreign pods and as many Deployments"
    print(f"\nOperator with {groups} SingletonServices{paced} ({len(results)} run(s)):")
    print(line("create -> status with a leader", [v for r in results for v in r.create_to_leader]))
    print(line("first create -> last group settled", [r.all_settled for r in results]))
    print(line("then one more group: create -> leader", [v for r in results for v in r.create_one_more]))
    print(line("leader change on one group -> status", [v for r in results for v in r.notice_change]))
    for r in results:
        print("  burst: CPU seconds " + ", ".join(f"{k} {v:.1f}" for k, v in r.burst_cpu.items())
              + f"; {sum(r.burst_requests.values()) / r.groups:.1f} operator requests per group: "
              + ", ".join(f"{k}: {v}" for k, v in r.burst_requests.items()))
        print(f"  at rest: {r.requests_per_second:.3f} API requests/s, CPU {r.cpu_percent:.2f} %, "
              f"RSS {r.rss_mb:.1f} MB; requests: " + ", ".join(f"{k}: {v}" for k, v in r.requests_by_kind.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=500, help="SingletonServices (default 500)")
    parser.add_argument("--runs", type=int, default=1, help="runs, each on a fresh control plane (default 1)")
    parser.add_argument("--parallel", type=int, default=50,
                        help="create requests in flight (default 50; with --kubectl, for the pods only: "
                        "kubectl makes one group after another)")
    parser.add_argument("--namespaces", type=int, default=1,
                        help=f"spread the groups over this many namespaces, {NAMESPACE}-000 and on, as "
                        f"teams each in their own would (default 1: all in {NAMESPACE})")
    parser.add_argument("--rest-seconds", type=float, default=60.0, help="the at-rest window (default 60)")
    parser.add_argument("--changes", type=int, default=20, help="leader changes to time (default 20)")
    parser.add_argument("--one-more", type=int, default=20,
                        help="groups then created one at a time beside the others (default 20)")
    parser.add_argument("--rate", type=float, default=None, metavar="PER_SECOND",
                        help="create the groups at this many a second (default: all at once)")
    parser.add_argument("--kubectl", choices=sorted(KUBECTL_APPLY), default=None,
                        help="create the groups with one `kubectl apply -f` of a file holding them all, as "
                        "the test bed's admin: kubectl's default (client-side) apply, or --server-side "
                        "(default: --parallel create requests in flight)")
    parser.add_argument("--as-admin", action="store_true",
                        help="run the operator as the test bed's admin, whose requests skip RBAC and its "
                        "escalation checks (default: the chart's ServiceAccount and RBAC)")
    parser.add_argument("--foreign", type=int, nargs="+", default=[0], metavar="N",
                        help="pods of no group, and as many Deployments, in the API server before the operator "
                        "starts: one configuration per N, each on fresh control planes, compared with the first "
                        "(default 0)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every figure here")
    args = parser.parse_args(argv)
    if min(args.groups, args.runs, args.parallel, args.changes, args.one_more, args.namespaces) < 1 \
            or args.rest_seconds <= 0:
        parser.error("--groups, --runs, --parallel, --changes, --one-more and --namespaces must be at least 1, "
                     "--rest-seconds above 0")
    if args.namespaces > args.groups:
        parser.error(f"--namespaces ({args.namespaces}) must not exceed --groups ({args.groups})")
    if args.rate is not None and not 0 < args.rate < float("inf"):
        parser.error(f"--rate must be a number of creates a second above 0, not {args.rate}")
    if args.rate is not None and args.kubectl is not None:
        parser.error("--rate and --kubectl are two ways to create the groups: give one of them")
    if min(args.foreign) < 0:
        parser.error("--foreign counts must be 0 or more")
    by_foreign: dict[int, list[RunResult]] = {}
    for foreign in args.foreign:
        for run in range(args.runs):
            workdir = Path(tempfile.mkdtemp(prefix="operator-scale-"))
            print(f"{foreign} foreign, run {run + 1}/{args.runs} (work folder {workdir})", flush=True)
            with control_plane() as plane:
                by_foreign.setdefault(foreign, []).append(asyncio.run(run_once(
                    plane, groups=args.groups, parallel=args.parallel, rest_seconds=args.rest_seconds,
                    changes=args.changes, one_more=args.one_more, workdir=workdir, rate=args.rate,
                    kubectl=args.kubectl, as_admin=args.as_admin, namespaces=args.namespaces, foreign=foreign)))
    for results in by_foreign.values():
        report(results)
    if len(by_foreign) > 1:
        compare_foreign(by_foreign)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for results in by_foreign.values() for r in results], indent=1))
    return 0


def compare_foreign(by_foreign: dict[int, list[RunResult]]) -> None:
    """Each configuration against the first (issue 34's goal: at rest within 10 %, create -> leader
    p99 unchanged within noise), medians over its runs."""
    base_count, base = next(iter(by_foreign.items()))

    def at_rest(results: list[RunResult]) -> tuple[float, float, float]:
        return (statistics.median(r.rss_mb for r in results), statistics.median(r.cpu_percent for r in results),
                percentile([v for r in results for v in r.create_to_leader], 0.99))

    rss0, cpu0, p99_0 = at_rest(base)
    print(f"\nagainst {base_count} foreign: ratio of RSS at rest, CPU at rest, create -> leader p99")
    for count, results in by_foreign.items():
        rss, cpu, p99 = at_rest(results)
        print(f"  {count:>6} foreign: RSS {rss:.1f} MB ({rss / rss0:.2f}), CPU {cpu:.2f} % "
              f"({cpu / cpu0 if cpu0 else float('nan'):.2f}), p99 {p99:.2f} s ({p99 / p99_0:.2f})")


if __name__ == "__main__":
    sys.exit(main())
