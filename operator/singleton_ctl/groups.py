"""What ``kubectl singleton`` reads and changes in the cluster, through the usual kubeconfig.

Reads: SingletonServices, their pods' annotations, their Events. Changes: step-down and
hold requests written as annotations on the group's pods (the sidecars watch their own
pod), a release request written as an annotation on the SingletonService (the operator
carries it out inside the cluster and answers there: singleton_operator.release), and an
Event on the SingletonService recording who asked for a handover.
"""

from __future__ import annotations

import datetime as dt
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from singleton_election import contract
from singleton_election.kube import KubeNotFound, event_body
from singleton_election.kube_blocking import BlockingKubeClient
from singleton_operator.release_request import RELEASE_REQUEST, ReleaseRequest, answer_of, request_of

CRS = f"/apis/{contract.API_GROUP}/{contract.API_VERSION}"


class CtlError(Exception):
    """A problem for the user; the message says what and what to do."""


@dataclass
class Member:
    pod: str
    role: str
    ready: bool
    token: int | None
    since: str | None
    age: str
    deleting: bool


@dataclass
class GroupView:
    namespace: str
    name: str
    backend: str
    phase: str | None
    leader: str | None
    token: int | None
    since: str | None
    transitions: int
    members: list[Member] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "backend": self.backend, "phase": self.phase,
                "leader": self.leader, "token": self.token, "since": self.since, "transitions": self.transitions,
                "members": [m.__dict__ for m in self.members]}


def _age(timestamp: str | None, now: dt.datetime) -> str:
    if not timestamp:
        return "?"
    seconds = int((now - dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _member(pod: dict[str, Any], now: dt.datetime) -> Member:
    metadata = pod["metadata"]
    annotations = metadata.get("annotations") or {}
    token = annotations.get(contract.ANNOTATION_TOKEN)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or [])
    return Member(pod=metadata["name"], role=annotations.get(contract.ANNOTATION_ROLE, "unknown"), ready=ready,
                  token=int(token) if token and token.isdigit() else None,
                  since=annotations.get(contract.ANNOTATION_LEADER_SINCE),
                  age=_age(metadata.get("creationTimestamp"), now), deleting=bool(metadata.get("deletionTimestamp")))


class Ctl:
    def __init__(self, api: BlockingKubeClient, *, prog: str = "kubectl singleton") -> None:
        self.api = api
        self.prog = prog

    def get_group(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self.api.request("GET", f"{CRS}/namespaces/{namespace}/{contract.PLURAL}/{name}")
        except KubeNotFound:
            raise CtlError(f"no SingletonService {name!r} in namespace {namespace!r} "
                           f"(list them with: {self.prog} status -n {namespace})") from None

    def pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        listing = self.api.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                                   params={"labelSelector": f"{contract.LABEL_GROUP}={name}"})
        items: list[dict[str, Any]] = listing.get("items") or []
        return items

    def view(self, body: dict[str, Any]) -> GroupView:
        metadata, status = body["metadata"], body.get("status") or {}
        now = dt.datetime.now(dt.UTC)
        pods = self.pods(metadata["namespace"], metadata["name"])
        return GroupView(namespace=metadata["namespace"], name=metadata["name"],
                         backend=(body.get("spec") or {}).get("backend", "lease"), phase=status.get("phase"),
                         leader=status.get("leader"), token=status.get("token"), since=status.get("leaderSince"),
                         transitions=int(status.get("transitions", 0)),
                         members=sorted((_member(p, now) for p in pods), key=lambda m: (m.role != "leader", m.pod)))

    def status(self, namespace: str | None, name: str | None) -> list[GroupView]:
        if name is not None:
            return [self.view(self.get_group(namespace or "default", name))]
        path = f"{CRS}/namespaces/{namespace}/{contract.PLURAL}" if namespace else f"{CRS}/{contract.PLURAL}"
        return [self.view(item) for item in self.api.request("GET", path).get("items") or []]

    def whoami(self) -> str:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        try:
            answer = self.api.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", body=review)
        except KubeNotFound:
            return "unknown user"
        return str(((answer.get("status") or {}).get("userInfo") or {}).get("username", "unknown user"))

    def record(self, body: dict[str, Any], reason: str, message: str) -> None:
        metadata = body["metadata"]
        involved = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
                    "namespace": metadata["namespace"], "name": metadata["name"], "uid": metadata["uid"]}
        event = event_body(involved, reason=reason, message=message, component="singleton.dev/kubectl-singleton",
                           instance="kubectl-singleton")
        self.api.request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=event)

    def _annotate(self, path: str, key: str, value: str | None) -> dict[str, Any]:
        return self.api.request("PATCH", path, body={"metadata": {"annotations": {key: value}}},
                                content_type="application/merge-patch+json")

    def _annotate_pod(self, namespace: str, pod: str, key: str, value: str | None) -> None:
        self._annotate(f"/api/v1/namespaces/{namespace}/pods/{pod}", key, value)

    def handover(self, namespace: str, name: str, target: str | None, *, timeout: float,
                 hold_seconds: float = 30.0) -> tuple[str, float]:
        """Ask the leader to step down (holding every other standby off when ``target`` is
        given); returns the new leader and how long the handover took."""
        body = self.get_group(namespace, name)
        view = self.view(body)
        leaders = [m for m in view.members if m.role == "leader" and not m.deleting]
        if not leaders:
            raise CtlError(f"group {namespace}/{name} has no leader to hand over from")
        leader = max(leaders, key=lambda m: m.token or 0)
        standbys = [m for m in view.members if m.role == "standby" and m.ready and not m.deleting]
        if target is not None:
            if target == leader.pod:
                raise CtlError(f"{target} already leads group {namespace}/{name}")
            if target not in {m.pod for m in standbys}:
                names = ", ".join(m.pod for m in standbys) or "none"
                raise CtlError(f"{target} is not a ready standby of group {namespace}/{name} (ready standbys: {names})")
        elif not standbys:
            raise CtlError(f"group {namespace}/{name} has no ready standby to hand over to")
        request = secrets.token_hex(4)
        others = [m.pod for m in standbys if target is not None and m.pod != target]
        who = self.whoami()
        for pod in others:
            self._annotate_pod(namespace, pod, contract.ANNOTATION_HOLD, f"{request}:{hold_seconds:g}")
        if others:
            time.sleep(0.5)  # the standbys see their hold through their pod watch
        started = time.monotonic()
        self._annotate_pod(namespace, leader.pod, contract.ANNOTATION_STEP_DOWN, request)
        self.record(body, "HandoverRequested", f"{who} asked {leader.pod} to hand over"
                    + (f" to {target}" if target else ""))
        try:
            new = self._wait_new_leader(namespace, name, leader.pod, leader.token, timeout)
        finally:
            for pod in others:
                self._annotate_pod(namespace, pod, contract.ANNOTATION_HOLD, None)
        took = time.monotonic() - started
        self.record(body, "HandoverDone", f"{new} leads after a handover from {leader.pod} in {took:.3f}s")
        return new, took

    def _wait_new_leader(self, namespace: str, name: str, old: str, old_token: int | None, timeout: float) -> str:
        """The pod that leads after ``old`` (which led with ``old_token``) stepped down."""
        deadline = time.monotonic() + timeout
        stepped_down = False
        while time.monotonic() < deadline:
            for pod in self.pods(namespace, name):
                annotations = pod["metadata"].get("annotations") or {}
                role = annotations.get(contract.ANNOTATION_ROLE)
                if pod["metadata"]["name"] != old:
                    if role == "leader":
                        return str(pod["metadata"]["name"])
                elif role == "leader" and (stepped_down or (  # a term of its own again
                        old_token is not None and annotations.get(contract.ANNOTATION_TOKEN) != str(old_token))):
                    raise CtlError(f"{old} stepped down but no other replica of group {namespace}/{name} took the "
                                   f"lock, and it leads again: see kubectl singleton history {name} -n {namespace} "
                                   "and the standbys' sidecar logs")
                elif role != "leader":
                    stepped_down = True
            time.sleep(0.05)
        if not stepped_down:
            raise CtlError(f"{old} did not step down within {timeout:g}s (is its sidecar running and "
                           f"watching its pod?); no new leader in group {namespace}/{name}")
        raise CtlError(f"no new leader in group {namespace}/{name} within {timeout:g}s")

    def release(self, namespace: str, name: str, *, timeout: float, poll: float = 0.2) -> list[str]:
        """Ask the operator to force the group's lock free (it clears the Lease's holder and/or
        ends the PostgreSQL holder's session, inside the cluster); wait for its answer and
        return what it did. A request nobody answered within ``timeout`` is withdrawn."""
        self.get_group(namespace, name)
        request = ReleaseRequest(id=secrets.token_hex(8), by=self.whoami())
        path = f"{CRS}/namespaces/{namespace}/{contract.PLURAL}/{name}"
        self._annotate(path, RELEASE_REQUEST, request.annotation())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = answer_of(self.get_group(namespace, name))
            if answer is not None and answer.get("id") == request.id:
                if answer.get("error"):
                    raise CtlError(f"the operator could not release the lock of group {namespace}/{name}: "
                                   f"{answer['error']}")
                return [str(line) for line in answer.get("done") or []]
            time.sleep(poll)
        body = self.get_group(namespace, name)
        ours = request_of(body)
        if ours is not None and ours.id == request.id:
            self._annotate(path, RELEASE_REQUEST, None)
        raise CtlError(f"no operator answered the release request for group {namespace}/{name} within "
                       f"{timeout:g}s; it was withdrawn (is the operator running and watching namespace "
                       f"{namespace}?)")

    def history(self, namespace: str, name: str) -> list[dict[str, str]]:
        """Recent changes of leader: Events of the group and of its pods, oldest first."""
        self.get_group(namespace, name)
        listing = self.api.request("GET", f"/api/v1/namespaces/{namespace}/events")
        pods = {p["metadata"]["name"] for p in self.pods(namespace, name)}
        prefix = f"{name}-"
        interesting = {"LeaderChanged", "LeaderElected", "LeaderDraining", "LeadershipReleased", "LeadershipLost",
                       "HandoverRequested", "HandoverDone", "LockReleased", "LockReleaseFailed"}
        rows = []
        for event in listing.get("items") or []:
            involved = event.get("involvedObject") or {}
            ours = (involved.get("kind") == contract.KIND and involved.get("name") == name) or (
                involved.get("kind") == "Pod" and (involved.get("name") in pods
                                                   or str(involved.get("name", "")).startswith(prefix)))
            if ours and event.get("reason") in interesting:
                rows.append({"time": event.get("lastTimestamp") or event.get("eventTime") or "",
                             "object": f"{involved.get('kind', '').lower()}/{involved.get('name')}",
                             "reason": event["reason"], "message": event.get("message", "")})
        return sorted(rows, key=lambda r: r["time"])
