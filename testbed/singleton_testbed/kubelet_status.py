"""Container records and the pod status the stand-in kubelet reports from them.

Called by ``kubelet_pods``, which owns the records and mutates them as processes start and
exit; the functions here only read them (no I/O), so the status rules (phase, conditions,
container states) can be read in one place. Conditions owned by others (readiness gates,
``DisruptionTarget``…) are never produced here, so the strategic-merge patch leaves them be.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from singleton_testbed.kubelet_runtime import ProcessHandle

Obj = dict[str, Any]
Kind = Literal["init", "sidecar", "regular"]
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


@dataclass(frozen=True)
class Waiting:
    reason: str
    message: str = ""

    def to_api(self) -> Obj:
        return {"waiting": {"reason": self.reason, **({"message": self.message} if self.message else {})}}


@dataclass(frozen=True)
class Running:
    started_at: str

    def to_api(self) -> Obj:
        return {"running": {"startedAt": self.started_at}}


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    container_id: str = ""
    signal: int | None = None
    message: str = ""

    def to_api(self) -> Obj:
        body: Obj = {"exitCode": self.exit_code, "reason": self.reason, "startedAt": self.started_at or None,
                     "finishedAt": self.finished_at}
        if self.container_id:
            body["containerID"] = self.container_id
        if self.signal is not None:
            body["signal"] = self.signal
        if self.message:
            body["message"] = self.message
        return {"terminated": body}


State = Waiting | Running | Terminated


def exit_code_of(returncode: int) -> tuple[int, int | None]:
    """Popen's status as a container runtime reports it: killed by signal N is 128 + N."""
    return (128 - returncode, -returncode) if returncode < 0 else (returncode, None)


@dataclass
class Container:
    """One container of a pod: its spec, what the status reports, and its running process."""

    spec: Obj
    kind: Kind
    log_path: Path
    state: State = field(default_factory=lambda: Waiting("PodInitializing"))
    last_state: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    done: bool = False
    """Terminated and will not be restarted."""
    container_id: str = ""
    process: ProcessHandle | None = None
    env: dict[str, str] = field(default_factory=dict)
    started_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def new_container_id(self, pod_uid: str) -> str:
        digest = hashlib.sha256(f"{pod_uid}/{self.name}/{self.restart_count}/{secrets.token_hex(8)}".encode())
        self.container_id = "standin://" + digest.hexdigest()
        return self.container_id

    def to_api(self) -> Obj:
        image = str(self.spec.get("image") or "")
        status: Obj = {
            "name": self.name, "image": image, "imageID": f"standin://{image}", "ready": self.ready,
            "started": self.started, "restartCount": self.restart_count, "state": self.state.to_api(),
            "lastState": self.last_state.to_api() if self.last_state else {},
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


@dataclass
class PodFacts:
    """What the pod worker knows beyond its containers."""

    restart_policy: str
    start_time: str
    host_ip: str
    pod_ip: str = ""
    sandbox_ready: bool = False
    initialized: bool = False
    init_failed: bool = False


class ConditionClock:
    """``lastTransitionTime`` per condition type: changes only when the status does."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}

    def stamp(self, kind: str, status: str, now: str) -> str:
        previous = self._seen.get(kind)
        if previous is None or previous[0] != status:
            self._seen[kind] = (status, now)
        return self._seen[kind][1]


def pod_phase(containers: list[Container], facts: PodFacts) -> str:
    """Pending until initialized and something ran; terminal when no regular container will run again."""
    regular = [c for c in containers if c.kind == "regular"]
    if facts.init_failed:
        return "Failed"
    if not facts.initialized:
        return "Pending"
    if regular and all(c.done for c in regular):
        succeeded = all(isinstance(c.state, Terminated) and c.state.exit_code == 0 for c in regular)
        return "Succeeded" if succeeded else "Failed"
    if any(not isinstance(c.state, Waiting) or c.last_state is not None for c in regular):
        return "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str, message: str, *, clock: ConditionClock, now: str) -> Obj:
    status = "True" if ok else "False"
    # None removes a field in a strategic-merge patch: a True condition keeps no stale reason.
    return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": clock.stamp(kind, status, now),
            "reason": None if ok else reason, "message": None if ok else message}


def _gates_unmet(pod: Obj) -> list[str]:
    have = {c["type"]: c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    return [gate for gate in gates if have.get(gate) != "True"]


def pod_conditions(pod: Obj, containers: list[Container], facts: PodFacts, *, phase: str,
                   clock: ConditionClock, now: str) -> list[Obj]:
    """Our conditions; Ready also needs every readiness gate's condition (set by others) True."""
    terminal = phase in ("Succeeded", "Failed")
    pending_init = [c.name for c in containers
                    if (c.kind == "init" and not c.done) or (c.kind == "sidecar" and not c.started)]
    unready = [c.name for c in containers if c.kind != "init" and not c.ready]
    ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    ready_message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    gates = _gates_unmet(pod)
    conditions = [
        _condition("PodReadyToStartContainers", facts.sandbox_ready, "", "", clock=clock, now=now),
        _condition("Initialized", facts.initialized, "ContainersNotInitialized",
                   f"containers with incomplete status: [{' '.join(pending_init)}]", clock=clock, now=now),
        _condition("ContainersReady", not unready and not terminal, ready_reason, ready_message,
                   clock=clock, now=now),
    ]
    if unready or terminal or not gates:
        ready = _condition("Ready", not unready and not terminal, ready_reason, ready_message, clock=clock, now=now)
        conditions.append(ready)
    else:
        message = "; ".join(f'the status of pod readiness gate "{g}" is not "True"' for g in gates)
        conditions.append(_condition("Ready", False, "ReadinessGatesNotReady", message, clock=clock, now=now))
    have = {c["type"] for c in (pod.get("status") or {}).get("conditions") or []}
    if "PodScheduled" not in have:  # pods created with nodeName skip the scheduler, which sets it
        conditions.append(_condition("PodScheduled", True, "", "", clock=clock, now=now))
    return conditions


def pod_status(pod: Obj, containers: list[Container], facts: PodFacts, clock: ConditionClock, now: str) -> Obj:
    """The ``status`` the stand-in reports for the pod."""
    phase = pod_phase(containers, facts)
    status: Obj = {
        "phase": phase, "conditions": pod_conditions(pod, containers, facts, phase=phase, clock=clock, now=now),
        "hostIP": facts.host_ip, "hostIPs": [{"ip": facts.host_ip}], "startTime": facts.start_time,
        "initContainerStatuses": [c.to_api() for c in containers if c.kind != "regular"],
        "containerStatuses": [c.to_api() for c in containers if c.kind == "regular"],
    }
    if facts.pod_ip:
        status.update(podIP=facts.pod_ip, podIPs=[{"ip": facts.pod_ip}])
    return status
