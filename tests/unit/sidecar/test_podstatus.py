"""What the sidecar shows on its pod: the annotation patch and which role changes are Events (pure)."""

from __future__ import annotations

import pytest

from singleton_election import contract
from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.podstatus import pod_metadata_patch, transition_event

L, D, S, R = Role.LEADER, Role.DRAINING, Role.STANDBY, Role.RELEASED


@pytest.mark.parametrize(
    ("previous", "new", "reason"),
    [
        (None, S, None), (S, S, None), (S, R, None), (None, R, None),
        (None, L, "LeaderElected"), (S, L, "LeaderElected"), (L, L, None),
        (L, D, "LeaderDraining"), (D, R, "LeadershipReleased"), (L, R, "LeadershipReleased"),
        (L, S, "LeadershipLost"), (D, S, "LeadershipLost"), (D, D, None),
    ],
)
def test_only_leadership_changes_are_events(previous: Role | None, new: Role, reason: str | None) -> None:
    assert transition_event(previous, new) == reason


def status(role: Role, token: int | None) -> ElectionStatus:
    identity, typed = Identity("pod/uid/n"), None if token is None else Token(token)
    term = None if typed is None else Term(identity=identity, token=typed, version="1", written_at=0.0)
    return ElectionStatus(group="g", identity=identity, role=role, term=term, leader=identity,
                          leader_token=typed, leader_since=1_700_000_000.0 if role is Role.LEADER else None,
                          transitions=0, reason="r")


def test_a_standby_patch_removes_the_leaders_token_and_since() -> None:
    annotations = pod_metadata_patch(status(Role.STANDBY, None))["metadata"]["annotations"]
    assert annotations[contract.ANNOTATION_TOKEN] is None  # merge patch: null deletes a stale value
    assert annotations[contract.ANNOTATION_LEADER_SINCE] is None
    assert annotations[contract.ANNOTATION_ROLE] == "standby"


def test_a_leader_patch_shows_token_since_and_role_label() -> None:
    patch = pod_metadata_patch(status(Role.LEADER, 42))["metadata"]
    assert patch["annotations"][contract.ANNOTATION_TOKEN] == "42"
    assert patch["annotations"][contract.ANNOTATION_LEADER_SINCE] == "2023-11-14T22:13:20.000Z"
    assert patch["labels"] == {contract.LABEL_ROLE: "leader", contract.LABEL_GROUP: "g"}
