"""Whole-node faults on two real nodes (issue 34): a node cut off, powered off, its kubelet
alone stopped, drained whole. The scenario is ``singleton_testbed.harness.node_faults``: one
group with a pod on each node, the leader moved to the second node before each fault.

For each fault: the group leads again from the first node, its status and its leader Service
follow, the second node comes back and its old leader's app never acts again, and no two apps
ever act at once (their own act file, which no fence hides: one token's acts all end before the
next token's begin). The faults run one after another on one group (one settle, one act file).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from singleton_testbed.controlplane import NODE_GRACE_PERIOD
from singleton_testbed.harness.node_faults import EVICT_AFTER, FAULTS, TwoNodeGroup, group_manifest
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster, RealNode
from tests.node.test_drain_node import operator  # noqa: F401 - the fixture
from tests.support.acting import assert_never_two_actors

pytestmark = [pytest.mark.k8s, pytest.mark.controlplane, pytest.mark.image]

GROUP = "spread"
NEW_LEADER_BOUND = {"cut-off": 10.0, "power-off": 10.0, "drain": 2.0,
                    "kubelet-stop": NODE_GRACE_PERIOD + EVICT_AFTER + 15.0}
"""Seconds from the fault to the new leader's app acting. Cut off or powered off: the lease's
term (2 s) and a retry. Drained: a handover on the gate's word. Kubelet stopped: the node
lifecycle controller's grace period, the pods' toleration of a NotReady node, the eviction,
then a handover."""


@pytest.fixture(scope="module")
def node_lifecycle(controllers: Cluster) -> Iterator[None]:
    """The node lifecycle controller, for this module only: the other tests on the session's
    control plane make Node objects with no kubelet, which it would mark and evict."""
    assert controllers.control_plane is not None
    controllers.control_plane.start_node_lifecycle()
    try:
        yield
    finally:
        controllers.control_plane.stop_node_lifecycle()


def test_the_group_leads_from_the_other_node_through_whole_node_faults(  # noqa: PLR0917
        controllers: Cluster, real_node: RealNode, second_node: RealNode, node_lifecycle: None,
        test_apps_image: str, operator: OperatorProcess, namespace: str,  # noqa: F811 - the fixture
        tmp_path: Path) -> None:
    acts = tmp_path / ("acts-" + secrets.token_hex(3))
    acts.mkdir()
    os.chmod(acts, 0o777)  # the app runs as the image's non-root user
    manifest = group_manifest(GROUP, test_apps_image, acts, [real_node.name, second_node.name],
                              [real_node.toleration, second_node.toleration])
    controllers.apply(json.dumps(manifest), namespace=namespace)
    group = TwoNodeGroup(controllers, namespace, GROUP, acts, first=real_node.node, second=second_node.node)

    runs = []
    for fault in FAULTS:
        run = group.run(fault)
        print(f"\n[{fault}] {run.old_pod} (token {run.old_token}) -> {run.new_pod} (token {run.new_token}): "
              f"new leader acting after {run.new_acting:.2f} s, status {run.status_followed:.2f} s, "
              f"Service {run.service_followed:.2f} s; old leader's last act {-run.overlap:.2f} s before")
        assert run.new_token > run.old_token
        assert run.overlap < 0, f"{fault}: the old leader acted {run.overlap:.3f} s after the new one began"
        assert run.new_acting < NEW_LEADER_BOUND[fault], f"{fault}: {run.new_acting:.1f} s to a new leader acting"
        # Within moments of the new leader, not at the node's NotReady (20 s): the operator takes
        # the leader label off the deposed pod, whose own sidecar could not (cut off, powered off).
        assert run.service_followed < run.new_acting + 5, f"{fault}: the leader Service followed late"
        runs.append(run)

    assert_never_two_actors(group.act_log, terms=len(FAULTS) + 1)
    # The second node is whole again: Ready, schedulable, no taint left by the faults.
    node = wait_for(lambda: (found := second_node.node.node_object()) and second_node.node.ready() and found, 60,
                    "the second node Ready", 0.5)
    assert not node["spec"].get("unschedulable")
    left = {t["key"] for t in node["spec"].get("taints") or []} - {second_node.toleration["key"]}
    assert not left, f"taints left on {second_node.name}: {left}"
