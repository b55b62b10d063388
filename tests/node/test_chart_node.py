"""The chart as a user gets it, on the session's real node: ``helm install`` of
``charts/singleton`` with the project's image (built from the Dockerfile), the operator's pods
running under the chart's security context, a group it makes electing a leader through the
chart's RBAC and admission policy, ``helm upgrade`` to a new image tag rolling the group out
with exactly one handover, and ``helm uninstall``.

The test bed's CNI (the bridge plugin) has no policy engine: the chart's NetworkPolicy is
created (``test_chart.py`` checks it) but not enforced here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import get_json, pod_ready, pod_role
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster, RealNode
from tests.integration.kube.test_chart import CHART, Release, release, values_args

__all__ = ["release"]  # the fixture, used below

pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.image]

NEXT_TAG = "0.1.0-next"
"""The tag ``helm upgrade`` moves to: the same image under a new name, as a new release would be."""
GROUP = "chart-poller"


def _pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in found if not p["metadata"].get("deletionTimestamp")]


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = next(c for c in pod["spec"]["initContainers"] if c["name"] == "singleton-sidecar")
    return container


def _settled_leader(cluster: Cluster, namespace: str, image: str) -> dict[str, Any] | None:
    """The leader once both pods run ``image`` in their sidecar, are ready, one leads, the
    other stands by, and the status agrees."""
    pods = _pods(cluster, namespace, f"{contract.LABEL_GROUP}={GROUP}")
    if len(pods) != 2 or not all(pod_ready(p) and _sidecar(p)["image"] == image for p in pods):
        return None
    if sorted(pod_role(p) or "" for p in pods) != ["leader", "standby"]:
        return None
    leader = next(p for p in pods if pod_role(p) == "leader")
    status = get_json(cluster, "sgl", GROUP, "-n", namespace).get("status") or {}
    return leader if status.get("leader") == leader["metadata"]["name"] else None


def install_on_node(release: Release, real_node: RealNode, project_image: str, groups_namespace: str,
                    tmp_path: Path) -> None:
    """``helm install`` of the chart with the project's image, its pods on the real node, for
    groups in ``groups_namespace`` (the admission policy scoped to it)."""
    repository, _, tag = project_image.rpartition(":")
    values = {"image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
              "watchNamespaces": [groups_namespace], **real_node.pod_placement(),
              "admissionPolicy": {"namespaceSelector": {"matchLabels": {
                  "kubernetes.io/metadata.name": groups_namespace}}}}
    release.helm("install", release.name, str(CHART), *values_args(values, tmp_path), "--wait", "--timeout", "180s")


def _exec(cluster: Cluster, namespace: str, pod: str, container: str, script: str) -> tuple[int, str]:
    result = cluster.kubectl("exec", "-n", namespace, pod, "-c", container, "--", "sh", "-c", script, check=False)
    return result.returncode, (result.stdout + result.stderr).strip()


def test_install_run_upgrade_with_one_handover_and_uninstall(cluster: Cluster, singleton_crd: Path,  # noqa: PLR0917
                                                             real_node: RealNode, project_image: str,
                                                             release: Release, namespace: str,
                                                             tmp_path: Path) -> None:
    install_on_node(release, real_node, project_image, namespace, tmp_path)
    repository = project_image.rpartition(":")[0]
    placement = real_node.pod_placement()

    # The operator's pods run as the chart says: as the image's non-root user, on a read-only root.
    operators = _pods(cluster, namespace, release.selector)
    assert len(operators) == 2 and all(pod_ready(p) for p in operators), operators
    name = operators[0]["metadata"]["name"]
    assert _exec(cluster, namespace, name, "operator", "id -u") == (0, "10001")
    code, out = _exec(cluster, namespace, name, "operator", "touch /opt/x")
    assert code != 0 and "Read-only file system" in out, out

    # A group the operator makes runs on the node and elects through the chart's RBAC; its
    # sidecars' pod patches pass the chart's admission policy (the roles are annotations).
    group = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": GROUP},
             "spec": {"replicas": 2, "backend": "lease",
                      "timings": {"leaseDuration": "4s", "renewDeadline": "3s", "retryPeriod": "1s"},
                      "drain": {"timeout": "5s"}, "terminationGracePeriodSeconds": 10,
                      "template": {"spec": {**placement, "containers": [
                          {"name": "app", "image": real_node.image, "imagePullPolicy": "Never",
                           "command": ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]}]}}}}
    cluster.apply(json.dumps(group), namespace=namespace)
    leader = wait_for(lambda: _settled_leader(cluster, namespace, project_image), 120,
                      "two ready pods, one leader, the status agreeing", 0.5)
    sidecar = _sidecar(leader)
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert sidecar["resources"]["limits"]["memory"] == "128Mi"
    assert _exec(cluster, namespace, leader["metadata"]["name"], "singleton-sidecar", "id -u") == (0, "10001")
    transitions = get_json(cluster, "sgl", GROUP, "-n", namespace)["status"]["transitions"]

    # A new release of the image: the operator rolls out, then rolls the group out to the new
    # sidecar image with exactly one handover.
    real_node.node.tag_image(project_image, f"{repository}:{NEXT_TAG}")
    leaders_seen = [leader["metadata"]["name"]]

    def upgraded() -> dict[str, Any] | None:
        for pod in _pods(cluster, namespace, f"{contract.LABEL_GROUP}={GROUP}"):
            if pod_role(pod) == "leader" and pod["metadata"]["name"] != leaders_seen[-1]:
                leaders_seen.append(pod["metadata"]["name"])
        return _settled_leader(cluster, namespace, f"{repository}:{NEXT_TAG}")

    started = time.monotonic()
    release.helm("upgrade", release.name, str(CHART), "--reuse-values", "--set", f"image.tag={NEXT_TAG}",
                 "--wait", "--timeout", "180s")
    new_leader = wait_for(upgraded, 180, "the group to roll out to the new sidecar image", 0.2)
    if new_leader["metadata"]["name"] != leaders_seen[-1]:
        leaders_seen.append(new_leader["metadata"]["name"])
    assert len(leaders_seen) == 2, f"leaders during the upgrade: {leaders_seen}"
    assert get_json(cluster, "sgl", GROUP, "-n", namespace)["status"]["transitions"] == transitions + 1
    print(f"[chart] upgrade to {NEXT_TAG}: group rolled out in {time.monotonic() - started:.1f} s, one handover")

    # Uninstall removes the operator; the group runs on without it (its sidecars elect).
    release.helm("uninstall", release.name, "--wait", "--timeout", "120s")
    wait_for(lambda: not _pods(cluster, namespace, release.selector), 60, "the operator's pods to go", 0.5)
    pods = _pods(cluster, namespace, f"{contract.LABEL_GROUP}={GROUP}")
    assert [pod_role(p) for p in pods if p["metadata"]["name"] == new_leader["metadata"]["name"]] == ["leader"]
    cluster.kubectl("delete", "sgl", GROUP, "-n", namespace, "--wait=false")

