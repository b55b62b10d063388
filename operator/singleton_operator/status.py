"""A group's status, computed from what its pods say about themselves (pure; no I/O).

Each sidecar writes its role, token and leader-since on its own pod. The leader is the
pod that says ``leader`` (or ``draining``) with the greatest token: a pod whose sidecar
was killed may still say ``leader`` until it restarts, but its token is older.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from singleton_operator.spec import GroupSpec
from singleton_sidecar import contract

CONDITION_TYPES = ("Available", "LeaderElected", "Progressing", "Degraded")


@dataclass(frozen=True)
class LeaderView:
    pod: str
    identity: str | None
    token: int
    since: str | None


@dataclass(frozen=True)
class Observed:
    """What the operator saw of one group at one moment."""

    pods: list[dict[str, Any]]
    deployment: dict[str, Any] | None
    problem: str | None = None
    """A configuration or access problem found while reconciling (missing Secret, RBAC...)."""
    problem_reason: str = "ReconcileFailed"


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _annotations(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def live_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]


def find_leader(pods: list[dict[str, Any]]) -> LeaderView | None:
    best: LeaderView | None = None
    for pod in pods:
        annotations = _annotations(pod)
        if annotations.get(contract.ANNOTATION_ROLE) not in (contract.ROLE_LEADER, contract.ROLE_DRAINING):
            continue
        try:
            token = int(annotations.get(contract.ANNOTATION_TOKEN, ""))
        except ValueError:
            continue
        if best is None or token > best.token:
            best = LeaderView(pod=pod["metadata"]["name"], identity=annotations.get(contract.ANNOTATION_IDENTITY),
                              token=token, since=annotations.get(contract.ANNOTATION_LEADER_SINCE))
    return best


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int, *,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(kind)
    changed = old is None or old.get("status") != status
    return {"type": kind, "status": status, "reason": reason, "message": message[:1000],
            "observedGeneration": generation,
            "lastTransitionTime": now if changed or old is None else old.get("lastTransitionTime", now)}


def _rollout(spec: GroupSpec, deployment: dict[str, Any] | None) -> tuple[bool, str]:
    """(in progress, message) from the Deployment's own status."""
    if deployment is None:
        return True, "creating the workload"
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation", 0)
    if status.get("observedGeneration", 0) < generation:
        return True, "the Deployment controller has not seen the newest spec yet"
    updated, total = status.get("updatedReplicas", 0), status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    if updated < spec.replicas or total > spec.replicas or available < spec.replicas:
        return True, f"rolling out: {updated}/{spec.replicas} updated, {available} available, {total} in total"
    return False, f"all {spec.replicas} replicas updated and available"


def compute_status(spec: GroupSpec, observed: Observed, previous: dict[str, Any],
                   now: dt.datetime | None = None) -> dict[str, Any]:
    """The new ``.status``; ``previous`` is the current one (for transitions and times)."""
    stamp = (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds").replace("+00:00", "Z")
    pods = live_pods(observed.pods)
    leader = find_leader(observed.pods)
    ready = [p for p in pods if _ready(p)]
    standbys = [p for p in ready if _annotations(p).get(contract.ANNOTATION_ROLE) == contract.ROLE_STANDBY]
    transitions = int(previous.get("transitions", 0))
    was = previous.get("leader")
    if leader is not None and leader.pod != was and (was is not None or previous.get("token") is not None):
        transitions += 1
    in_rollout, rollout_message = _rollout(spec, observed.deployment)
    wanted_standbys = spec.replicas - 1
    old_conditions = {c["type"]: c for c in previous.get("conditions") or []}

    if observed.problem is not None:
        phase, degraded, degraded_reason, degraded_message = "Failed", True, observed.problem_reason, observed.problem
    elif leader is None:
        phase = "Pending" if not ready else "Electing"
        degraded, degraded_reason = bool(pods), "NoLeader"
        degraded_message = "no replica leads" if pods else "no pods yet"
    elif len(standbys) < wanted_standbys:
        phase, degraded, degraded_reason = "Degraded", True, "StandbysMissing"
        degraded_message = f"{len(standbys)} of {wanted_standbys} standbys ready"
    else:
        phase, degraded, degraded_reason, degraded_message = "Running", False, "AsExpected", "all replicas healthy"
    conditions = [
        _condition("Available", leader is not None and observed.problem is None,
                   "LeaderReady" if leader is not None else "NoLeader",
                   f"pod {leader.pod} leads with token {leader.token}" if leader else "no replica leads",
                   spec.generation, previous=old_conditions, now=stamp),
        _condition("LeaderElected", leader is not None, "Elected" if leader else "NoLeader",
                   f"{leader.pod} since {leader.since}" if leader else "waiting for an election",
                   spec.generation, previous=old_conditions, now=stamp),
        _condition("Progressing", in_rollout, "RollingOut" if in_rollout else "Complete", rollout_message,
                   spec.generation, previous=old_conditions, now=stamp),
        _condition("Degraded", degraded, degraded_reason, degraded_message, spec.generation,
                   previous=old_conditions, now=stamp),
    ]
    return {
        "leader": leader.pod if leader else None,
        "leaderIdentity": leader.identity if leader else None,
        "token": leader.token if leader else previous.get("token"),
        "leaderSince": leader.since if leader else None,
        "transitions": transitions,
        "replicas": len(pods),
        "readyReplicas": len(ready),
        "readyStandbys": len(standbys),
        "phase": phase,
        "message": degraded_message if degraded else (f"{leader.pod} leads" if leader else ""),
        "observedGeneration": spec.generation,
        "conditions": conditions,
    }


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` says something ``old`` does not (``None`` in ``new`` means absent)."""
    return {k: v for k, v in old.items() if v is not None} != {k: v for k, v in new.items() if v is not None}
