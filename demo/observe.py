"""What the demo watches, four times a second: the group's pods (role, token, leader-since
from the annotations the sidecars write), the SingletonService's status (written by the
operator), and the ledger the pollers write (through ``demo.ledger``). Changes become
events: lines in the live view's log, or plain log lines without a terminal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg

from demo.cluster import GROUP, NAMESPACE
from demo.ledger import Handover, Ledger, TermSpan
from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError

T = TypeVar("T")
TICK = 0.25
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
CR_PATH = f"/apis/{contract.API_GROUP}/{contract.API_VERSION}/namespaces/{NAMESPACE}/{contract.PLURAL}/{GROUP}"
SIDECAR = "singleton-sidecar"


@dataclass(frozen=True)
class PodRow:
    name: str
    phase: str
    ready: bool
    terminating: bool
    role: str | None
    token: int | None
    since: str | None
    sidecar_restarts: int
    created: str

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodRow:
        meta, status = pod["metadata"], pod.get("status") or {}
        notes = meta.get("annotations") or {}
        token = notes.get(contract.ANNOTATION_TOKEN)
        restarts = sum(int(s.get("restartCount", 0)) for s in status.get("initContainerStatuses") or []
                       if s.get("name") == SIDECAR)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return cls(name=meta["name"], phase=status.get("phase", "Pending"), ready=ready,
                   terminating=bool(meta.get("deletionTimestamp")), role=notes.get(contract.ANNOTATION_ROLE),
                   token=int(token) if token and token.isdigit() else None,
                   since=notes.get(contract.ANNOTATION_LEADER_SINCE), sidecar_restarts=restarts,
                   created=meta.get("creationTimestamp", ""))


@dataclass(frozen=True)
class Snapshot:
    at: float
    pods: tuple[PodRow, ...]
    status: dict[str, Any]

    def live_pods(self) -> list[PodRow]:
        return [p for p in self.pods if not p.terminating and p.phase not in ("Succeeded", "Failed")]

    def pod(self, name: str) -> PodRow | None:
        return next((p for p in self.pods if p.name == name), None)

    def settled(self, replicas: int) -> PodRow | None:
        """The leader once every pod is ready, one leads, the others stand by, and the
        SingletonService's status says the same."""
        pods = self.live_pods()
        if len(pods) != replicas or not all(p.ready for p in pods):
            return None
        leaders = [p for p in pods if p.role == contract.ROLE_LEADER]
        if len(leaders) != 1 or sum(p.role == contract.ROLE_STANDBY for p in pods) != replicas - 1:
            return None
        status, leader = self.status, leaders[0]
        if status.get("leader") != leader.name or status.get("token") != leader.token:
            return None
        if status.get("readyStandbys") != replicas - 1 or status.get("phase") != "Running":
            return None
        return leader


@dataclass(frozen=True)
class Event:
    elapsed: float
    text: str
    style: str = ""


@dataclass
class Step:
    """One scripted action and the handover it caused."""

    cause: str
    command: str = ""
    old_leader: str | None = None
    old_token: int | None = None
    new_leader: str | None = None
    new_token: int | None = None
    status_seconds: float | None = None
    """From the action (for a rollout: from the old leader's deletion) to the new leader in the status."""


@dataclass
class Observer:
    client: KubeClient
    conn: asyncpg.Connection
    ledger: Ledger = field(default_factory=lambda: Ledger(GROUP))
    started: float = field(default_factory=time.monotonic)
    snapshot: Snapshot | None = None
    events: list[Event] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    title: str = "starting"
    on_event: Callable[[Event], None] | None = None
    on_tick: Callable[[], None] | None = None
    errors: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def event(self, text: str, style: str = "") -> None:
        entry = Event(self.elapsed(), text, style)
        self.events = [*self.events[-199:], entry]
        if self.on_event is not None:
            self.on_event(entry)

    def cause_of(self, token: int) -> str:
        for step in self.steps:
            if step.new_token == token:
                return step.cause
        return self.steps[-1].cause if self.steps else "election"

    # --- polling -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except (KubeError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                self.errors += 1
                if self.errors in (1, 10, 100):
                    self.event(f"(reading the cluster failed: {exc}; retrying)", "yellow")
            if self.on_tick is not None:
                self.on_tick()
            await asyncio.sleep(TICK)

    async def tick(self) -> None:
        pods_doc, cr = await asyncio.gather(
            self.client.request("GET", PODS_PATH, params={"labelSelector": f"{contract.LABEL_GROUP}={GROUP}"},
                                timeout=5),
            self._get_cr())
        pods = tuple(sorted((PodRow.from_pod(p) for p in pods_doc.get("items") or []), key=lambda p: p.created))
        new = Snapshot(time.monotonic(), pods, (cr or {}).get("status") or {})
        self._diff(self.snapshot, new)
        self.snapshot = new
        for span in await self.ledger.poll(self.conn):
            self._new_term(span)

    async def _get_cr(self) -> dict[str, Any] | None:
        try:
            return await self.client.request("GET", CR_PATH, timeout=5)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def _new_term(self, span: TermSpan) -> None:
        handovers = [h for h in self.ledger.handovers() if h.after.token == span.token]
        if not handovers:
            self.event(f"ledger: pod {span.pod} writes with token {span.token} (the first term)", "green")
            return
        handover: Handover = handovers[0]
        verdict = (f"{handover.gap * 1000:.0f} ms without a writer" if handover.gap > 0
                   else f"OVERLAP of {-handover.gap * 1000:.0f} ms")
        self.event(f"ledger: token {span.token} ({span.pod}) took over from token {handover.before.token} "
                   f"({handover.before.pod}): {verdict}", "bold green" if handover.gap > 0 else "bold red")

    def _diff(self, old: Snapshot | None, new: Snapshot) -> None:
        before = {p.name: p for p in old.pods} if old else {}
        for pod in new.pods:
            was = before.get(pod.name)
            if was is None:
                self.event(f"pod {pod.name} created", "dim")
                continue
            if pod.role != was.role and pod.role is not None:
                token = f" (token {pod.token})" if pod.token is not None else ""
                style = "bold" if pod.role == contract.ROLE_LEADER else ""
                self.event(f"pod {pod.name}: {was.role or 'starting'} -> {pod.role}{token}", style)
            if pod.terminating and not was.terminating:
                self.event(f"pod {pod.name} is terminating", "yellow")
            if pod.sidecar_restarts > was.sidecar_restarts:
                self.event(f"pod {pod.name}: the kubelet restarted its sidecar (restarts: {pod.sidecar_restarts})")
        for name in before.keys() - {p.name for p in new.pods}:
            self.event(f"pod {name} is gone", "dim")
        status, previous = new.status, (old.status if old else {})
        if status.get("leader") != previous.get("leader") and status.get("leader"):
            self.event(f"status: leader {status['leader']}, token {status.get('token')} "
                       f"(transitions: {status.get('transitions', 0)})", "cyan")
        if status.get("phase") != previous.get("phase") and status.get("phase"):
            self.event(f"status: phase {status['phase']}", "cyan")

    # --- waiting -----------------------------------------------------------------------------

    async def wait_for(self, check: Callable[[Snapshot], T | None], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        seen: Snapshot | None = None
        while time.monotonic() < deadline:
            snapshot = self.snapshot
            if snapshot is not None and snapshot is not seen:
                seen = snapshot
                result = check(snapshot)
                if result is not None and result is not False:
                    return result
            await asyncio.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def since_text(stamp: str | None, now: datetime | None = None) -> str:
    """``12:03:04 (35 s ago)`` from an RFC 3339 time."""
    if not stamp:
        return ""
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    age = ((now or datetime.now(UTC)) - when).total_seconds()
    return f"{when.astimezone().strftime('%H:%M:%S')} ({max(age, 0):.0f} s ago)"
