"""What the sidecar shows on its own pod: annotations, the role label, the readiness
condition and Events; and what it learns from it: the pod's deletion.

Run by ``app.Sidecar`` only inside Kubernetes. Writes are coalesced: the reporter
always writes the newest status, so stale annotations are corrected on every change,
and it retries until the API server takes the write.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from singleton_election import contract
from singleton_election.core.status import ElectionStatus, Role
from singleton_election.kube import KubeClient, KubeError, KubeGone, KubeNotFound, event_body

log = logging.getLogger(__name__)

CALL_TIMEOUT = 5.0
WATCH_SECONDS = 300

_EVENT_REASONS = {
    Role.LEADER: ("LeaderElected", "became leader of group {group} with token {token}"),
    Role.DRAINING: ("LeaderDraining", "draining before releasing group {group} (token {token})"),
    Role.STANDBY: ("LeadershipLost", "stood down in group {group}: {reason}"),
    Role.RELEASED: ("LeadershipReleased", "released group {group}"),
}
_LEADING = (Role.LEADER, Role.DRAINING)
HANDOVER_FIRST = 0.3
"""Seconds from its pod's deletion during which the sidecar writes nothing to the pod (its
labels, readiness condition and Events): the lock's release, and the next leader's take, are the
handover's writes, and the API server, busy with the deletion and the replacement pod, answered
a Lease release later with these beside it (64 against 50 ms median in one pair of runs:
benchmarks/README.md). Nothing needs them in time: no endpoints send to a terminating pod
(``labelled_leader_unduly``). The sidecar's exit, which waits for its last status to be
written, comes that much later too, within the pod's grace period."""


def transition_event(previous: Role | None, new: Role) -> str | None:
    """The Event reason for a change of role, or None: only leadership changes are news
    (a standby starting, or a standby leaving, is not)."""
    if new is Role.LEADER and previous is not Role.LEADER:
        return _EVENT_REASONS[Role.LEADER][0]
    if previous in _LEADING and new is not previous and new is not Role.LEADER:
        return _EVENT_REASONS[new][0]
    return None


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def pod_metadata_patch(status: ElectionStatus) -> dict[str, Any]:
    """The merge patch that makes the pod's annotations and labels tell ``status``."""
    leading = status.role in (Role.LEADER, Role.DRAINING)
    return {
        "metadata": {
            "annotations": {
                contract.ANNOTATION_ROLE: status.role.value,
                contract.ANNOTATION_GROUP: status.group,
                contract.ANNOTATION_IDENTITY: status.identity,
                contract.ANNOTATION_TOKEN: str(status.token) if leading and status.token is not None else None,
                contract.ANNOTATION_LEADER_SINCE: _rfc3339(status.leader_since) if leading else None,
                contract.ANNOTATION_DELETION_COST: contract.LEADER_DELETION_COST if leading else None,
            },
            "labels": {contract.LABEL_ROLE: status.role.value, contract.LABEL_GROUP: status.group},
        }
    }


class PodReporter:
    def __init__(self, client: KubeClient, *, namespace: str, pod_name: str, readiness_gate: bool,
                 on_deleting: Callable[[], None], on_step_down: Callable[[str], None] | None = None,
                 on_hold: Callable[[float], None] | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.pod_name = pod_name
        self.readiness_gate = readiness_gate
        self._on_deleting = on_deleting
        self._on_step_down = on_step_down
        self._on_hold = on_hold
        # Request annotations as first seen: acted on only when they change afterwards.
        self._requests: dict[str, str | None] | None = None
        self._latest: ElectionStatus | None = None
        self._written: tuple[dict[str, Any], bool] | None = None
        self._wrote = asyncio.Event()  # set and replaced on every write that reached the API server
        self._events: list[ElectionStatus] = []
        self._changed = asyncio.Event()
        self._pod_uid: str | None = None
        self._deleting = False
        self._deleted_at: float | None = None  # the loop's time when the deletion was seen
        self._pod_gone = False
        self._stopped_containers: set[str] = set()
        self._containers_changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"<PodReporter pod={self.namespace}/{self.pod_name}>"

    @property
    def _pod_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}"

    @property
    def pending(self) -> bool:
        """True while the newest status (or an Event) has not reached the API server yet."""
        return bool(self._events) or (self._latest is not None and self._shown(self._latest) != self._written)

    @property
    def labelled_leader_unduly(self) -> bool:
        """The pod's role label still says leader (the leader Service selects by it) while this
        replica leads no more: the write saying otherwise has not reached the API server yet.
        Not for a pod that is gone (no endpoints name it) or being deleted: the endpoints
        controller marks a terminating pod's endpoints not ready when it sees the deletion, whatever
        the labels, and kube-proxy sends to a terminating endpoint only while no ready one exists,
        so such a pod and the next leader never take the Service's traffic at once. (Waiting for
        the label there cost a pod deletion's handover an API write, up to 0.2 s.)"""
        if self._pod_gone or self._deleting or self._written is None or self._latest is None \
                or self._latest.role is Role.LEADER:
            return False
        return bool(self._written[0]["metadata"]["labels"].get(contract.LABEL_ROLE) == Role.LEADER.value)

    async def wait_unlabelled(self) -> None:
        """Until the pod's role label no longer names this replica leader once it leads no more
        (a drain's "draining" label, written when the drain began, is enough)."""
        while self.labelled_leader_unduly:
            await self._wrote.wait()

    def _shown(self, status: ElectionStatus) -> tuple[dict[str, Any], bool]:
        """What the pod shows of ``status``: only a change of this is worth a write."""
        return pod_metadata_patch(status), status.role is Role.LEADER

    def on_status(self, status: ElectionStatus) -> None:
        previous = self._latest.role if self._latest is not None else None
        if transition_event(previous, status.role) is not None:
            self._events.append(status)
        self._latest = status
        self._changed.set()

    async def run(self) -> None:
        """Write the newest status to the pod, then its Events; retry with backoff until taken."""
        backoff = 0.2
        while True:
            await self._changed.wait()
            self._changed.clear()
            status = self._latest
            if status is None:
                continue
            if (wait := self._handover_first()) > 0:
                await asyncio.sleep(wait)
                self._changed.set()
                continue
            shown = self._shown(status)
            if shown != self._written:
                try:
                    await self._write(status)
                except KubeError as exc:
                    log.warning("pod status write failed; retrying",
                                extra={"pod": self.pod_name, "group": status.group, "role": status.role,
                                       "error": exc, "retry_seconds": backoff})
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    self._changed.set()
                    continue
                backoff = 0.2
                self._written = shown
                self._wrote.set()
                self._wrote = asyncio.Event()
            while self._events:
                await self._event(self._events[0])
                self._events.pop(0)

    def _handover_first(self) -> float:
        """Seconds to hold the writes back (``HANDOVER_FIRST``), 0 to write now."""
        if self._deleted_at is None:
            return 0.0
        return self._deleted_at + HANDOVER_FIRST - asyncio.get_running_loop().time()

    async def _write(self, status: ElectionStatus) -> None:
        await self.client.request("PATCH", self._pod_path, body=pod_metadata_patch(status),
                                  content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
        if self.readiness_gate:
            leading = "True" if status.role is Role.LEADER else "False"
            condition = {"type": contract.CONDITION_LEADER, "status": leading, "reason": status.role.value.title(),
                         "message": status.reason[:250], "lastTransitionTime": _now()}
            await self.client.request("PATCH", self._pod_path + "/status",
                                      body={"status": {"conditions": [condition]}},
                                      content_type="application/strategic-merge-patch+json", timeout=CALL_TIMEOUT)

    async def _event(self, status: ElectionStatus) -> None:
        reason, template = _EVENT_REASONS[status.role]
        message = template.format(group=status.group, token=status.token, reason=status.reason)
        involved = {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace, "name": self.pod_name,
                    **({"uid": self._pod_uid} if self._pod_uid else {})}
        event = event_body(involved, reason=reason, message=message,
                           warning=status.role is Role.STANDBY and "stepped down" in status.reason,
                           component="singleton.dev/singleton-sidecar", instance=status.identity)
        try:
            await self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/events", body=event,
                                      timeout=CALL_TIMEOUT)
        except KubeError as exc:
            log.warning("event not recorded", extra={"pod": self.pod_name, "reason": reason, "error": exc})

    async def wait_container_stopped(self, name: str) -> None:
        """Return once the pod shows container ``name`` terminated (or the pod gone)."""
        while name not in self._stopped_containers and not self._pod_gone:
            self._containers_changed.clear()
            await self._containers_changed.wait()

    async def being_deleted(self) -> bool:
        """Whether this pod is being deleted (or gone) now: known from the watch, else asked
        of the API server (False when it cannot be asked)."""
        if self._deleting:
            return True
        try:
            pod = await self.client.request("GET", self._pod_path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return True
        except KubeError as exc:
            log.warning("reading own pod failed", extra={"pod": self.pod_name, "error": exc})
            return False
        return bool(pod.get("metadata", {}).get("deletionTimestamp"))

    def _note_pod(self, pod: dict[str, Any], *, deleted: bool = False) -> None:
        metadata = pod.get("metadata") or {}
        self._pod_uid = metadata.get("uid", self._pod_uid)
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        stopped = {c["name"] for c in statuses if "terminated" in (c.get("state") or {})}
        if deleted or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self._pod_gone = True
            self._wrote.set()  # wait_unlabelled: no endpoints name a pod that is gone
        if stopped != self._stopped_containers or self._pod_gone:
            self._stopped_containers = stopped
            self._containers_changed.set()
        self._note_requests(metadata.get("annotations") or {})
        if (deleted or metadata.get("deletionTimestamp")) and not self._deleting:
            self._deleting = True
            self._deleted_at = asyncio.get_running_loop().time()
            self._wrote.set()  # wait_unlabelled: a terminating pod's endpoints are not ready (labelled_leader_unduly)
            self._on_deleting()

    def _note_requests(self, annotations: dict[str, str]) -> None:
        now = {key: annotations.get(key) for key in (contract.ANNOTATION_STEP_DOWN, contract.ANNOTATION_HOLD)}
        before, self._requests = self._requests, now
        if before is None:
            return
        step_down = now[contract.ANNOTATION_STEP_DOWN]
        if step_down and step_down != before[contract.ANNOTATION_STEP_DOWN] and self._on_step_down is not None:
            log.info("step-down requested", extra={"pod": self.pod_name, "request": step_down})
            self._on_step_down(f"step-down requested (request {step_down[:64]})")
        hold = now[contract.ANNOTATION_HOLD]
        if hold != before[contract.ANNOTATION_HOLD] and self._on_hold is not None:
            seconds = 0.0
            if hold:
                try:
                    seconds = float(hold.rpartition(":")[2])
                except ValueError:
                    log.warning("ignoring a hold request: not <id>:<seconds>",
                                extra={"pod": self.pod_name, "request": hold})
                    return
            self._on_hold(min(max(seconds, 0.0), 300.0))

    async def watch_pod(self) -> None:
        """Watch this pod: call ``on_deleting`` once when it gets a deletionTimestamp, and keep
        track of which of its containers have stopped (for draining)."""
        resource_version: str | None = None
        backoff = 0.2
        while not self._pod_gone:
            try:
                if resource_version is None:
                    pod = await self.client.request("GET", self._pod_path, timeout=CALL_TIMEOUT)
                    resource_version = pod["metadata"]["resourceVersion"]
                    self._note_pod(pod)
                params = {"fieldSelector": f"metadata.name={self.pod_name}", "resourceVersion": resource_version,
                          "allowWatchBookmarks": "true"}
                async for kind, obj in self.client.watch(f"/api/v1/namespaces/{self.namespace}/pods",
                                                         params=params, timeout=WATCH_SECONDS):
                    resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._note_pod(obj, deleted=kind == "DELETED")
                backoff = 0.2
            except KubeGone:
                resource_version = None
            except KubeNotFound:
                self._note_pod({}, deleted=True)
            except KubeError as exc:
                log.warning("watching own pod failed; retrying",
                            extra={"pod": self.pod_name, "error": exc, "retry_seconds": backoff})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                resource_version = None
