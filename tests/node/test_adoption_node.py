"""Adoption on the session's real node, as a user does it: our chart installed (operator and
webhook), a third party's chart installed unchanged (``tests/data/vendor-poller``: three
replicas of a poller that knows nothing of us), one ``SingletonService`` that adopts it.

Proved here: one rollout adopts it and then exactly one pod polls; deleting the leader's pod
hands over; ``helm upgrade`` of the vendor chart rolls out with exactly one handover; while the
operator is down new pods of the adopted workload are refused (``failurePolicy: Fail``) and
other pods are created as usual. The observer is the pollers' own log: every poll is a line
``<pod> <CLOCK_MONOTONIC>`` appended to one file on the node, which no fence filters.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import get_json, pod_ready, pod_role
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster, RealNode
from tests.integration.kube.test_chart import Release, helm, uninstalled_after, values_args
from tests.node.test_chart_node import install_on_node
from tests.support.paths import DATA

pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.image]

VENDOR_CHART = DATA / "vendor-poller"
VENDOR = "poller"
GAP = 0.5
"""Polls of one pod less than this apart are one acting interval (the poller polls every 0.05 s)."""


def polls(log: Path, since: float = 0.0) -> list[tuple[str, float]]:
    lines = log.read_text().splitlines() if log.exists() else []
    found = []
    for line in lines:
        pod, _, stamp = line.partition(" ")
        if stamp and float(stamp) >= since:
            found.append((pod, float(stamp)))
    return found


def acting_intervals(entries: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(pod, first, last) of each run of polls of one pod with no gap above ``GAP``."""
    by_pod: dict[str, list[float]] = {}
    for pod, stamp in entries:
        by_pod.setdefault(pod, []).append(stamp)
    intervals = []
    for pod, stamps in by_pod.items():
        stamps.sort()
        start = last = stamps[0]
        for stamp in stamps[1:]:
            if stamp - last > GAP:
                intervals.append((pod, start, last))
                start = stamp
            last = stamp
        intervals.append((pod, start, last))
    return sorted(intervals, key=lambda i: i[1])


def overlaps(entries: list[tuple[str, float]]) -> list[str]:
    intervals = acting_intervals(entries)
    found = []
    for index, (pod, start, end) in enumerate(intervals):
        for other, other_start, other_end in intervals[index + 1:]:
            if other != pod and other_start <= end and start <= other_end:
                found.append(f"{pod} [{start:.3f}, {end:.3f}] and {other} [{other_start:.3f}, {other_end:.3f}]")
    return found


def group_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l",
                                           "app.kubernetes.io/name=vendor-poller")["items"]
    return [p for p in found if not p["metadata"].get("deletionTimestamp")]


def has_sidecar(pod: dict[str, Any]) -> bool:
    return any(c["name"] == "singleton-sidecar" for c in pod["spec"].get("initContainers") or [])


def settled(cluster: Cluster, namespace: str, revision: str) -> dict[str, Any] | None:
    """The leader once three ready pods of ``revision`` (the chart's release value) have the
    sidecar, one leads, two stand by, and the group's status names the leader."""
    pods = group_pods(cluster, namespace)
    if len(pods) != 3 or not all(has_sidecar(p) and pod_ready(p) for p in pods):
        return None
    if any((p["metadata"].get("annotations") or {}).get("vendor.example.com/release") != revision for p in pods):
        return None
    if sorted(pod_role(p) or "" for p in pods) != ["leader", "standby", "standby"]:
        return None
    leader = next(p for p in pods if pod_role(p) == "leader")
    status = get_json(cluster, "sgl", VENDOR, "-n", namespace).get("status") or {}
    return leader if status.get("leader") == leader["metadata"]["name"] else None


@pytest.fixture
def operator_release(cluster: Cluster, namespace: str) -> Iterator[Release]:
    """Our chart in a namespace of its own: the webhook never sees the release's namespace."""
    own = f"{namespace}-op"
    cluster.kubectl("create", "namespace", own)
    try:
        with uninstalled_after(cluster, own) as rel:
            yield rel
    finally:
        cluster.kubectl("delete", "namespace", own, "--wait=false", check=False)


def test_a_vendor_chart_is_adopted_unchanged(cluster: Cluster, singleton_crd: Path,  # noqa: PLR0917
                                            real_node: RealNode, project_image: str, operator_release: Release,
                                            namespace: str, tmp_path: Path) -> None:
    release = operator_release
    install_on_node(release, real_node, project_image, namespace, tmp_path)
    repository, _, tag = project_image.rpartition(":")
    placement = real_node.pod_placement()

    poll_dir = tmp_path / "polls"
    poll_dir.mkdir()
    os.chmod(poll_dir, 0o777)  # the poller runs as the image's non-root user
    log = poll_dir / "polls.log"
    vendor_values = {"image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
                     "pollLog": str(poll_dir), **placement}
    vendor_args = values_args(vendor_values, tmp_path)
    helm("install", VENDOR, str(VENDOR_CHART), "-n", namespace, *vendor_args, "--wait", "--timeout", "120s",
         env=cluster.env)
    # Before adoption: three pods, no sidecar, all three poll at once (the problem).
    before = time.monotonic()
    wait_for(lambda: len({pod for pod, _ in polls(log, before)}) == 3, 30, "three pollers polling", 0.2)
    assert not any(has_sidecar(p) for p in group_pods(cluster, namespace))

    group = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": VENDOR},
             "spec": {"workloadRef": {"kind": "Deployment", "name": VENDOR}, "gating": {"mode": "file"},
                      "backend": "lease", "timings": {"leaseDuration": "4s", "renewDeadline": "3s",
                                                      "retryPeriod": "1s"},
                      "drain": {"timeout": "5s"}, "terminationGracePeriodSeconds": 10}}
    cluster.apply(json.dumps(group), namespace=namespace)
    leader = wait_for(lambda: settled(cluster, namespace, "1"), 180, "the adoption's rollout, one leader", 0.5)
    adopted = time.monotonic()
    transitions = get_json(cluster, "sgl", VENDOR, "-n", namespace)["status"]["transitions"]

    # One pod polls: the leader.
    time.sleep(3)
    pollers = {pod for pod, _ in polls(log, adopted)}
    assert pollers == {leader["metadata"]["name"]}, pollers

    # The leader's pod deleted: a standby takes over; never two pollers at once.
    cluster.kubectl("delete", "pod", leader["metadata"]["name"], "-n", namespace, "--wait=false")
    new_leader = wait_for(lambda: (found := settled(cluster, namespace, "1"))
                          and found["metadata"]["name"] != leader["metadata"]["name"] and found,
                          120, "a new leader and a replacement pod", 0.5)
    assert new_leader["metadata"]["name"] in {pod for pod, _ in polls(log, adopted)}
    assert overlaps(polls(log, adopted)) == []

    # helm upgrade of the vendor chart (a new release of the poller): one rollout, one handover.
    status = get_json(cluster, "sgl", VENDOR, "-n", namespace)["status"]
    transitions = status["transitions"]
    helm("upgrade", VENDOR, str(VENDOR_CHART), "-n", namespace, *vendor_args, "--set", "release=2",
         "--wait", "--timeout", "180s", env=cluster.env)
    wait_for(lambda: settled(cluster, namespace, "2"), 180, "the vendor upgrade's rollout, one leader", 0.5)
    status = get_json(cluster, "sgl", VENDOR, "-n", namespace)["status"]
    assert status["transitions"] == transitions + 1, status
    assert overlaps(polls(log, adopted)) == []
    labels = get_json(cluster, "deployment", VENDOR, "-n", namespace)["spec"]["template"]["metadata"]["labels"]
    assert labels[contract.LABEL_GROUP] == VENDOR  # helm's upgrade kept the operator's label

    # The operator down: a new pod of the adopted workload is refused, any other pod is not.
    cluster.kubectl("scale", "deployment", "-n", release.namespace, "-l", release.selector, "--replicas=0")
    wait_for(lambda: not get_json(cluster, "pods", "-n", release.namespace, "-l", release.selector)["items"], 60,
             "the operator's pods to go", 0.5)
    victim = next(p for p in group_pods(cluster, namespace) if pod_role(p) == "standby")
    cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", namespace, "--wait=true")

    def refused() -> str | None:
        events = get_json(cluster, "events", "-n", namespace, "--field-selector", "reason=FailedCreate")["items"]
        messages = [e["message"] for e in events if "webhook" in e["message"]]
        return messages[-1] if messages else None

    message = wait_for(refused, 60, "the ReplicaSet's FailedCreate from the webhook", 0.5)
    assert "pods.singleton.dev" in message, message
    assert len(group_pods(cluster, namespace)) == 2
    other = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unrelated", "labels": {"app": "x"}},
             "spec": {**placement, "containers": [{"name": "c", "image": project_image, "imagePullPolicy": "Never",
                                                   "command": ["sleep", "1"]}]}}
    cluster.apply(json.dumps(other), namespace=namespace)
    # Back up: the ReplicaSet's retry gets the sidecar, and the group is whole again.
    cluster.kubectl("scale", "deployment", "-n", release.namespace, "-l", release.selector, "--replicas=2")
    wait_for(lambda: settled(cluster, namespace, "2"), 180, "the group whole again", 0.5)
    assert overlaps(polls(log, adopted)) == []
    # Deleted while the operator runs: it gives the workload back, then kopf's finalizer goes.
    cluster.kubectl("delete", "sgl", VENDOR, "-n", namespace, "--wait=true", "--timeout=60s")
    helm("uninstall", VENDOR, "-n", namespace, "--wait", "--timeout", "60s", env=cluster.env, check=False)
