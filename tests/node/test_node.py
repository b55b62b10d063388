"""The real node (``singleton_testbed.node``): containerd + runc + CNI, kubelet and kube-proxy
from the test bed's Go build, joined to the session's control plane (the session's
``real_node`` fixture, shared with every suite that runs pods on it).

Every component is real; the tests need root and the machine's containerd (skipped otherwise).
The last two tests stop the session's node (only one may run per machine), check that nothing
is left after a stop and after a killed run, and start it again with every image the session
had imported (``RealNode.restart``).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from singleton_testbed import node_host as host
from singleton_testbed import node_pods
from singleton_testbed.node import CTR, RUN_DIR, cleanup_stale
from singleton_testbed.node_config import NodeLayout
from tests.conftest import RealNode

pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.timeout(300)]


def _wait(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def _pod_manifest(name: str, image: str, placement: dict[str, object]) -> dict[str, Any]:
    """A native sidecar (an init container with ``restartPolicy: Always``) and a main
    container, both as uid 10001 on a read-only root file system, with an exec readiness probe."""
    security = {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False, "runAsUser": 10001,
                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}

    def container(role: str) -> dict[str, Any]:
        return {
            "name": role, "image": image, "imagePullPolicy": "Never", "securityContext": security,
            # sh as PID 1 ignores SIGTERM: trap it so the pod stops within its grace period.
            "command": ["sh", "-c", f"trap 'exit 0' TERM; echo {role}-started; while true; do sleep 1; done"],
            "readinessProbe": {"exec": {"command": ["cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace"]},
                               "periodSeconds": 1},
        }

    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 5, **placement,
            "initContainers": [{**container("side"), "restartPolicy": "Always"}],
            "containers": [container("main")],
        },
    }


def _create_pod(real_node: RealNode, namespace: str, name: str) -> dict[str, Any]:
    real_node.cluster.apply(json.dumps(_pod_manifest(name, real_node.image, real_node.pod_placement())),
                            namespace=namespace)
    real_node.cluster.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "-n", namespace, "--timeout=90s")
    result = real_node.cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json")
    pod: dict[str, Any] = json.loads(result.stdout)
    return pod


@pytest.fixture(scope="module")
def node_namespace(real_node: RealNode) -> Iterator[str]:
    name = "node-" + secrets.token_hex(3)
    real_node.cluster.kubectl("create", "namespace", name)
    # The test bed's controller-manager makes the namespace's default service account; pods
    # are refused until it exists.
    _wait(lambda: real_node.cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
          timeout=30, what="the default service account")
    yield name
    real_node.cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def pod(real_node: RealNode, node_namespace: str) -> dict[str, Any]:
    return _create_pod(real_node, node_namespace, "sidecar-pod")


def _exec(real_node: RealNode, namespace: str, *command: str, container: str = "main") -> Any:
    return real_node.cluster.kubectl("exec", "sidecar-pod", "-n", namespace, "-c", container, "--", *command,
                                     check=False)


def test_node_is_ready_with_a_non_loopback_internal_ip(real_node: RealNode) -> None:
    node = json.loads(real_node.cluster.kubectl("get", "node", real_node.node.layout.name, "-o", "json").stdout)
    ready = [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready == ["True"]
    internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert internal == [real_node.node.layout.node_ip]
    assert not ipaddress.ip_address(internal[0]).is_loopback
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] == real_node.node.kubelet_port


def test_the_bridge_keeps_its_mac_address_while_pods_come_and_go(real_node: RealNode, pod: dict[str, Any]) -> None:
    """Set, not inherited: a bridge takes its lowest port's MAC unless its own was set, and a
    change makes every pod's ARP entry for the node IP stale (tens of seconds without the host)."""
    bridge = Path("/sys/class/net", real_node.node.layout.bridge)
    assert (bridge / "addr_assign_type").read_text().strip() == "3"  # NET_ADDR_SET
    assert (bridge / "address").read_text().strip() == host.bridge_mac(real_node.node.layout.bridge)
    assert host.bridge_ports(real_node.node.layout.bridge), "the pod's veth is on the bridge"


def test_pod_with_native_sidecar_becomes_ready_with_a_pod_ip(real_node: RealNode, pod: dict[str, Any],
                                                              node_namespace: str) -> None:
    assert pod["spec"]["nodeName"] == real_node.node.layout.name
    statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
    assert sorted((s["name"], s["ready"], "running" in s["state"]) for s in statuses) == [
        ("main", True, True), ("side", True, True)]
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(real_node.node.layout.pod_cidr)
    # Real containers: the image's user and file system rules hold inside them.
    for container in ("main", "side"):
        uid = _exec(real_node, node_namespace, "id", "-u", container=container)
        assert (uid.returncode, uid.stdout.strip()) == (0, "10001")
    write = _exec(real_node, node_namespace, "touch", "/written")
    assert write.returncode != 0
    assert "Read-only file system" in write.stderr


def test_pod_reaches_the_kubernetes_service_cluster_ip(real_node: RealNode, pod: dict[str, Any],
                                                        node_namespace: str) -> None:
    service = json.loads(real_node.cluster.kubectl("get", "service", "kubernetes", "-o", "json").stdout)
    cluster_ip = service["spec"]["clusterIP"]
    connect = _exec(real_node, node_namespace, "sh", "-c", f"nc -w 5 {cluster_ip} 443 </dev/null")
    assert connect.returncode == 0, connect.stderr
    # The same probe fails where kube-proxy has no rule, so the success above is kube-proxy's.
    unused = str(ipaddress.ip_address(cluster_ip) + 200)
    missing = _exec(real_node, node_namespace, "sh", "-c", f"nc -w 2 {unused} 443 </dev/null")
    assert missing.returncode != 0


def test_kubectl_logs_and_exec_reach_the_kubelet(real_node: RealNode, pod: dict[str, Any],
                                                  node_namespace: str) -> None:
    for container in ("main", "side"):
        logs = real_node.cluster.kubectl("logs", "sidecar-pod", "-n", node_namespace, "-c", container)
        assert logs.stdout.splitlines() == [f"{container}-started"]
    marker = secrets.token_hex(4)
    echo = _exec(real_node, node_namespace, "echo", marker)
    assert (echo.returncode, echo.stdout) == (0, f"{marker}\n")


def _container_ids(pod: dict[str, Any]) -> list[str]:
    statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
    return [s["containerID"].removeprefix("containerd://") for s in statuses]


def _running_tasks(real_node: RealNode) -> set[str]:
    result = host.run(str(CTR), "--address", str(real_node.node.paths.socket), "--namespace", "k8s.io",
                      "tasks", "ls", "-q")
    return set(result.stdout.split())


def _pod_cgroups(real_node: RealNode, uid: str) -> list[Path]:
    return [p for p in host.cgroup_tree(real_node.node.layout.cgroup_root) if p.name == f"pod{uid}"]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _states(pids: Iterable[int]) -> dict[int, str]:
    """The state of each of ``pids`` still there: a container's loop forks a `sleep` each
    second, which may end at any moment between a read of the PIDs and this one."""
    found = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found[pid] = _state(pid)
    return found


def test_node_pods_finds_each_containers_processes_and_signals_one_alone(real_node: RealNode,
                                                                         pod: dict[str, Any]) -> None:
    side, main = node_pods.container_pids(pod, "side"), node_pods.container_pids(pod, "main")
    assert side and main and not set(side) & set(main)
    everything = set(node_pods.pod_pids(pod))
    lasting = _live({*side, *main})  # alive now, so alive while ``everything`` was read
    assert lasting & set(side) and lasting & set(main)
    assert lasting < everything  # and the pause process
    assert node_pods.sandbox_pid(pod) in everything - set(side) - set(main)
    stopped = node_pods.signal_container(pod, "side", signal.SIGSTOP)
    try:
        assert set(stopped) >= _live(set(side))
        # A `sleep` that ended as the shell stopped stays a zombie until the shell runs again.
        assert set(_states(stopped).values()) - {"Z"} == {"T"}
        assert "T" not in _states(node_pods.container_pids(pod, "main")).values()
    finally:
        node_pods.signal_container(pod, "side", signal.SIGCONT)
    assert "T" not in _states(node_pods.container_pids(pod, "side")).values()
    assert node_pods.on_this_machine(pod)
    stranger = {**pod, "metadata": {**pod["metadata"], "uid": "00000000-0000-0000-0000-000000000000"}}
    assert not node_pods.on_this_machine(stranger)
    with pytest.raises(node_pods.NotOnThisNode):
        node_pods.container_pids(stranger, "main")


def test_node_pods_freezes_and_thaws_the_whole_pod(real_node: RealNode, pod: dict[str, Any]) -> None:
    # The main container's shell starts a `sleep 1` every second: frozen, it starts none. (Other
    # new processes may appear: the exec readiness probes join the frozen cgroups, and wait.)
    def seen() -> set[int]:
        found = set()
        for pid in node_pods.container_pids(pod, "main"):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                    found.add(pid)
        return found

    with node_pods.frozen_pod(pod):
        assert node_pods.freezer_state(pod) == "FROZEN"
        before = seen()
        time.sleep(2.5)
        assert seen() == before
    assert node_pods.freezer_state(pod) == "THAWED"
    _wait(lambda: bool(seen() - before), timeout=5, what="the thawed pod to run again")


@dataclass
class Connect:
    code: int
    took: float
    output: str


def _nc(real_node: RealNode, namespace: str, address: str, port: int, wait: int) -> Connect:
    """``nc`` from inside the pod: its exit status is 0 once connected, 1 when the connect
    failed; kubectl's own failures say so in the output (a ``[kubectl]`` line)."""
    started = time.monotonic()
    result = _exec(real_node, namespace, "sh", "-c",
                   f"nc -w {wait} {address} {port} </dev/null; echo \"[nc] exit $?\"")
    took = time.monotonic() - started
    marker = re.search(r"\[nc\] exit (\d+)", result.stdout)
    if marker is None:
        return Connect(-1, took, f"[kubectl] exit {result.returncode}: {result.stdout}{result.stderr}")
    return Connect(int(marker.group(1)), took, result.stdout + result.stderr)


def test_node_pods_partitions_the_pod_inside_its_network_namespace(real_node: RealNode, pod: dict[str, Any],
                                                                   node_namespace: str) -> None:
    main = node_pods.container_pids(pod, "main")[0]
    assert os.stat(node_pods.pod_netns(pod)).st_ino == os.stat(f"/proc/{main}/ns/net").st_ino
    assert os.stat(node_pods.pod_netns(pod)).st_ino != os.stat("/proc/self/ns/net").st_ino
    api = (real_node.node.layout.node_ip, real_node.node.control_plane.api_port)
    assert (first := _nc(real_node, node_namespace, *api, wait=5)).code == 0, first
    try:
        node_pods.partition(pod, api[0], mode="reject")
        node_pods.partition(pod, api[0], mode="reject")  # idempotent
        refused = _nc(real_node, node_namespace, *api, wait=5)
        assert refused.code == 1 and refused.took < 4, refused  # refused at once, not timed out
        node_pods.heal(pod, api[0])
        assert (healed := _nc(real_node, node_namespace, *api, wait=5)).code == 0, healed
        node_pods.partition(pod, api[0], mode="drop")
        lost = _nc(real_node, node_namespace, *api, wait=2)
        assert lost.code == 1 and lost.took >= 2, lost  # silently lost: the connect times out
        node_pods.heal(pod, api[0])
        # One port only: the API server's is cut, the kubelet's on the same address is not.
        node_pods.partition(pod, api[0], mode="reject", port=api[1])
        assert (cut := _nc(real_node, node_namespace, *api, wait=2)).code == 1, cut
        assert (other := _nc(real_node, node_namespace, api[0], real_node.node.kubelet_port, wait=5)).code == 0, other
        node_pods.heal(pod, api[0], port=api[1])
    finally:
        node_pods.heal(pod, api[0])
    assert (last := _nc(real_node, node_namespace, *api, wait=5)).code == 0, last
    rules = subprocess.run(node_pods.in_pod_netns(pod, "iptables-save"), capture_output=True, text=True, check=True)
    assert node_pods.PARTITION_COMMENT not in rules.stdout


def test_the_test_apps_image_runs_the_tests_workers(real_node: RealNode, test_apps_image: str,
                                                  node_namespace: str) -> None:
    """The test-only image has what ``tests/data/ledger_worker.py`` imports, from its own files,
    as the image's non-root user on a read-only root."""
    check = ("import asyncpg, singleton_sdk.asyncpg, singleton_testbed.actlog, os; "
             "print(singleton_testbed.actlog.__file__, os.path.isfile('/opt/singleton-tests/data/ledger_worker.py'), "
             "os.path.isfile('/opt/singleton-tests/data/acting_app.py'), os.getuid())")
    manifest = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "apps"},
        "spec": {"restartPolicy": "Never", **real_node.pod_placement(), "containers": [{
            "name": "apps", "image": test_apps_image, "imagePullPolicy": "Never", "command": ["python", "-c", check],
            "securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True}}]},
    }
    real_node.cluster.apply(json.dumps(manifest), namespace=node_namespace)
    real_node.cluster.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/apps", "-n", node_namespace,
                              "--timeout=90s")
    logs = real_node.cluster.kubectl("logs", "apps", "-n", node_namespace)
    assert logs.stdout.split() == ["/opt/singleton-tests/singleton_testbed/actlog.py", "True", "True", "10001"]


def test_container_main_pid_is_pid_1_of_the_container_not_an_exec(real_node: RealNode, pod: dict[str, Any],
                                                                  node_namespace: str) -> None:
    main = node_pods.container_main_pid(pod, "main")
    assert Path(f"/proc/{main}/cmdline").read_bytes().split(b"\0")[:2] == [b"sh", b"-c"]
    # An exec'd process lives in the same cgroup; it must not be taken for the main process.
    execed = subprocess.Popen(["kubectl", "exec", "sidecar-pod", "-n", node_namespace, "-c", "main", "--",
                               "sleep", "5"], env=real_node.cluster.env, stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: len(node_pods.container_pids(pod, "main")) > 2, timeout=10, what="the exec'd sleep")
        assert node_pods.container_main_pid(pod, "main") == main
    finally:
        execed.kill()
        execed.wait()


def test_kubelet_and_containerd_restarts_leave_running_containers_alone(real_node: RealNode,
                                                                        node_namespace: str) -> None:
    """Node-agent faults the campaign injects: the containers' processes and the pod's restart
    counts are unchanged by a kubelet restart and by a containerd restart, and the node still
    starts new pods and restarts a killed container (within the 1 s back-off cap) afterwards."""
    survivor = _create_pod(real_node, node_namespace, "survivor")
    pids = {name: node_pods.container_main_pid(survivor, name) for name in ("side", "main")}
    real_node.node.restart_kubelet()
    real_node.node.restart_containerd()
    assert all(node_pods.container_main_pid(survivor, name) == pid for name, pid in pids.items())
    _create_pod(real_node, node_namespace, "after-restarts")
    for _ in range(3):  # back-off would reach 40 s by the third restart without the cap
        node_pods.signal_container(survivor, "main", signal.SIGKILL)
        started = time.monotonic()
        _wait(functools.partial(_restarted, real_node, node_namespace, "survivor", survivor), timeout=20,
              what="the killed container to run again")
        survivor = json.loads(real_node.cluster.kubectl("get", "pod", "survivor", "-n", node_namespace,
                                                        "-o", "json").stdout)
        assert time.monotonic() - started < 10
    statuses = {s["name"]: s["restartCount"] for s in [*survivor["status"]["initContainerStatuses"],
                                                        *survivor["status"]["containerStatuses"]]}
    assert statuses == {"side": 0, "main": 3}


def _restarted(real_node: RealNode, namespace: str, name: str, before: dict[str, Any]) -> bool:
    """The pod's ``main`` container runs under a new container ID."""
    now = json.loads(real_node.cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
    old = {s["name"]: s.get("containerID") for s in before["status"]["containerStatuses"]}
    return any(s["name"] == "main" and s.get("containerID") not in (None, old["main"]) and "running" in s["state"]
               for s in now["status"]["containerStatuses"])


def test_deleting_the_pod_stops_its_containers(real_node: RealNode, node_namespace: str) -> None:
    doomed = _create_pod(real_node, node_namespace, "doomed")
    ids = _container_ids(doomed)
    assert len(ids) == 2
    assert set(ids) <= _running_tasks(real_node)
    assert _pod_cgroups(real_node, doomed["metadata"]["uid"])
    real_node.cluster.kubectl("delete", "pod", "doomed", "-n", node_namespace, "--timeout=60s")
    _wait(lambda: not set(ids) & _running_tasks(real_node), timeout=30, what="the containers' tasks to end")
    _wait(lambda: not _pod_cgroups(real_node, doomed["metadata"]["uid"]), timeout=30, what="the pod's cgroups")


def _live(pids: set[int]) -> set[int]:
    """Those of ``pids`` running or stopped now (not ended, not a zombie)."""
    return {pid for pid in pids if Path(f"/proc/{pid}").exists() and not host._zombie(pid)}


@dataclass(frozen=True)
class Leftovers:
    """What a running node has on the host, taken before it stops or is killed."""

    work: Path
    processes: set[int]
    containers: set[int]
    veths: list[str]
    state: dict[str, Any]


def _snapshot(layout: NodeLayout) -> Leftovers:
    """Everything the checks of ``_assert_nothing_left`` look for exists now, so each can fail."""
    state = json.loads((RUN_DIR / "state.json").read_text())
    work = Path(state["work"])
    processes = set(host.pids_mentioning(str(work)))
    shims = {pid for pid in processes if Path(f"/proc/{pid}/exe").resolve().name == "containerd-shim-runc-v2"}
    containers = host.cgroup_pids(layout.cgroup_root)
    veths = host.bridge_ports(layout.bridge)
    assert shims and containers and veths
    assert any("/netns/" in point for point in host.mounts_under([work]))
    assert "KUBE-SERVICES" in host.kube_chains().get("iptables/nat", [])
    assert host.cgroup_dirs(layout.cgroup_root)
    return Leftovers(work, processes, containers, veths, state)


def _assert_nothing_left(layout: NodeLayout, before: Leftovers) -> None:
    _wait(lambda: not _live(before.processes | before.containers), timeout=10, what="the node's processes to end")
    assert _live(before.processes | before.containers) == set()
    assert host.pids_mentioning(str(before.work)) == []
    assert host.mounts_under([before.work]) == []
    assert sorted(p.name for p in Path("/run/netns").glob("cni-*")) == []
    assert not host.link_exists(layout.bridge)
    assert [veth for veth in before.veths if host.link_exists(veth)] == []
    assert host.kube_chains() == {}
    assert host.cgroup_dirs(layout.cgroup_root) == []
    assert host.read_sysctls() == before.state["sysctls"]
    assert not before.work.exists()
    assert not (RUN_DIR / "state.json").exists()
    assert [folder for folder in before.state["created"] if Path(folder).exists()] == []


def test_stop_leaves_nothing_behind_and_the_node_starts_again(real_node: RealNode, pod: dict[str, Any]) -> None:
    node = real_node.node
    before = _snapshot(node.layout)
    node.stop()
    _assert_nothing_left(node.layout, before)
    # The session's other users (and the session's teardown) find the node running again.
    real_node.restart()
    assert node.ready()


_KILLED_NODE = """
import json, sys
from pathlib import Path
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.node import Node
binaries = {name: Path(path) for name, path in json.loads(sys.argv[1]).items()}
# The running control plane, described (not started) so the node can join it.
control_plane = ControlPlane(binaries, workdir=Path(sys.argv[2]), advertise_address=sys.argv[3])
control_plane.api_port = int(sys.argv[4])
node = Node(control_plane, binaries)
node.start()
node.import_image(Path(sys.argv[5]))
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_killed_run_is_cleaned_up_from_its_state_file(real_node: RealNode, node_namespace: str) -> None:
    """A process that runs a node is killed with SIGKILL (as pytest may be): its kubelet,
    kube-proxy and containerd die with it, but shims, containers, mounts, the bridge, the
    iptables chains and the cgroups stay; ``cleanup_stale`` (what ``start`` and
    ``singleton-testbed down`` call) removes them from the state file.

    Only one node may run per machine, so the session's node stops for the child's (which joins
    the same control plane under the same name) and starts again afterwards."""
    node, control_plane = real_node.node, real_node.node.control_plane
    node.stop()
    binaries = json.dumps({name: str(path) for name, path in node.binaries.items()})
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_NODE, binaries, str(control_plane.workdir), node.layout.node_ip,
         str(control_plane.api_port), str(real_node.archive)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        _create_pod(real_node, node_namespace, "orphan")
        before = _snapshot(node.layout)
    finally:
        child.kill()
        child.wait()
    assert host.pids_mentioning(str(before.work))  # the shims outlive their parent
    assert cleanup_stale() is True
    _assert_nothing_left(node.layout, before)
    real_node.cluster.kubectl("delete", "pod", "orphan", "-n", node_namespace, "--force", "--grace-period=0")
    real_node.restart()
    assert node.ready()
