"""The sidecar's place among native sidecars on the session's real node (issue 34, meshes).

Two native sidecars stand in for a mesh's: ``mesh-proxy`` closes the pod's network (it removes
the default route, which every connection to the API server's Service address takes) until
it is Ready, as a proxy whose iptables rules send everything to a port nobody serves yet would;
``log-agent`` is a second one with no probe. Then comes ``migrate``, an ordinary init container.
The operator places the sidecar by ``spec.sidecar.startOrder``:

- ``AfterSidecars`` (the default): after both native sidecars, before ``migrate``. The kubelet
  starts the sidecar only once ``mesh-proxy``'s startup probe passed, so the sidecar never meets
  the closed network, and ``migrate`` runs after it started.
- ``First`` (the place before the field existed): the sidecar starts ahead of the proxy and
  meets the closed network (its renewals fail), which shows that the stand-in really closes it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import get_json, pod_role
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster, RealNode
from tests.node.test_drain_node import operator  # noqa: F401 - the fixture

pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.image]

SIDECAR = "singleton-sidecar"
CLOSED_SECONDS = 4
PROXY_SCRIPT = f"""
gateway=$(ip route | awk '/^default/ {{print $3}}')
ip route del default
sleep {CLOSED_SECONDS}
ip route add default via "$gateway"
touch /mesh/ready
trap 'exit 0' TERM
while true; do sleep 1; done
"""
FAILED_RENEWAL = "renewal failed"
"""The sidecar's warning when a renewal gets no answer: with ``TIMINGS`` every renewal while the
network is closed fails."""
TIMINGS = {"leaseDuration": "3s", "renewDeadline": "2s", "retryPeriod": "500ms"}


def group_manifest(name: str, real_node: RealNode, start_order: str | None) -> str:
    busybox = {"image": real_node.image, "imagePullPolicy": "Never"}
    mounts = [{"name": "mesh", "mountPath": "/mesh"}]
    init_containers = [
        {"name": "mesh-proxy", **busybox, "restartPolicy": "Always", "command": ["sh", "-c", PROXY_SCRIPT],
         "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}, "volumeMounts": mounts,
         "startupProbe": {"exec": {"command": ["test", "-f", "/mesh/ready"]}, "periodSeconds": 1,
                          "failureThreshold": 60}},
        {"name": "log-agent", **busybox, "restartPolicy": "Always",
         "command": ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]},
        {"name": "migrate", **busybox, "command": ["true"]},
    ]
    app = {"name": "app", **busybox, "command": ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]}
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"replicas": 1, "backend": "lease", "timings": TIMINGS, "terminationGracePeriodSeconds": 10,
                     "drain": {"timeout": "5s"},
                     **({"sidecar": {"startOrder": start_order}} if start_order else {}),
                     "template": {"spec": {**real_node.pod_placement(), "initContainers": init_containers,
                                           "containers": [app], "volumes": [{"name": "mesh", "emptyDir": {}}]}}}}
    return json.dumps(body)


def started_at(pod: dict[str, Any], name: str) -> dt.datetime | None:
    """When init container ``name`` of the pod started, as the kubelet reports it (None: not yet)."""
    status = next((s for s in pod["status"].get("initContainerStatuses") or [] if s["name"] == name), None)
    state = (status or {}).get("state") or {}
    started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
    return dt.datetime.fromisoformat(started) if started else None


def leading_pod(cluster: Cluster, namespace: str, group: str) -> dict[str, Any] | None:
    """The group's pod once it leads and the kubelet reports every init container started."""
    pods = get_json(cluster, "pods", "-n", namespace, "-l", f"{contract.LABEL_GROUP}={group}")["items"]
    return next((p for p in pods if pod_role(p) == "leader" and all(
        started_at(p, name) for name in ("mesh-proxy", "log-agent", SIDECAR, "migrate"))), None)


def seconds_between(pod: dict[str, Any], first: str, then: str) -> float:
    began, later = started_at(pod, first), started_at(pod, then)
    assert began is not None and later is not None
    return (later - began).total_seconds()


def test_the_sidecar_starts_behind_a_mesh_proxy_that_closes_the_network_until_it_is_ready(
        controllers: Cluster, real_node: RealNode, operator: OperatorProcess,  # noqa: F811 - the fixture
        namespace: str) -> None:
    cluster = controllers
    cluster.apply(group_manifest("meshed", real_node, None), namespace=namespace)
    cluster.apply(group_manifest("first", real_node, "First"), namespace=namespace)
    meshed = wait_for(lambda: leading_pod(cluster, namespace, "meshed"), 120, "the meshed group to lead", 0.5)
    first = wait_for(lambda: leading_pod(cluster, namespace, "first"), 120, "the First group to lead", 0.5)

    template = get_json(cluster, "deployment", "meshed", "-n", namespace)["spec"]["template"]["spec"]
    assert [c["name"] for c in template["initContainers"]] == ["mesh-proxy", "log-agent", SIDECAR, "migrate"]
    assert [c["name"] for c in first["spec"]["initContainers"]] == [SIDECAR, "mesh-proxy", "log-agent", "migrate"]

    # The kubelet started the sidecar once the proxy's startup probe passed (times in whole
    # seconds: at least CLOSED_SECONDS - 1 apart); the ordinary init container comes after it
    # in the order above, which the kubelet follows.
    assert seconds_between(meshed, "mesh-proxy", SIDECAR) >= CLOSED_SECONDS - 1
    meshed_log = cluster.kubectl("logs", "-n", namespace, meshed["metadata"]["name"], "-c", SIDECAR).stdout
    assert FAILED_RENEWAL not in meshed_log, meshed_log[-4000:]

    # Ahead of the proxy, the sidecar met the closed network: the stand-in does close it.
    first_log = ""

    def first_met_the_closed_network() -> bool:
        nonlocal first_log
        first_log = cluster.kubectl("logs", "-n", namespace, first["metadata"]["name"], "-c", SIDECAR).stdout
        return FAILED_RENEWAL in first_log

    try:
        wait_for(first_met_the_closed_network, 30, f"{FAILED_RENEWAL!r} in the First group's sidecar log", 0.5)
    except AssertionError as error:
        raise AssertionError(f"{error}; its log:\n{first_log[-6000:]}") from None
