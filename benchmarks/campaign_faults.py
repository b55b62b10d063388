"""The faults the campaign injects, which backend each applies to, and how one is run and timed.

| fault | what is done | postgres | lease | both |
|---|---|---|---|---|
| ``sigkill`` | SIGKILL of the leader's sidecar container (the kubelet restarts it) | ✓ | ✓ | ✓ |
| ``sigstop`` | the leader's whole pod frozen (below) | ✓ | ✓ | ✓ |
| ``sigstop-sidecar`` | SIGSTOP of the leader's sidecar process alone (below) | ✓ | ✓ | ✓ |
| ``pg-terminate`` | ``pg_terminate_backend`` of the leader's lock session | ✓ | | ✓ |
| ``pg-terminate-stalled`` | the leader's sidecar stalled, its PostgreSQL sessions terminated (below) | ✓ | | ✓ |
| ``pg-restart`` | restart of PostgreSQL (fast shutdown, start) | ✓ | | ✓ |
| ``apiserver-restart`` | restart of kube-apiserver | | ✓ | ✓ |
| ``etcd-restart`` | restart of etcd | | ✓ | ✓ |
| ``kubelet-restart`` | restart of the node's kubelet (containers run on) | ✓ | ✓ | ✓ |
| ``containerd-restart`` | restart of the node's containerd (containers run on) | ✓ | ✓ | ✓ |
| ``partition-pg`` | the leader's pod cut off from PostgreSQL (dropped), healed after 3..4.5 s | ✓ | | ✓ |
| ``partition-api`` | the leader's pod cut off from the API server (dropped), healed after 3..4.5 s | | ✓ | ✓ |
| ``delete-pod`` | graceful deletion of the leader's pod; a new pod replaces it | ✓ | ✓ | ✓ |
| ``drain-timeout`` | the slow pod leads: its pod deleted, or its sidecar SIGTERMed (below) | ✓ | ✓ | ✓ |
| ``handover`` | ``singletonctl handover`` (below) | ✓ | ✓ | ✓ |
| ``step-down`` | ``POST /step-down`` on the leader's sidecar control port (the pod's loopback) | ✓ | ✓ | ✓ |
| ``lease-release`` | the group's Lease forced free as ``kubectl singleton release`` does (below) | | ✓ | ✓ |
| ``lease-delete`` | ``kubectl delete lease <group>`` | | ✓ | ✓ |
| ``node-cut-off`` | the leader's whole node cut off from the network (two nodes only, below) | ✓ | ✓ | ✓ |
| ``node-power-off`` | the leader's whole node powered off, then booted (two nodes only, below) | ✓ | ✓ | ✓ |
| ``node-kubelet-stop`` | the leader's node's kubelet stopped until the node is NotReady (below) | ✓ | ✓ | ✓ |

- ``sigstop``: the whole pod frozen (its freezer cgroup: ``campaign_pods``) for lease +
  0.5..1.5 s, then thawed, its app first and its sidecar and gate 0.1 s later.
- ``sigstop-sidecar``: SIGSTOP of the sidecar process alone for lease + 0.5..1.5 s, then
  SIGCONT; its keeper (exec gate) or ``gate.sh`` (file gate) and its app run on, and the gate's
  own deadline must stop the app.
- ``pg-terminate-stalled``: SIGSTOP of the sidecar process alone (as ``sigstop-sidecar``), then
  ``pg_terminate_backend`` of its PostgreSQL sessions (its lock session, found by the group's row,
  and any other of the same sidecar: same client address and ``application_name``), the stall
  held for lease + 0.5..1.5 s (past any successor's takeover wait), then SIGCONT. The server frees
  the lock at once and the stalled sidecar cannot tell its gate: the exec gate's keeper freezes
  the app once the sidecar's heartbeat is late, the file gate's ``gate.sh`` stops it at its flag's
  deadline, and the successor acts only after the old term's stop bound or expiry.
- ``drain-timeout``: the slow pod's app finishes in 0.5..1 s and its drain timeout is 0.2 s;
  seeded, its pod is deleted or its sidecar process gets SIGTERM (as the kubelet sends it).
- ``handover``: ``singletonctl handover`` of the group, to a seeded ready standby (``--to``) or
  to any.
- Whole-node faults (``--nodes 2``: the groups' pods spread over two real nodes, and these dealt
  only while the leader runs on the second, which has a network namespace of its own):
  ``node-cut-off``, its link down for lease + 0.5..1.5 s (kubelet, kube-proxy and pods run on,
  unreachable); ``node-power-off``, every process of it stopped at once and killed, booted
  again after lease + 0.5..1.5 s (its pods' containers start again, with new addresses);
  ``node-kubelet-stop``, its kubelet stopped for the node lifecycle controller's grace period
  and 5 s more (the node turns NotReady, its pods not Ready), then started; the term may go on.
- ``lease-release``: ``kubectl patch lease <group> --type=merge -p
  '{"spec":{"holderIdentity":null}}'``, the runbook's release by hand and what the operator does
  for ``kubectl singleton release`` (its holder cleared, no ``singleton.dev/released-token``):
  the holder is not asked and may still act, so the sidecars take such a Lease (and a deleted
  one) only once the last term they saw has expired; the holder notices and stops its app.

A fault is injected where it can move leadership: PostgreSQL faults where the election uses
PostgreSQL, API server and Lease faults where it uses a Lease. Elsewhere they would test only the ledger
worker's own connection (the lease backend's worker still writes to PostgreSQL) or the pod
annotations (the postgres backend's sidecar still writes them), not the election.

Which pod leads is up to the group, so the deck deals by leader: ``drain-timeout`` only when the
slow pod leads (and first, when it does), ``delete-pod``, ``handover`` and ``step-down`` only when
another does (their app drains in time); every other kind whoever leads. When no kind left in the
deck applies (a run limited with ``--kinds``) it deals the next one anyway.

Each fault also names the **path** by which the old term ended (``PATHS``): the kind's, except
that a planned ending (deletion, handover, step-down, SIGTERM) whose sidecar logged that its drain
timeout passed is a ``drain timeout``.

Failover is timed from the moment the fault starts to the first ``/readyz`` 200 (polled from
the host over the pods' IPs) of a new term (a greater token). After a server or node-agent restart
(``apiserver-restart``, ``etcd-restart``, ``kubelet-restart``, ``containerd-restart``) leadership
may survive, so it is timed to the first
``/readyz`` 200 of any term once the server is back, and includes the restart itself. A
``handover`` is timed from singletonctl's start: with ``--to`` it holds the other standbys off
and waits 0.5 s before it asks the leader to step down. ``lease-release`` and ``lease-delete``
are timed from kubectl's return (the change is its last request; kubectl's whole run is in
``detail``).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from benchmarks.campaign_bed import LEASE, Bed, CampaignError, Group
from benchmarks.campaign_poll import Poller, Sample
from singleton_ctl import cli as singletonctl
from singleton_election import contract
from singleton_testbed.controlplane import NODE_GRACE_PERIOD
from singleton_testbed.node import Node

ALL_KINDS = ("sigkill", "sigstop", "sigstop-sidecar", "pg-terminate", "pg-restart", "apiserver-restart",
             "etcd-restart", "partition-pg", "partition-api", "delete-pod", "drain-timeout", "handover", "step-down",
             "kubelet-restart", "containerd-restart", "lease-release", "lease-delete", "pg-terminate-stalled")
ACT_LOG_KINDS = ("sigstop-sidecar", "drain-timeout", "handover", "step-down")
"""The kinds added with the act log (quick mode must inject each at least once)."""
FORCED_LEASE_KINDS = ("lease-release", "lease-delete")
"""The group's Lease changed by hand (its holder not asked)."""
NEW_KINDS = (*FORCED_LEASE_KINDS, "pg-terminate-stalled")
"""The kinds added with issue 31 (quick mode must inject each at least once)."""
NODE_KINDS = ("node-cut-off", "node-power-off", "node-kubelet-stop")
"""Whole-node faults of the second node (``--nodes 2``), dealt while the leader runs there."""
NODE_RESTARTS = frozenset({"kubelet-restart", "containerd-restart"})
"""The node's agents restarted: the containers, and so the election, should not notice."""
_EVERYWHERE = ("sigkill", "sigstop", "sigstop-sidecar", "delete-pod", "drain-timeout", "handover", "step-down",
               *NODE_RESTARTS)
POSTGRES_KINDS = ("pg-terminate", "pg-restart", "partition-pg", "pg-terminate-stalled")
"""Where the election uses PostgreSQL."""
LEASE_KINDS = ("apiserver-restart", "etcd-restart", "partition-api", "lease-release", "lease-delete")
"""Where the election uses a Lease."""
APPLIES: dict[str, tuple[str, ...]] = {
    "postgres": tuple(k for k in ALL_KINDS if k in _EVERYWHERE or k in POSTGRES_KINDS),
    "lease": tuple(k for k in ALL_KINDS if k in _EVERYWHERE or k in LEASE_KINDS),
    "both": tuple(k for k in ALL_KINDS if k in _EVERYWHERE or k in POSTGRES_KINDS or k in LEASE_KINDS),
}
SERVER_RESTARTS = frozenset({"apiserver-restart", "etcd-restart", "node-kubelet-stop"}) | NODE_RESTARTS
"""Faults after which the same term may go on: any ready leader counts as recovered."""
PLANNED = frozenset({"delete-pod", "drain-timeout", "handover", "step-down"})
"""Planned endings: the term drains (bounded by the drain timeout) before it is released."""
SLOW_LEADER_ONLY = frozenset({"drain-timeout"})
QUICK_LEADER_ONLY = frozenset({"delete-pod", "handover", "step-down"})
FROZEN = "sigstop"
"""The fault that freezes a whole pod: the one where an act in flight may finish late."""
RECOVERY_TIMEOUT = 30.0
LOG_LAG = 2.0
"""Seconds a sidecar's log line may take to reach the node's log file (containerd copies it)."""

PATHS: dict[str, str] = {
    "sigkill": "sidecar killed (SIGKILL)",
    "sigstop": "pod frozen whole",
    "sigstop-sidecar": "sidecar stalled alone",
    "pg-terminate": "PostgreSQL session ended",
    "pg-restart": "PostgreSQL session ended",
    "apiserver-restart": "store restarted",
    "etcd-restart": "store restarted",
    "kubelet-restart": "node agent restarted",
    "containerd-restart": "node agent restarted",
    "partition-pg": "cut off (renew deadline)",
    "partition-api": "cut off (renew deadline)",
    "delete-pod": "drain (pod deleted)",
    "drain-timeout": "drain (pod deleted)",
    "handover": "handover (singletonctl)",
    "step-down": "step-down (POST /step-down)",
    "lease-release": "Lease holder cleared (forced release)",
    "lease-delete": "Lease deleted",
    "pg-terminate-stalled": "PostgreSQL session ended, sidecar stalled",
    "node-cut-off": "node cut off (renew deadline)",
    "node-power-off": "node powered off",
    "node-kubelet-stop": "node agent stopped",
}
DRAIN_TIMEOUT_PATH = "drain timeout"
SIGTERM_PATH = "drain (SIGTERM)"
ALL_PATHS = tuple(dict.fromkeys([*PATHS.values(), SIGTERM_PATH, DRAIN_TIMEOUT_PATH]))


@dataclass
class FaultRecord:
    backend: str
    kind: str
    index: int
    pod: str
    old_token: int
    t0: float
    """Wall-clock start of the fault."""
    segment: int = 0
    """Which of the backend's groups (``BackendResult.segments``)."""
    slow: bool = False
    """The leader was the slow pod (its drain timeout shorter than its app's finishing time)."""
    detail: str = ""
    """How it was done (``SIGTERM``, ``--to POD``, how many processes were frozen...)."""
    path: str = ""
    """How the old term ended (``PATHS``)."""
    injected: float = 0.0
    """When the injection ended (SIGCONT sent, partition healed, server back)."""
    hold: float = 0.0
    """SIGSTOP or partition length."""
    outage: float = 0.0
    """Server restart: seconds the server was being restarted."""
    recovered: float | None = None
    new_pod: str | None = None
    new_token: int | None = None
    error: str | None = None
    not_injected: bool = False
    """The fault could not be done (``error`` says why): no failover to time."""

    @property
    def failover(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.t0

    @property
    def changed(self) -> bool:
        return self.new_token is not None and self.new_token != self.old_token

    def describe(self) -> str:
        detail = f" [{self.detail}]" if self.detail else ""
        if self.failover is None:
            what = "NOT INJECTED" if self.not_injected else "NOT RECOVERED"
            return f"{self.kind:<20} {self.pod} token {self.old_token}{detail}: {what} ({self.error})"
        same = "same pod, " if self.new_pod == self.pod else ""
        return (f"{self.kind:<20} {self.pod} token {self.old_token}{detail} -> {self.new_pod} token "
                f"{self.new_token} ({same}{self.failover * 1000:.0f} ms; {self.path})")


class Deck:
    """Seeded random order that deals every kind once per round, as far as the leaders allow:
    ``deal`` takes the next card that applies to the current leader (a card that applies only to
    it first) and keeps the others for later."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random) -> None:
        self.kinds, self.rng = kinds, rng
        self._hand: list[str] = []  # the next card is the last
        self.dealt: set[str] = set()

    @property
    def undealt(self) -> set[str]:
        """Kinds never dealt yet (one whose leader never came, say: the slow pod's)."""
        return set(self.kinds) - self.dealt

    def __repr__(self) -> str:
        return f"<Deck {self.kinds} hand={self._hand}>"

    def _round(self) -> None:
        cards = list(self.kinds)
        self.rng.shuffle(cards)
        self._hand = cards + self._hand

    def deal(self, slow_leader: bool = False, second_node_leader: bool = False) -> str:
        def applies(kind: str) -> bool:
            if kind in NODE_KINDS:
                return second_node_leader
            return kind not in (QUICK_LEADER_ONLY if slow_leader else SLOW_LEADER_ONLY)

        def this_leaders(kind: str) -> bool:
            return (slow_leader and kind in SLOW_LEADER_ONLY) or (second_node_leader and kind in NODE_KINDS)

        for _ in range(2):
            fits = [i for i in reversed(range(len(self._hand))) if applies(self._hand[i])]
            only_now = [i for i in fits if this_leaders(self._hand[i])]
            new = [i for i in fits if self._hand[i] not in self.dealt]  # a kind skipped in an earlier round
            if fits:
                return self._take((only_now or new or fits)[0])
            self._round()
        return self._take(len(self._hand) - 1)  # nothing the deck holds applies to this leader (a --kinds run)

    def _take(self, index: int) -> str:
        kind = self._hand.pop(index)
        self.dealt.add(kind)
        return kind


STALLED_SESSIONS = """\
WITH lock AS (SELECT a.pid, a.client_addr, a.application_name FROM pg_stat_activity a
              WHERE a.pid = (SELECT holder_pid FROM singleton_leases
                             WHERE group_name = $1 AND split_part(holder, '/', 1) = $2)),
     sessions AS MATERIALIZED (SELECT a.pid FROM pg_stat_activity a, lock
                               WHERE a.pid = lock.pid OR (a.client_addr = $3::inet AND lock.client_addr = $3::inet
                                                          AND a.application_name = lock.application_name))
SELECT array_agg(pid ORDER BY pid) FILTER (WHERE ended)
FROM (SELECT pid, pg_terminate_backend(pid) AS ended FROM sessions) AS terminated"""
"""``pg-terminate-stalled``: ends the PostgreSQL sessions of the sidecar of pod ``$2`` (its
identity's first part) that holds the group's row (``$1``, the lock key): its lock session and,
when that one comes from the pod's own address (``$3``), any other from there with the same
``application_name`` (the group's sidecars'); returns their pids (NULL when none was ended)."""
RELEASE_PATCH = '{"spec":{"holderIdentity":null}}'
"""The runbook's release by hand (docs/runbook.md), a JSON merge patch: the holder cleared."""
KUBECTL_RETRY = 15.0
"""Seconds a kubectl call is tried again while it cannot reach the API server."""
UNREACHED = ("connection refused",)
"""What kubectl says when its request never reached the API server (not a timeout: that one may
have landed)."""

HANDOVER_REFUSED_WAIT = 20.0
"""Seconds a handover refused for want of a ready standby is tried again. After an API server
restart the kubelet posts the Ready conditions that changed meanwhile at its next status sync
(every 10 s), so a standby can turn not Ready between the harness's look and singletonctl's
(CI's quick campaign, 2026-11-28: Ready, then "ready standbys: none" a moment later)."""
READINESS_REFUSALS = ("is not a ready standby", "has no ready standby")


@dataclass
class Injector:
    bed: Bed
    group: Group
    poller: Poller
    rng: random.Random
    segment: int = 0

    def _wait_recovered(self, after: float, above: int | None, until: float) -> Sample | None:
        """The first ready leader after the fault. A replacement pod (after a deletion) may be
        the one that wins: it is given to the poller as soon as it runs, not only once settled."""
        while True:
            self.group.watch_started()
            left = until - time.time()
            found = self.poller.wait_ready(after, above, min(max(left, 0.0), 0.5))
            if found is not None or left <= 0.5:
                return found

    def inject(self, kind: str, index: int, leader: Sample) -> FaultRecord:
        assert leader.token is not None
        group = self.group
        timeouts = group.drain_timeouts(leader.pod) if kind in PLANNED else 0
        record = FaultRecord(group.backend, kind, index, leader.pod, leader.token, time.time(),
                             segment=self.segment, slow=group.slow(leader.pod), path=PATHS[kind])
        above = None if kind in SERVER_RESTARTS else leader.token
        self.poller.set_fast(True)
        try:
            try:
                after = self._act(kind, record)
            except CampaignError as exc:
                record.not_injected = True
                raise CampaignError(f"not injected: {exc}") from exc
            except (OSError, subprocess.SubprocessError, TimeoutError, RuntimeError, LookupError) as exc:
                record.not_injected = True
                raise CampaignError(f"not injected: {type(exc).__name__}: {exc}") from exc
            record.injected = time.time()
            # A restart's own length does not count against the recovery (it is reported apart).
            start = max(record.t0, after) if kind in SERVER_RESTARTS else record.t0
            found = self._wait_recovered(after, above, start + RECOVERY_TIMEOUT)
            if found is None:
                latest = {pod: (s.status, s.token) for pod, s in self.poller.latest().items()}
                record.error = (f"no new ready leader within {RECOVERY_TIMEOUT:g}s: members {group.pods}, "
                                f"last answers {latest}")
            else:
                record.recovered, record.new_pod, record.new_token = found.received, found.pod, found.token
        except CampaignError as exc:
            record.error = str(exc)
        finally:
            self.poller.set_fast(False)
        if kind in PLANNED and self._drain_timed_out(leader.pod, timeouts, expected=record.slow):
            record.path = DRAIN_TIMEOUT_PATH
        return record

    def _drain_timed_out(self, pod: str, before: int, *, expected: bool) -> bool:
        """Whether the pod's sidecar logged a drain timeout since ``before`` were counted. It logs
        it before the release, so before the new leader, but the line reaches the node's log
        file a moment later: for the slow pod, whose drain is meant to time out, allow for that."""
        deadline = time.monotonic() + (LOG_LAG if expected else 0.0)
        while self.group.drain_timeouts(pod) <= before:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _act(self, kind: str, record: FaultRecord) -> float:
        """Inject; returns the time from which a ready leader counts as recovered."""
        actions: dict[str, Callable[[FaultRecord], float | None]] = {
            "sigkill": self._sigkill, "sigstop": self._sigstop, "sigstop-sidecar": self._sigstop_sidecar,
            "pg-terminate": self._pg_terminate, "pg-restart": self._pg_restart,
            "pg-terminate-stalled": self._pg_terminate_stalled,
            "apiserver-restart": self._server_restart, "etcd-restart": self._server_restart,
            "kubelet-restart": self._server_restart, "containerd-restart": self._server_restart,
            "partition-pg": self._partition, "partition-api": self._partition, "delete-pod": self._delete_pod,
            "drain-timeout": self._drain_timeout, "handover": self._handover, "step-down": self._step_down,
            "lease-release": self._lease_change, "lease-delete": self._lease_change,
            "node-cut-off": self._node_cut_off, "node-power-off": self._node_power_off,
            "node-kubelet-stop": self._node_kubelet_stop,
        }
        after = actions[kind](record)
        return record.t0 if after is None else after

    def _hold(self, record: FaultRecord) -> None:
        record.hold = self.rng.uniform(LEASE + 0.5, LEASE + 1.5)

    def _begins(self, record: FaultRecord, what: str) -> None:
        """The fault takes effect now: its hold and its failover count from here, not from when it
        was dealt. Finding a pod's processes waits for the API to list its containers, which
        after an API server restart takes up to the kubelet's next status sync (10 s); CI once
        froze a pod 27 s after dealing it, leaving the failover 3 of its 30 s. When it came that
        late, the report says so, and a leader that changed meanwhile (nothing was done to the
        group yet) is an error, not a failover."""
        now = time.time()
        if now - record.t0 > 1.0:
            record.detail = f"{record.detail}; {what} {now - record.t0:.1f}s after being dealt".lstrip("; ")
            newer = {pod: s.token for pod, s in self.poller.latest().items()
                     if s.token is not None and s.token > record.old_token}
            if newer:
                raise CampaignError(f"the leader changed before the fault took effect ({record.detail}): {newer}")
        record.t0 = now

    def _sigkill(self, record: FaultRecord) -> None:
        self.group.kill_sidecar(record.pod)
        self._begins(record, "killed")  # t0 a few ms after the signal: it was sent to every process first

    def _sigstop(self, record: FaultRecord) -> None:
        self._hold(record)
        frozen = self.group.freeze(record.pod)
        try:
            record.detail = f"{frozen.processes} processes"
            self._begins(record, "frozen")
            self._until(record.t0 + record.hold)
        finally:
            self.group.thaw(frozen)

    @contextlib.contextmanager
    def _sidecar_stalled(self, record: FaultRecord) -> Iterator[None]:
        """SIGSTOP of the leader's sidecar process alone (its container's main process: the
        keeper or ``gate.sh``, and the app, run on) until ``record.hold`` after it took effect,
        then SIGCONT. The body runs while it is stopped."""
        self._hold(record)
        pid = self.group.sidecar_pid(record.pod)
        os.kill(pid, signal.SIGSTOP)
        try:
            self._begins(record, "stopped")
            yield
            self._until(record.t0 + record.hold)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _sigstop_sidecar(self, record: FaultRecord) -> None:
        with self._sidecar_stalled(record):
            pass

    def _pg_terminate(self, record: FaultRecord) -> None:
        bed = self.bed
        pid = bed.sql("SELECT holder_pid FROM singleton_leases WHERE group_name = $1",
                      contract.lock_key(self.group.name, self.group.namespace))
        if pid is None or not bed.sql("SELECT pg_terminate_backend($1)", pid):
            raise CampaignError(f"no lock session to terminate (holder pid {pid})")

    def _pg_terminate_stalled(self, record: FaultRecord) -> None:
        """The leader's sidecar stalled, then its PostgreSQL sessions ended under it
        (``STALLED_SESSIONS``); SIGCONT once the hold is over."""
        with self._sidecar_stalled(record):
            ended = self.bed.sql(STALLED_SESSIONS, contract.lock_key(self.group.name, self.group.namespace),
                                 record.pod, self.group.pods.get(record.pod) or None)
            if not ended:
                raise CampaignError(f"no lock session of {record.pod} to terminate (the server said {ended!r})")
            record.detail = f"{len(ended)} session{'s' if len(ended) > 1 else ''} terminated"

    def _pg_restart(self, record: FaultRecord) -> None:
        self.bed.pg.restart()
        record.outage = time.time() - record.t0

    def _server_restart(self, record: FaultRecord) -> float:
        node = self.group.node_of[record.pod]  # the leader's
        restart = {"apiserver-restart": self.bed.cp.restart_apiserver, "etcd-restart": self.bed.cp.restart_etcd,
                   "kubelet-restart": node.restart_kubelet, "containerd-restart": node.restart_containerd}[record.kind]
        restart()
        record.outage = time.time() - record.t0
        return time.time()

    def _leaders_second_node(self, record: FaultRecord) -> Node:
        node = self.group.node_of[record.pod]
        if node is not self.bed.second:
            raise CampaignError(f"{record.kind}: the leader {record.pod} is not on the second node")
        return node

    def _node_cut_off(self, record: FaultRecord) -> None:
        node = self._leaders_second_node(record)
        self._hold(record)
        node.cut_off()
        try:
            self._begins(record, "cut off")
            self._until(record.t0 + record.hold)
        finally:
            node.reconnect()

    def _node_power_off(self, record: FaultRecord) -> None:
        node = self._leaders_second_node(record)
        self._hold(record)
        try:
            node.power_off()
            self._begins(record, "powered off")
            self._until(record.t0 + record.hold)
        finally:
            booted = time.time()
            node.power_on()
            self.group.forget_addresses(node, booted)
        record.outage = time.time() - record.t0

    def _node_kubelet_stop(self, record: FaultRecord) -> float:
        node = self._leaders_second_node(record)
        record.hold = NODE_GRACE_PERIOD + 5.0
        node.stop_kubelet()
        try:
            self._begins(record, "kubelet stopped")
            self._until(record.t0 + record.hold)
        finally:
            node.start_kubelet()
        record.outage = time.time() - record.t0
        return time.time()

    def _partition(self, record: FaultRecord) -> None:
        """Packets dropped both ways inside the pod's network namespace: to PostgreSQL's port at
        the node IP, or to the API server's ClusterIP (what the sidecar dials)."""
        bed = self.bed
        target: tuple[str, int | None] = ((bed.layout.node_ip, bed.pg.info.port) if record.kind == "partition-pg"
                                          else (bed.api_service_ip, None))
        record.hold = self.rng.uniform(3.0, 4.5)
        found = self.group.partition(record.pod, [target])
        try:
            self._begins(record, "cut off")
            self._until(record.t0 + record.hold)
        finally:
            self.group.heal(found, [target])

    def _delete_pod(self, record: FaultRecord) -> None:
        self.group.delete_pod(record.pod)

    def _drain_timeout(self, record: FaultRecord) -> None:
        if self.rng.random() < 0.5:
            record.detail = "pod deleted"
            self.group.delete_pod(record.pod)
            return
        record.detail = "SIGTERM"
        record.path = SIGTERM_PATH
        pid = self.group.sidecar_pid(record.pod)
        os.kill(pid, signal.SIGTERM)  # the container's main process, as the kubelet
        self._begins(record, "signalled")

    def _ready_standbys(self, leader: str, timeout: float = 20.0) -> list[str]:
        """Pods other than ``leader`` whose sidecar says standby and whose pod is Ready: what
        ``singletonctl handover`` accepts as a target. Waited for up to ``timeout``: after an
        API server restart the kubelet reports a pod's readiness again only at its next status
        sync (every 10 s), and CI's quick campaign once found none 5 s after the group settled."""
        path = (f"/api/v1/namespaces/{self.group.namespace}/pods"
                f"?labelSelector={contract.LABEL_GROUP}%3D{self.group.name}")
        deadline = time.monotonic() + timeout
        while True:
            ready = []
            for pod in self.bed.call("GET", path).get("items") or []:
                meta = pod["metadata"]
                conditions = (pod.get("status") or {}).get("conditions") or []
                if (meta["name"] != leader and not meta.get("deletionTimestamp")
                        and (meta.get("annotations") or {}).get(contract.ANNOTATION_ROLE) == "standby"
                        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)):
                    ready.append(str(meta["name"]))
            if ready or time.monotonic() > deadline:
                return sorted(ready)
            time.sleep(0.1)

    def _wait_annotated_leader(self, leader: str, timeout: float = 10.0) -> None:
        """Until the leader's pod says so in its annotation: ``singletonctl handover`` reads the
        roles from the pods, which the sidecars write a moment after they answer (the group is
        settled by their answers)."""
        path = f"/api/v1/namespaces/{self.group.namespace}/pods/{leader}"
        deadline = time.monotonic() + timeout
        while ((self.bed.call("GET", path).get("metadata") or {}).get("annotations") or {}).get(
                contract.ANNOTATION_ROLE) != "leader" and time.monotonic() < deadline:
            time.sleep(0.05)

    def _handover(self, record: FaultRecord) -> None:
        self._wait_annotated_leader(record.pod)
        standbys = self._ready_standbys(record.pod)
        target = self.rng.choice(standbys) if standbys and self.rng.random() < 0.5 else None
        deadline = time.monotonic() + HANDOVER_REFUSED_WAIT
        while True:
            argv = ["--kubeconfig", str(self.bed.kubeconfig), "handover", self.group.name, "-n",
                    self.group.namespace, "--timeout", "20"]
            if target is not None:
                argv += ["--to", target]
            record.detail = f"--to {target}" if target else "any standby"
            record.t0 = time.time()
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                status = singletonctl.main(argv)
            if status == 0:
                return
            said = out.getvalue().strip()
            if not any(refusal in said for refusal in READINESS_REFUSALS) or time.monotonic() > deadline:
                raise CampaignError(f"singletonctl handover failed: {said}")
            # Refused before asking anything of anyone: the pods' Ready conditions are settling.
            time.sleep(0.5)
            standbys = self._ready_standbys(record.pod, timeout=max(deadline - time.monotonic(), 0.0))
            if target is not None and target not in standbys:
                target = standbys[0] if standbys else target

    def _step_down(self, record: FaultRecord) -> None:
        try:
            status, body = self.group.step_down(record.pod)
        except OSError as exc:
            raise CampaignError(f"POST /step-down on {record.pod}: {exc}") from exc
        if status != 202:
            raise CampaignError(f"POST /step-down on {record.pod}: {status} {body}")

    def _lease_change(self, record: FaultRecord) -> None:
        """The group's Lease (named as the group, in its namespace) cleared of its holder by a
        merge patch, or deleted, with kubectl as a person would. Tried again only when kubectl
        could not reach the API server (nothing was changed then): a change that may have landed
        is never made twice, which could end the next term too."""
        group = self.group
        if record.kind == "lease-release":
            argv = ["patch", "lease", group.name, "--type=merge", "-p", RELEASE_PATCH]
        else:
            argv = ["delete", "lease", group.name, "--wait=false"]
        deadline = time.monotonic() + KUBECTL_RETRY
        while True:
            began = time.monotonic()
            done = self.bed.cp.kubectl("-n", group.namespace, *argv, "--request-timeout=5s", check=False)
            if done.returncode == 0:
                break
            said = (done.stderr or done.stdout).strip()
            if not any(unreached in said for unreached in UNREACHED) or time.monotonic() > deadline:
                raise CampaignError(f"kubectl {' '.join(argv)}: {said}")
            time.sleep(0.5)
        record.t0 = time.time()
        record.detail = f"kubectl {time.monotonic() - began:.2f}s"

    @staticmethod
    def _until(moment: float) -> None:
        while (left := moment - time.time()) > 0:
            time.sleep(min(left, 0.1))
