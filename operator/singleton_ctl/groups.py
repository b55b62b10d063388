"""What singletonctl reads and changes in the cluster, through the usual kubeconfig.

Reads: SingletonServices, their pods' annotations, their Events. Changes: step-down and
hold requests written as annotations on the group's pods (the sidecars watch their own
pod), a Lease's holder cleared, a PostgreSQL holder's session terminated, and an Event on
the SingletonService recording who did it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from singleton_sidecar import contract
from singleton_sidecar.kube import KubeClient, KubeNotFound, event_body

CALL_TIMEOUT = 10.0
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
    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def get_group(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return await self.client.request("GET", f"{CRS}/namespaces/{namespace}/{contract.PLURAL}/{name}",
                                             timeout=CALL_TIMEOUT)
        except KubeNotFound:
            raise CtlError(f"no SingletonService {name!r} in namespace {namespace!r} "
                           f"(list them with: singletonctl status -n {namespace})") from None

    async def pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        listing = await self.client.request("GET", f"/api/v1/namespaces/{namespace}/pods",
                                            params={"labelSelector": f"{contract.LABEL_GROUP}={name}"},
                                            timeout=CALL_TIMEOUT)
        items: list[dict[str, Any]] = listing.get("items") or []
        return items

    async def view(self, body: dict[str, Any]) -> GroupView:
        metadata, status = body["metadata"], body.get("status") or {}
        now = dt.datetime.now(dt.UTC)
        pods = await self.pods(metadata["namespace"], metadata["name"])
        return GroupView(namespace=metadata["namespace"], name=metadata["name"],
                         backend=(body.get("spec") or {}).get("backend", "lease"), phase=status.get("phase"),
                         leader=status.get("leader"), token=status.get("token"), since=status.get("leaderSince"),
                         transitions=int(status.get("transitions", 0)),
                         members=sorted((_member(p, now) for p in pods), key=lambda m: (m.role != "leader", m.pod)))

    async def status(self, namespace: str | None, name: str | None) -> list[GroupView]:
        if name is not None:
            return [await self.view(await self.get_group(namespace or "default", name))]
        path = f"{CRS}/namespaces/{namespace}/{contract.PLURAL}" if namespace else f"{CRS}/{contract.PLURAL}"
        listing = await self.client.request("GET", path, timeout=CALL_TIMEOUT)
        return list(await asyncio.gather(*(self.view(item) for item in listing.get("items") or [])))

    async def whoami(self) -> str:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        try:
            answer = await self.client.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                               body=review, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return "unknown user"
        return str(((answer.get("status") or {}).get("userInfo") or {}).get("username", "unknown user"))

    async def record(self, body: dict[str, Any], reason: str, message: str) -> None:
        metadata = body["metadata"]
        involved = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
                    "namespace": metadata["namespace"], "name": metadata["name"], "uid": metadata["uid"]}
        event = event_body(involved, reason=reason, message=message, component="singleton.dev/singletonctl",
                           instance="singletonctl")
        await self.client.request("POST", f"/api/v1/namespaces/{metadata['namespace']}/events", body=event,
                                  timeout=CALL_TIMEOUT)

    async def _annotate(self, namespace: str, pod: str, key: str, value: str | None) -> None:
        await self.client.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}",
                                  body={"metadata": {"annotations": {key: value}}},
                                  content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)

    async def handover(self, namespace: str, name: str, target: str | None, *, timeout: float,
                       hold_seconds: float = 30.0) -> tuple[str, float]:
        """Ask the leader to step down (holding every other standby off when ``target`` is
        given); returns the new leader and how long the handover took."""
        body = await self.get_group(namespace, name)
        view = await self.view(body)
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
        who = await self.whoami()
        for pod in others:
            await self._annotate(namespace, pod, contract.ANNOTATION_HOLD, f"{request}:{hold_seconds:g}")
        if others:
            await asyncio.sleep(0.5)  # the standbys see their hold through their pod watch
        started = time.monotonic()
        await self._annotate(namespace, leader.pod, contract.ANNOTATION_STEP_DOWN, request)
        await self.record(body, "HandoverRequested", f"{who} asked {leader.pod} to hand over"
                          + (f" to {target}" if target else ""))
        try:
            new = await self._wait_new_leader(namespace, name, leader.pod, timeout)
        finally:
            for pod in others:
                await self._annotate(namespace, pod, contract.ANNOTATION_HOLD, None)
        took = time.monotonic() - started
        await self.record(body, "HandoverDone", f"{new} leads after a handover from {leader.pod} in {took:.3f}s")
        return new, took

    async def _wait_new_leader(self, namespace: str, name: str, old: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pod in await self.pods(namespace, name):
                annotations = pod["metadata"].get("annotations") or {}
                if pod["metadata"]["name"] != old and annotations.get(contract.ANNOTATION_ROLE) == "leader":
                    return str(pod["metadata"]["name"])
            await asyncio.sleep(0.05)
        raise CtlError(f"no new leader in group {namespace}/{name} within {timeout:g}s")

    async def release(self, namespace: str, name: str) -> list[str]:
        """Force the group's lock free: clear the Lease's holder and/or end the PostgreSQL
        holder's session. A live holder notices and steps down; returns what was done."""
        body = await self.get_group(namespace, name)
        backend = (body.get("spec") or {}).get("backend", "lease")
        done: list[str] = []
        if backend in ("lease", "both"):
            done.append(await self._release_lease(namespace, name))
        if backend in ("postgres", "both"):
            done.append(await self._release_postgres(namespace, body))
        who = await self.whoami()
        await self.record(body, "LockReleased", f"{who} force-released the lock with singletonctl: {'; '.join(done)}")
        return done

    async def _release_lease(self, namespace: str, name: str) -> str:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        try:
            lease = await self.client.request("GET", path, timeout=CALL_TIMEOUT)
        except KubeNotFound:
            return "no Lease to release"
        holder = (lease.get("spec") or {}).get("holderIdentity")
        if not holder:
            return "the Lease had no holder"
        lease["spec"]["holderIdentity"] = None
        # With the resourceVersion read above: if the holder renewed meanwhile, this fails (409).
        await self.client.request("PUT", path, body=lease, timeout=CALL_TIMEOUT)
        return f"cleared Lease holder {holder}"

    async def _release_postgres(self, namespace: str, body: dict[str, Any]) -> str:
        ref = ((body.get("spec") or {}).get("postgres") or {}).get("secretRef") or {}
        secret = await self.client.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{ref.get('name')}",
                                           timeout=CALL_TIMEOUT)
        dsn = base64.b64decode((secret.get("data") or {})[ref.get("key", "dsn")]).decode().strip()
        conn = await asyncpg.connect(dsn, timeout=CALL_TIMEOUT)
        try:
            row = await conn.fetchrow("SELECT holder, holder_pid FROM singleton_leases WHERE group_name = $1",
                                      contract.lock_key(body["metadata"]["name"], namespace))
            if row is None or row["holder_pid"] is None:
                return "no PostgreSQL holder"
            ended = await conn.fetchval("SELECT pg_terminate_backend($1)", row["holder_pid"])
        finally:
            await conn.close()
        if not ended:
            return f"could not end the session of PostgreSQL holder {row['holder']}"
        return f"ended the PostgreSQL session of holder {row['holder']}"

    async def history(self, namespace: str, name: str) -> list[dict[str, str]]:
        """Recent changes of leader: Events of the group and of its pods, oldest first."""
        body = await self.get_group(namespace, name)
        listing = await self.client.request("GET", f"/api/v1/namespaces/{namespace}/events", timeout=CALL_TIMEOUT)
        pods = {p["metadata"]["name"] for p in await self.pods(namespace, name)}
        prefix = f"{name}-"
        interesting = {"LeaderChanged", "LeaderElected", "LeaderDraining", "LeadershipReleased", "LeadershipLost",
                       "HandoverRequested", "HandoverDone", "LockReleased"}
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
        del body
        return sorted(rows, key=lambda r: r["time"])
