"""The stand-in kubelet on the real control plane (with controller-manager and scheduler):
pods become local processes in their own network namespaces, and behave as on a kubelet.

Two stand-ins (nodes) run for the module; most tests bind pods to one of them directly,
the Deployment's pods are placed by the scheduler. Needs root and ``ip netns``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from singleton_testbed.kubelet import StandInConfig, StandInKubelet, ThreadedStandIn
from singleton_testbed.kubelet_control import process_alive
from singleton_testbed.netns import PodNetworkConfig, netns_supported
from singleton_testbed.postgres import PostgresServer
from tests.conftest import Cluster, use_existing_cluster
from tests.kubelet_fixtures import (
    Api,
    app_container,
    condition,
    container_status,
    http,
    pod_manifest,
    quote,
    serving,
    wait_for,
)

_SKIP = netns_supported() or ("pods cannot reach an existing cluster's API server" if use_existing_cluster() else None)
pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

NET = PodNetworkConfig()


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Api:
    return Api(cluster.kubeconfig)


@pytest.fixture(scope="module")
def standins(controllers: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[StandInKubelet]]:
    suffix = secrets.token_hex(3)
    kubelets = [StandInKubelet(kubeconfig=controllers.kubeconfig, node=f"standin-{x}-{suffix}",
                               state_dir=tmp_path_factory.mktemp(f"standin-{x}")) for x in "ab"]
    try:
        for kubelet in kubelets:
            kubelet.start()
        yield kubelets
    finally:
        for kubelet in kubelets:
            kubelet.stop()


@pytest.fixture
def node_a(standins: list[StandInKubelet]) -> StandInKubelet:
    return standins[0]


def create_pod(cluster: Cluster, namespace: str, manifest: dict[str, object]) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input_text=json.dumps(manifest))


# --- a Deployment placed by the scheduler -----------------------------------------------------

WEB = """
apiVersion: v1
kind: Secret
metadata: {{name: app-secret}}
stringData: {{token: s3cr3t-value}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: app}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: pod-reader}}
rules: [{{apiGroups: [""], resources: [pods], verbs: [get]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: app-pod-reader}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}}
subjects: [{{kind: ServiceAccount, name: app}}]
---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: http}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      serviceAccountName: app
      nodeSelector: {{singleton.dev/stand-in: "true"}}
      terminationGracePeriodSeconds: 2
      containers:
      - {container}
"""


@dataclass(frozen=True)
class Web:
    namespace: str
    pods: dict[str, dict[str, str]]
    """Pod name → {"uid", "ip", "node"}."""


@pytest.fixture(scope="module")
def web(controllers: Cluster, standins: list[StandInKubelet], api: Api) -> Iterator[Web]:
    namespace = "t-kubelet-web-" + secrets.token_hex(3)
    controllers.kubectl("create", "namespace", namespace)
    container = app_container(env={"EARLY": "hi $(POD_NAME)"}, readinessProbe={
        "httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1})
    container["env"] += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SECRET_TOKEN", "valueFrom": {"secretKeyRef": {"name": "app-secret", "key": "token"}}},
        {"name": "GREETING", "value": "hi $(POD_NAME) on $(NODE), $$(POD_NAME)"},
    ]
    try:
        controllers.apply(WEB.format(container=json.dumps(container)), namespace=namespace)
        path = f"/apis/apps/v1/namespaces/{namespace}/deployments/web"
        wait_for("2 ready replicas", lambda: ((api.get(path) or {}).get("status") or {}).get("readyReplicas") == 2)
        items = (api.get(f"/api/v1/namespaces/{namespace}/pods") or {})["items"]
        pods = {p["metadata"]["name"]: {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"],
                                         "node": p["spec"]["nodeName"]} for p in items}
        yield Web(namespace, pods)
    finally:
        controllers.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_deployment_pods_run_ready_with_distinct_reachable_ips(web: Web, standins: list[StandInKubelet]) -> None:
    ips = [pod["ip"] for pod in web.pods.values()]
    assert len(ips) == 2 and len(set(ips)) == 2
    assert {pod["node"] for pod in web.pods.values()} <= {k.node for k in standins}
    for ip in ips:
        assert ipaddress.IPv4Address(ip) in NET.network
        assert http(ip, "/healthz") == (200, {"ok": True})


def test_env_from_downward_api_and_secret(web: Web) -> None:
    for name, pod in web.pods.items():
        status, env = http(pod["ip"], "/env")
        assert status == 200
        assert env["POD_NAME"] == name and env["POD_IP"] == pod["ip"] and env["NODE"] == pod["node"]
        assert env["SECRET_TOKEN"] == "s3cr3t-value"
        assert env["GREETING"] == f"hi {name} on {pod['node']}, $(POD_NAME)"
        assert env["EARLY"] == "hi $(POD_NAME)"  # defined before POD_NAME: not expanded, as in Kubernetes
        assert env["KUBERNETES_SERVICE_HOST"] == NET.api_ip
        assert env["HOSTNAME"] == name


def test_service_account_token_works_in_cluster_style(web: Web) -> None:
    for name, pod in web.pods.items():
        status, who = http(pod["ip"], "/whoami")
        assert status == 200
        assert who == {"namespace": web.namespace, "pod_status": 200, "pod_name": name, "pod_uid": pod["uid"],
                       "secrets_status": 403}


def _ready_endpoints(api: Api, namespace: str) -> set[str]:
    slices = api.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
                     "?labelSelector=kubernetes.io%2Fservice-name%3Dweb") or {}
    return {address for item in slices["items"] for ep in item.get("endpoints") or []
            if ep.get("conditions", {}).get("ready") for address in ep["addresses"]}


def test_readiness_flip_reaches_pod_condition_and_endpointslice(web: Web, api: Api) -> None:
    ips = {pod["ip"] for pod in web.pods.values()}
    wait_for("both pods in the EndpointSlice", lambda: _ready_endpoints(api, web.namespace) == ips)
    name, pod = sorted(web.pods.items())[0]
    flipped_at = http(pod["ip"], "/ready/false", method="POST")[1]["flipped_at"]
    wait_for("Ready=False", lambda: condition(api.pod(web.namespace, name), "Ready") == "False",
             interval=0.01, timeout=5)
    seen_at = time.time()
    probed_at = http(pod["ip"], "/state")[1]["first_unready_probe_at"]
    assert seen_at - flipped_at < 1.5, "the probe period is 1 s"
    assert seen_at - probed_at < 0.5, "from the failing probe to the pod's Ready condition"
    wait_for("only the ready pod in the EndpointSlice", lambda: _ready_endpoints(api, web.namespace) == ips - {
        pod["ip"]}, timeout=10)
    http(pod["ip"], "/ready/true", method="POST")
    wait_for("Ready=True", lambda: condition(api.pod(web.namespace, name), "Ready") == "True", timeout=3)
    wait_for("both pods in the EndpointSlice again", lambda: _ready_endpoints(api, web.namespace) == ips)


# --- pods bound to a node directly ------------------------------------------------------------


def test_crashes_and_liveness_failures_restart_the_container(
    cluster: Cluster, namespace: str, api: Api, node_a: StandInKubelet
) -> None:
    container = app_container(livenessProbe={"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1,
                                             "timeoutSeconds": 1, "failureThreshold": 1, "initialDelaySeconds": 1})
    create_pod(cluster, namespace, pod_manifest("crashy", node_a.node, [container], terminationGracePeriodSeconds=1))
    ip = node_a.wait_for_pod(namespace, "crashy").ip
    wait_for("app serving", lambda: serving(ip))

    def restarted(count: int) -> dict[str, object] | None:
        status = container_status(api.pod(namespace, "crashy") or {}, "app")
        running = "running" in status["state"] and status["restartCount"] == count
        return status if running else None

    http(ip, "/crash?code=3", method="POST")
    status = wait_for("restart 1", lambda: restarted(1), timeout=10)
    assert status["lastState"]["terminated"]["exitCode"] == 3  # type: ignore[index]
    first_pid = wait_for("new pid", lambda: node_a.pod(namespace, "crashy").container("app").pid)

    node_a.signal(namespace, "crashy", "app", "SIGKILL")
    status = wait_for("restart 2", lambda: restarted(2), timeout=10)
    assert status["lastState"]["terminated"]["exitCode"] == 137  # type: ignore[index]
    assert not process_alive(first_pid)

    wait_for("app serving", lambda: serving(ip))
    node_a.signal(namespace, "crashy", "app", "SIGSTOP")  # liveness times out, SIGTERM waits, SIGKILL
    wait_for("restart 3 after the liveness probe failed", lambda: restarted(3), timeout=15)
    assert (api.pod(namespace, "crashy") or {})["status"]["phase"] == "Running"


def test_native_sidecar_starts_before_and_stops_after_the_main_container(
    cluster: Cluster, namespace: str, api: Api, node_a: StandInKubelet
) -> None:
    shared: dict[str, Any] = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}
    order = {"ORDER_FILE": "/shared/order"}
    setup = {"name": "setup", "image": "busybox", "command": ["sh", "-c", "echo init >> /shared/order"], **shared}
    sidecar = app_container("side", port=8081, env={**order, "ROLE": "sidecar"}, restartPolicy="Always",
                            startupProbe={"httpGet": {"path": "/healthz", "port": 8081}, "periodSeconds": 1},
                            lifecycle={"preStop": {"httpGet": {"path": "/event?name=prestop", "port": 8081}}},
                            **shared)
    main = app_container("main", env={**order, "ROLE": "main"}, **shared)
    create_pod(cluster, namespace, pod_manifest("sided", node_a.node, [main], initContainers=[setup, sidecar],
                                                volumes=[{"name": "shared", "emptyDir": {}}],
                                                terminationGracePeriodSeconds=5))
    node_a.wait_for_pod(namespace, "sided")
    wait_for("main started", lambda: "started main" in node_a.read_log(namespace, "sided", "main"))
    assert "order at start: init | start sidecar\n" in node_a.read_log(namespace, "sided", "main")
    pod = wait_for("statuses", lambda: p if condition(p := api.pod(namespace, "sided"), "Ready") == "True" else None)
    assert container_status(pod, "setup")["state"]["terminated"]["reason"] == "Completed"
    side = container_status(pod, "side")
    assert "running" in side["state"] and side["started"] is True
    assert condition(pod, "Initialized") == "True"

    api.delete_pod(namespace, "sided")
    wait_for("pod deleted", lambda: api.pod(namespace, "sided") is None, timeout=15)
    log = node_a.read_log(namespace, "sided", "side")
    assert "order: init | start sidecar | start main | stop main | prestop sidecar | stop sidecar" in log


def test_deletion_runs_prestop_then_sigterm_then_sigkill_after_grace(
    cluster: Cluster, namespace: str, api: Api, node_a: StandInKubelet, tmp_path: Path
) -> None:
    events, mount_point = tmp_path / "events", tmp_path / "mnt" / "events"
    stubborn = app_container(
        env={"IGNORE_SIGTERM": "1", "ALIVE_TICKS": "1"},
        volumeMounts=[{"name": "events", "mountPath": str(mount_point)}],
        lifecycle={"preStop": {"exec": {"command": ["sh", "-c", f"date +%s.%N > {mount_point}/prestop"]}}})
    create_pod(cluster, namespace, pod_manifest(
        "stubborn", node_a.node, [stubborn], terminationGracePeriodSeconds=2,
        volumes=[{"name": "events", "hostPath": {"path": str(events), "type": "DirectoryOrCreate"}}]))
    pid = node_a.wait_for_pod(namespace, "stubborn").container("app").pid
    assert pid is not None
    wait_for("ticking", lambda: "alive" in node_a.read_log(namespace, "stubborn", "app"))

    deleted_at = time.time()
    api.delete_pod(namespace, "stubborn")
    wait_for("pod deleted", lambda: api.pod(namespace, "stubborn") is None, timeout=10)
    gone_at = time.time()

    log = node_a.read_log(namespace, "stubborn", "app")
    prestop_at = float((events / "prestop").read_text())
    sigterm_at = float(re.findall(r"^SIGTERM (\S+)$", log, re.M)[0])
    last_alive = float(re.findall(r"^alive (\S+)$", log, re.M)[-1])
    assert deleted_at <= prestop_at <= sigterm_at
    assert 1.5 <= last_alive - deleted_at <= 2.5, "killed when the 2 s grace period ended"
    assert gone_at - deleted_at < 4
    assert not process_alive(pid)
    assert not any(mount_point.iterdir()), "the hook wrote through the container's private mount"


def test_partition_cuts_one_address_and_heal_restores_it(
    cluster: Cluster, namespace: str, node_a: StandInKubelet, postgres_server: PostgresServer | None
) -> None:
    create_pod(cluster, namespace, pod_manifest("net", node_a.node, [app_container()]))
    ip = node_a.wait_for_pod(namespace, "net").ip
    wait_for("app serving", lambda: serving(ip))
    api_port = urlsplit(cluster.kubectl("config", "view", "--minify", "-o",
                                        "jsonpath={.clusters[0].cluster.server}").stdout).port

    def reach(host: str, port: int | None, timeout: float = 1.0) -> dict[str, object]:
        return http(ip, f"/connect?host={host}&port={port}&timeout={timeout}")[1]

    assert reach(NET.api_ip, api_port)["ok"] is True
    if postgres_server is not None:
        dsn = dataclasses.replace(postgres_server.info, host=NET.postgres_ip).dsn
        assert http(ip, f"/pg?dsn={quote(dsn)}")[1] == {"ok": True, "user": "singleton"}

    node_a.partition(namespace, "net", NET.api_ip)
    cut = reach(NET.api_ip, api_port)
    assert cut["ok"] is False and float(cut["seconds"]) >= 0.9, "dropped silently, as in a partition"  # type: ignore[arg-type]
    if postgres_server is not None:
        assert reach(NET.postgres_ip, postgres_server.port)["ok"] is True
    node_a.heal(namespace, "net", NET.api_ip)
    assert reach(NET.api_ip, api_port)["ok"] is True

    node_a.partition(namespace, "net", NET.api_ip, mode="reject")
    rejected = reach(NET.api_ip, api_port)
    assert rejected["ok"] is False and float(rejected["seconds"]) < 0.5  # type: ignore[arg-type]
    node_a.heal(namespace, "net", NET.api_ip)
    assert reach(NET.api_ip, api_port)["ok"] is True


def test_readiness_gate_exec_probe_and_tcp_liveness(
    cluster: Cluster, namespace: str, api: Api, node_a: StandInKubelet
) -> None:
    gate = "example.com/gate"
    # The exec probe asks 127.0.0.1: it only reaches the app from inside the pod's network namespace.
    ask = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/ready', timeout=1)"
    container = app_container(
        readinessProbe={"exec": {"command": [sys.executable, "-c", ask]}, "periodSeconds": 1, "failureThreshold": 1},
        livenessProbe={"tcpSocket": {"port": "http"}, "periodSeconds": 1})
    create_pod(cluster, namespace, pod_manifest("gated", node_a.node, [container],
                                                readinessGates=[{"conditionType": gate}]))
    ip = node_a.wait_for_pod(namespace, "gated").ip
    pod = wait_for("containers ready", lambda: p if condition(p := api.pod(namespace, "gated"),
                                                              "ContainersReady") == "True" else None)
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReadinessGatesNotReady")

    patch = {"status": {"conditions": [{"type": gate, "status": "True"}]}}
    status, _ = api.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/gated/status", patch,
                            content_type="application/strategic-merge-patch+json")
    assert status == 200
    wait_for("Ready with the gate", lambda: condition(api.pod(namespace, "gated"), "Ready") == "True", timeout=2)

    http(ip, "/ready/false", method="POST")
    pod = wait_for("not ready", lambda: p if condition(p := api.pod(namespace, "gated"), "Ready") == "False" else None,
                   timeout=5)
    assert condition(pod, gate) == "True", "the stand-in never touches conditions it does not own"
    assert container_status(pod, "app")["restartCount"] == 0, "the TCP liveness probe keeps passing"


def test_missing_secret_waits_with_config_error_then_starts(
    cluster: Cluster, namespace: str, api: Api, node_a: StandInKubelet
) -> None:
    cluster.kubectl("create", "configmap", "settings", "-n", namespace, "--from-literal=colour=blue")
    container = app_container(envFrom=[{"configMapRef": {"name": "settings"}, "prefix": "CM_"}])
    container["env"].append({"name": "LATE", "valueFrom": {"secretKeyRef": {"name": "later", "key": "value"}}})
    create_pod(cluster, namespace, pod_manifest("waiting", node_a.node, [container]))
    def waiting() -> dict[str, str] | None:
        pod = api.pod(namespace, "waiting") or {}
        if not (pod.get("status") or {}).get("containerStatuses"):
            return None
        state = container_status(pod, "app")["state"].get("waiting") or {}
        return state if state.get("reason") == "CreateContainerConfigError" else None

    assert "later" in wait_for("config error", waiting)["message"]

    cluster.kubectl("create", "secret", "generic", "later", "-n", namespace, "--from-literal=value=arrived")
    ip = node_a.wait_for_pod(namespace, "waiting", timeout=15).ip
    env = wait_for("env", lambda: http(ip, "/env")[1] if serving(ip) else None)
    assert (env["LATE"], env["CM_colour"]) == ("arrived", "blue")


def test_restart_policies_and_terminal_phases(cluster: Cluster, namespace: str, api: Api,
                                              node_a: StandInKubelet) -> None:
    def shell(script: str) -> dict[str, object]:
        return {"name": "job", "image": "busybox", "command": ["sh", "-c", script],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}

    scratch = [{"name": "scratch", "emptyDir": {}}]
    pods = {  # name: (restartPolicy, script, expected phase, expected restarts)
        "ok": ("Never", "exit 0", "Succeeded", 0),
        "fails": ("Never", "exit 4", "Failed", 0),
        "retries": ("OnFailure", "test -f /scratch/again && exit 0; touch /scratch/again; exit 1", "Succeeded", 1),
    }
    for name, (policy, script, _, _) in pods.items():
        create_pod(cluster, namespace, pod_manifest(name, node_a.node, [shell(script)], restartPolicy=policy,
                                                    volumes=scratch, automountServiceAccountToken=False))
    for name, (_, _, phase, restarts) in pods.items():
        pod = wait_for(f"{name} {phase}", lambda n=name, ph=phase: p if (  # type: ignore[misc]
            p := api.pod(namespace, n) or {}).get("status", {}).get("phase") == ph else None, timeout=15)
        status = container_status(pod, "job")
        assert status["restartCount"] == restarts
        assert status["state"]["terminated"]["exitCode"] == (4 if name == "fails" else 0)
        assert condition(pod, "Ready") == "False"


# --- stand-ins of their own -------------------------------------------------------------------


def _netns_names(prefix: str) -> set[str]:
    return {name for name in os.listdir("/run/netns") if name.startswith(prefix + "-")} \
        if os.path.isdir("/run/netns") else set()


def _links(prefix: str) -> set[str]:
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout)
    return {link["ifname"] for link in links if link["ifname"].startswith(prefix)}


def _child_pids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_crash_restart_and_stop_leave_nothing_behind(
    controllers: Cluster, namespace: str, api: Api, tmp_path: Path
) -> None:
    network = PodNetworkConfig(cidr="10.214.0.0/16", prefix="sgltt")
    kubelet = StandInKubelet(kubeconfig=controllers.kubeconfig, node="standin-c-" + secrets.token_hex(3),
                             state_dir=tmp_path / "standin", network=network)
    sleeper = {"name": "sleeper", "image": "busybox", "command": ["sh", "-c", "sleep 1000 & wait"]}
    kubelet.start()
    try:
        for name in ("keeper", "doomed"):
            create_pod(controllers, namespace, pod_manifest(name, kubelet.node, [sleeper],
                                                            automountServiceAccountToken=False))
        first = kubelet.wait_for_pod(namespace, "keeper").container("sleeper").pid
        kubelet.wait_for_pod(namespace, "doomed")
        assert first is not None
        orphan = wait_for("sleep started", lambda: _child_pids(first) or None)[0]

        kubelet.kill()  # a crash: containers die with it (PDEATHSIG), their children and netns stay
        wait_for("container gone", lambda: not process_alive(first))
        assert process_alive(orphan) and len(_netns_names("sgltt")) == 2
        api.delete_pod(namespace, "doomed")  # while no kubelet runs: it stays terminating

        kubelet.start()
        wait_for("doomed deleted on restart", lambda: api.pod(namespace, "doomed") is None, timeout=10)
        assert not process_alive(orphan), "the leftover namespace's processes were killed"
        again = kubelet.wait_for_pod(namespace, "keeper").container("sleeper").pid
        assert again not in (None, first)
        # The restart is counted as the new container is made; it shows running a moment later.
        keeper = wait_for("restart counted and running", lambda: p if (
            (status := container_status(p := api.pod(namespace, "keeper") or {}, "sleeper"))["restartCount"] >= 1
            and "running" in status["state"]) else None)
        assert container_status(keeper, "sleeper")["restartCount"] == 1
    finally:
        kubelet.stop()
    assert again is not None and not process_alive(again)
    assert _netns_names("sgltt") == set() and _links("sgltt") == set(), "no namespaces, veths or bridge left"
    assert api.get(f"/api/v1/nodes/{kubelet.node}") is None


def test_in_process_stand_in_runs_a_pod(controllers: Cluster, namespace: str, tmp_path: Path) -> None:
    config = StandInConfig(kubeconfig=controllers.kubeconfig, node="standin-t-" + secrets.token_hex(3),
                           state_dir=tmp_path)
    threaded = ThreadedStandIn(config)
    standin = threaded.start()
    try:
        create_pod(controllers, namespace, pod_manifest("inproc", config.node, [
            {"name": "c", "image": "busybox", "command": ["sleep", "1000"]}]))

        def running_pid() -> int | None:
            pods = threaded.call_soon(standin.pods)
            return next((c["pid"] for p in pods for c in p["containers"] if c["state"] == "running"), None)

        pid = wait_for("container running", running_pid)
        assert process_alive(pid)
    finally:
        threaded.stop()
    assert not process_alive(pid)


def test_a_volume_never_hides_the_host_paths_containers_run_from(tmp_path: Path) -> None:
    """Pods run the host's programs: a chart that mounts an emptyDir at /tmp must still find a
    virtualenv that lives below /tmp (as in a CI checkout under /tmp)."""
    from singleton_testbed.kubelet_spec import hides_host_paths

    venv = Path(sys.prefix)
    assert hides_host_paths(str(venv), [])
    assert hides_host_paths(str(venv.parent), [])
    assert hides_host_paths("/tmp", [Path("/tmp/state/pod/volumes/x")])
    assert not hides_host_paths("/var/run/singleton", [tmp_path / "vol"])
