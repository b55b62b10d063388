"""The faults the campaign injects, which backend each applies to, and how one is run and timed.

| fault | what is done | postgres | lease | both |
|---|---|---|---|---|
| ``sigkill`` | SIGKILL of the leader's sidecar container (the stand-in restarts it) | ✓ | ✓ | ✓ |
| ``sigstop`` | SIGSTOP of the leader's container for lease + 0.5..1.5 s, then SIGCONT | ✓ | ✓ | ✓ |
| ``pg-terminate`` | ``pg_terminate_backend`` of the leader's lock session | ✓ | | ✓ |
| ``pg-restart`` | restart of PostgreSQL (fast shutdown, start) | ✓ | | ✓ |
| ``apiserver-restart`` | restart of kube-apiserver | | ✓ | ✓ |
| ``etcd-restart`` | restart of etcd | | ✓ | ✓ |
| ``partition-pg`` | the leader's pod cut off from PostgreSQL (dropped), healed after 3..4.5 s | ✓ | | ✓ |
| ``partition-api`` | the leader's pod cut off from the API server (dropped), healed after 3..4.5 s | | ✓ | ✓ |
| ``delete-pod`` | graceful deletion of the leader's pod; a new pod replaces it | ✓ | ✓ | ✓ |

A fault is injected where it can move leadership: PostgreSQL faults where the election uses
PostgreSQL, API server faults where it uses a Lease. Elsewhere they would test only the ledger
worker's own connection (the lease backend's worker still writes to PostgreSQL) or the pod
annotations (the postgres backend's sidecar still writes them), not the election.

Failover is timed from the moment the fault starts to the first ``/readyz`` 200 (polled from
the host over the pods' IPs) of a new term (a greater token). After a server restart
(``apiserver-restart``, ``etcd-restart``) leadership may survive, so it is timed to the first
``/readyz`` 200 of any term once the server is back, and includes the restart itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.campaign_bed import CONTAINER, LEASE, NET, Bed, CampaignError, Group
from benchmarks.campaign_poll import Poller, Sample
from singleton_sidecar import contract

ALL_KINDS = ("sigkill", "sigstop", "pg-terminate", "pg-restart", "apiserver-restart", "etcd-restart",
             "partition-pg", "partition-api", "delete-pod")
APPLIES: dict[str, tuple[str, ...]] = {
    "postgres": ("sigkill", "sigstop", "pg-terminate", "pg-restart", "partition-pg", "delete-pod"),
    "lease": ("sigkill", "sigstop", "apiserver-restart", "etcd-restart", "partition-api", "delete-pod"),
    "both": ALL_KINDS,
}
SERVER_RESTARTS = frozenset({"apiserver-restart", "etcd-restart"})
"""Faults after which the same term may go on: any ready leader counts as recovered."""
RECOVERY_TIMEOUT = 30.0


@dataclass
class FaultRecord:
    backend: str
    kind: str
    index: int
    pod: str
    old_token: int
    t0: float
    """Wall-clock start of the fault."""
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

    @property
    def failover(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.t0

    @property
    def changed(self) -> bool:
        return self.new_token is not None and self.new_token != self.old_token

    def describe(self) -> str:
        if self.failover is None:
            return f"{self.kind:<17} {self.pod} token {self.old_token}: NOT RECOVERED ({self.error})"
        same = "same pod, " if self.new_pod == self.pod else ""
        return (f"{self.kind:<17} {self.pod} token {self.old_token} -> {self.new_pod} token {self.new_token} "
                f"({same}{self.failover * 1000:.0f} ms)")


class Deck:
    """Seeded random order that still deals every kind once per round."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random) -> None:
        self.kinds, self.rng = kinds, rng
        self._hand: list[str] = []

    def __repr__(self) -> str:
        return f"<Deck {self.kinds}>"

    def deal(self) -> str:
        if not self._hand:
            self._hand = list(self.kinds)
            self.rng.shuffle(self._hand)
        return self._hand.pop()


@dataclass
class Injector:
    bed: Bed
    group: Group
    poller: Poller
    rng: random.Random

    def inject(self, kind: str, index: int, leader: Sample) -> FaultRecord:
        assert leader.token is not None
        record = FaultRecord(self.group.backend, kind, index, leader.pod, leader.token, time.time())
        above = None if kind in SERVER_RESTARTS else leader.token
        self.poller.set_fast(True)
        try:
            after = self._act(kind, record)
            record.injected = time.time()
            left = RECOVERY_TIMEOUT - (time.time() - record.t0)
            found = self.poller.wait_ready(after, above, max(left, 1.0))
            if found is None:
                record.error = f"no new ready leader within {RECOVERY_TIMEOUT:g}s"
            else:
                record.recovered, record.new_pod, record.new_token = found.received, found.pod, found.token
        except CampaignError as exc:
            record.error = str(exc)
        finally:
            self.poller.set_fast(False)
        return record

    def _act(self, kind: str, record: FaultRecord) -> float:
        """Inject; returns the time from which a ready leader counts as recovered."""
        actions: dict[str, Callable[[FaultRecord], float | None]] = {
            "sigkill": self._sigkill, "sigstop": self._sigstop, "pg-terminate": self._pg_terminate,
            "pg-restart": self._pg_restart, "apiserver-restart": self._server_restart,
            "etcd-restart": self._server_restart, "partition-pg": self._partition,
            "partition-api": self._partition, "delete-pod": self._delete_pod,
        }
        after = actions[kind](record)
        return record.t0 if after is None else after

    def _signal(self, record: FaultRecord, signal: str) -> None:
        self.bed.standin.signal(self.group.namespace, record.pod, CONTAINER, signal)

    def _sigkill(self, record: FaultRecord) -> None:
        self._signal(record, "SIGKILL")

    def _sigstop(self, record: FaultRecord) -> None:
        record.hold = self.rng.uniform(LEASE + 0.5, LEASE + 1.5)
        self._signal(record, "SIGSTOP")
        try:
            self._until(record.t0 + record.hold)
        finally:
            self._signal(record, "SIGCONT")

    def _pg_terminate(self, record: FaultRecord) -> None:
        bed = self.bed
        pid = bed.sql("SELECT holder_pid FROM singleton_leases WHERE group_name = $1",
                      contract.lock_key(self.group.name, self.group.namespace))
        if pid is None or not bed.sql("SELECT pg_terminate_backend($1)", pid):
            raise CampaignError(f"no lock session to terminate (holder pid {pid})")

    def _pg_restart(self, record: FaultRecord) -> None:
        self.bed.pg.restart()
        record.outage = time.time() - record.t0

    def _server_restart(self, record: FaultRecord) -> float:
        if record.kind == "apiserver-restart":
            self.bed.cp.restart_apiserver()
        else:
            self.bed.cp.restart_etcd()
        record.outage = time.time() - record.t0
        return time.time()

    def _partition(self, record: FaultRecord) -> None:
        kubelet, ns = self.bed.standin, self.group.namespace
        target = NET.postgres_ip if record.kind == "partition-pg" else NET.api_ip
        record.hold = self.rng.uniform(3.0, 4.5)
        kubelet.partition(ns, record.pod, target, mode="drop")
        try:
            self._until(record.t0 + record.hold)
        finally:
            kubelet.heal(ns, record.pod, target)

    def _delete_pod(self, record: FaultRecord) -> None:
        self.group.delete_pod(record.pod)

    @staticmethod
    def _until(moment: float) -> None:
        while (left := moment - time.time()) > 0:
            time.sleep(min(left, 0.1))
