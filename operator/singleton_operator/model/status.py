"""A group's status, computed from what its pods say about themselves (pure; no I/O).

Each sidecar writes its role, token and leader-since on its own pod. The leader is the
pod that says ``leader`` (or ``draining``) with the greatest token: a pod whose sidecar
was killed may still say ``leader`` until it restarts, but its token is older.

Beside our own conditions (Available, LeaderElected, Progressing, Degraded), the status
carries the kstatus ones GitOps tools read (sigs.k8s.io/cli-utils/pkg/kstatus): ``Ready``
(normal-true: this generation applied, its rollout complete, a Ready leader),
``Reconciling`` and ``Stalled`` (abnormal-true: present with status True only while the
group is on its way, or stuck on something the user must fix). ``observedGeneration`` is
the newest generation whose objects were all applied, never one whose apply failed.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from singleton_election import contract
from singleton_operator.model.resources import selector_labels
from singleton_operator.model.spec import SIDECAR_CONTAINER, GroupSpec

CONDITION_TYPES = ("Ready", "Reconciling", "Stalled", "Available", "LeaderElected", "Progressing", "Degraded",
                   "WorkloadSuitable", "DatabaseReachable")
DATABASE_REACHABLE = "DatabaseReachable"
"""Groups with a database only: whether the operator's own connection with the group's DSN
succeeded (``spec.postgres.connectionCheck``; Unknown when it is skipped)."""


@dataclass(frozen=True)
class DatabaseCheck:
    """The outcome of the operator's check of a group's database: ``reachable`` None when it
    was not tried (``CheckSkipped``); ``reason`` is a CamelCase word for the condition."""

    reachable: bool | None
    reason: str
    message: str


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
    applied_generation: int | None = None
    """The newest generation whose objects were all applied; None while unknown (an operator
    that just started has not applied anything yet: the status keeps what it said)."""
    database: DatabaseCheck | None = None
    """The last database check of this object; None while unknown (the status keeps what it said)."""


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _annotations(pod: dict[str, Any]) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _has_sidecar(pod: dict[str, Any]) -> bool:
    return any(c.get("name") == SIDECAR_CONTAINER for c in (pod.get("spec") or {}).get("initContainers") or [])


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


@dataclass(frozen=True)
class DeposedLeader:
    pod: str
    resource_version: str
    token: int | None


def deposed_leaders(pods: list[dict[str, Any]]) -> list[DeposedLeader]:
    """Pods whose role label still says they lead while another pod leads with a greater token:
    their term is over (tokens only grow, and a new one is issued once the old term ended), but
    their sidecar could not say so, cut off from the API server with its node. The label is
    what the leader Service selects, so such a pod would get the leader's traffic beside the
    leader until its node is marked NotReady."""
    leader = find_leader(pods)
    if leader is None:
        return []
    deposed = []
    # A pod being deleted is no endpoint of the Service any more, and its sidecar holds its own
    # writes back while it hands over (podstatus.HANDOVER_FIRST): left to it.
    for pod in live_pods(pods):
        metadata = pod.get("metadata") or {}
        if metadata.get("name") == leader.pod or (metadata.get("labels") or {}).get(contract.LABEL_ROLE) \
                not in (contract.ROLE_LEADER, contract.ROLE_DRAINING):
            continue
        try:
            token: int | None = int(_annotations(pod).get(contract.ANNOTATION_TOKEN, ""))
        except ValueError:
            token = None  # never said which term: not the leader's, whose token is known
        if token is None or token < leader.token:
            version = str(metadata.get("resourceVersion", ""))
            deposed.append(DeposedLeader(pod=metadata["name"], resource_version=version, token=token))
    return deposed


def labelled_leaders(pods: list[dict[str, Any]]) -> int:
    """The pods whose role label says they lead (leader or draining, as the sidecar's
    ``singleton_is_leader``), terminating ones included: a draining pod is often being deleted
    and holds the lock until it releases it. 0 is "no leader" (``singleton_group_leaders``)."""
    return sum(1 for pod in pods
               if ((pod.get("metadata") or {}).get("labels") or {}).get(contract.LABEL_ROLE)
               in (contract.ROLE_LEADER, contract.ROLE_DRAINING)
               and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def _condition(kind: str, ok: bool | None, reason: str, message: str, generation: int, *,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else "True" if ok else "False"
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


def _stalled_rollout(deployment: dict[str, Any] | None) -> str | None:
    """The Deployment controller's own verdict that the rollout stopped progressing."""
    if deployment is None:
        return None
    status = deployment.get("status") or {}
    if status.get("observedGeneration", 0) < (deployment.get("metadata") or {}).get("generation", 0):
        return None
    for condition in status.get("conditions") or []:
        if (condition.get("type") == "Progressing" and condition.get("status") == "False"
                and condition.get("reason") == "ProgressDeadlineExceeded"):
            return f"the Deployment's rollout stopped progressing: {condition.get('message', '')}"
    return None


def gitops_conditions(spec: GroupSpec, observed: Observed, *, applied: bool, in_rollout: bool,
                      rollout_message: str, leader: LeaderView | None,
                      ready_pods: list[dict[str, Any]]) -> list[tuple[str, bool, str, str]]:
    """(type, true, reason, message) of Ready, Reconciling and Stalled, in that order."""
    stalled_reason, stalled_message = "AsExpected", "no problem found"
    if observed.problem is not None:
        stalled_reason, stalled_message = observed.problem_reason, observed.problem
    elif applied and (deadline := _stalled_rollout(observed.deployment)) is not None:
        stalled_reason, stalled_message = "ProgressDeadlineExceeded", deadline
    stalled = stalled_reason != "AsExpected"
    leader_ready = leader is not None and any(p["metadata"]["name"] == leader.pod for p in ready_pods)
    if stalled:
        why, message = stalled_reason, stalled_message
    elif not applied:
        why, message = "Applying", f"generation {spec.generation} is not applied yet"
    elif in_rollout:
        why, message = "RollingOut", rollout_message
    elif leader is None:
        why, message = "NoLeader", "no replica leads"
    elif not leader_ready:
        why, message = "LeaderNotReady", f"pod {leader.pod} leads but is not Ready"
    else:
        why, message = "Ready", f"generation {spec.generation} applied and rolled out; pod {leader.pod} leads"
    ready = why == "Ready"
    reconciling = not ready and not stalled
    return [
        ("Ready", ready, why, message),
        ("Reconciling", reconciling, why if reconciling else ("Stalled" if stalled else "Ready"),
         message if reconciling else ("see Stalled" if stalled else "nothing left to do")),
        ("Stalled", stalled, stalled_reason, stalled_message),
    ]


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
    # Stamped only from a successful apply: a generation whose apply failed leaves the older one.
    observed_generation = (observed.applied_generation if observed.applied_generation is not None
                           else previous.get("observedGeneration"))
    gitops = gitops_conditions(spec, observed, applied=observed_generation == spec.generation,
                               in_rollout=in_rollout, rollout_message=rollout_message, leader=leader,
                               ready_pods=ready)

    # Only adopted pods can lack it: a template group's pods come from a template that has it.
    unguarded = [p["metadata"]["name"] for p in pods if spec.workload_ref is not None and not _has_sidecar(p)]
    if observed.problem is not None:
        phase, degraded, degraded_reason, degraded_message = "Failed", True, observed.problem_reason, observed.problem
    elif unguarded:
        # Pods with the group label but no sidecar (an adopted workload's pods the webhook did
        # not see): they act unguarded beside the leader.
        phase, degraded, degraded_reason = "Degraded", True, "PodsWithoutSidecar"
        degraded_message = (f"{len(unguarded)} pod(s) with the group label run without the sidecar, unguarded: "
                            f"{', '.join(sorted(unguarded)[:5])}; see docs/adoption.md")
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
        *(_condition(kind, ok, reason, message, spec.generation, previous=old_conditions, now=stamp)
          for kind, ok, reason, message in gitops),
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
    if spec.workload_ref is not None and observed.deployment is not None:
        suitable, reason, message = workload_suitability(spec, observed.deployment)
        conditions.append(_condition(WORKLOAD_SUITABLE, suitable, reason, message, spec.generation,
                                     previous=old_conditions, now=stamp))
    if spec.uses_postgres and observed.database is not None:
        check = observed.database
        conditions.append(_condition(DATABASE_REACHABLE, check.reachable, check.reason, check.message,
                                     spec.generation, previous=old_conditions, now=stamp))
    elif spec.uses_postgres and DATABASE_REACHABLE in old_conditions:
        # Not checked by this process yet (it just started): kept until its first check.
        conditions.append(old_conditions[DATABASE_REACHABLE])
    return {
        "leader": leader.pod if leader else None,
        "leaderIdentity": leader.identity if leader else None,
        "token": leader.token if leader else previous.get("token"),
        "leaderSince": leader.since if leader else None,
        "transitions": transitions,
        "replicas": len(pods),
        "selector": ",".join(f"{k}={v}" for k, v in sorted(selector_labels(spec).items())),
        "readyReplicas": len(ready),
        "readyStandbys": len(standbys),
        "phase": phase,
        "message": degraded_message if degraded else (f"{leader.pod} leads" if leader else ""),
        "observedGeneration": observed_generation,
        "conditions": conditions,
    }


WORKLOAD_SUITABLE = "WorkloadSuitable"
"""Adopted groups only: whether the workload's own settings keep rollouts to one handover
with a standby ready (docs/adoption.md, "Rollouts of an adopted workload")."""


def workload_suitability(spec: GroupSpec, workload: dict[str, Any]) -> tuple[bool, str, str]:
    """(suitable, reason, message) for an adopted workload's replicas and update strategy."""
    assert spec.workload_ref is not None
    settings = workload.get("spec") or {}
    replicas = int(settings.get("replicas", 1))
    where = spec.workload_ref.describe(spec.namespace)
    if replicas < 2:
        return False, "NoStandby", (f"{where} runs {replicas} replica: no standby, so every rollout and every "
                                    "lost pod leaves the group without a leader until a new pod starts; run 2 or more")
    if spec.workload_ref.kind == "StatefulSet":
        strategy = (settings.get("updateStrategy") or {}).get("type", "RollingUpdate")
        if strategy != "OnDelete":
            return False, "OrderedRollout", (
                f"{where} uses updateStrategy {strategy}: its pods are replaced from the highest ordinal down, so "
                "a rollout hands over twice when the leader is not the highest; use OnDelete and delete the "
                "leader's pod last (singletonctl status shows it) for one handover")
    return True, "AsExpected", f"{where}: {replicas} replicas, rollouts hand over at most once"


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` says something ``old`` does not (``None`` in ``new`` means absent)."""
    return {k: v for k, v in old.items() if v is not None} != {k: v for k, v in new.items() if v is not None}


def spec_error_status(generation: int, reason: str, message: str, previous: dict[str, Any],
                      now: dt.datetime | None = None) -> dict[str, Any]:
    """The status of a group whose spec the operator cannot read (an older CRD let it through):
    Stalled with that reason, the rest of the status as it was (observedGeneration included:
    nothing of this generation was applied)."""
    stamp = (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds").replace("+00:00", "Z")
    old_conditions = {c["type"]: c for c in previous.get("conditions") or []}
    updates = {kind: _condition(kind, ok, why, text, generation, previous=old_conditions, now=stamp)
               for kind, ok, why, text in (("Ready", False, reason, message),
                                           ("Reconciling", False, "Stalled", "see Stalled"),
                                           ("Stalled", True, reason, message),
                                           ("Degraded", True, reason, message))}
    conditions = [updates.get(kind) or old_conditions[kind] for kind in CONDITION_TYPES
                  if kind in updates or kind in old_conditions]
    return {**previous, "phase": "Failed", "message": message, "conditions": conditions}
