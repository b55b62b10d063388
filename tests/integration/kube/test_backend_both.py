"""BothBackend against the real PostgreSQL and the real API server of the test session,
the API server reached through a proxy the tests can cut (a partition)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from singleton_election.backends.both import BothBackend
from singleton_election.backends.lease import NEWCOMER_DEFERENCE, LeaseBackend
from singleton_election.backends.postgres.session_mode import PostgresBackend
from singleton_election.core.lock import BackendUnavailable, Identity, LockRecord, Term
from singleton_election.core.timings import Timings
from singleton_election.kube import KubeClient, load_kube_config
from tests.conftest import Cluster
from tests.support.tcpproxy import CuttableProxy

pytestmark = [pytest.mark.k8s, pytest.mark.postgres, pytest.mark.timeout(60)]

LEASE_DURATION = 2.0
RENEW_DEADLINE = 1.5
# Neither backend reads the retry period; it is only made valid (under RENEW_DEADLINE / 1.2).
TIMINGS = Timings(lease_duration=LEASE_DURATION, renew_deadline=RENEW_DEADLINE, retry_period=0.5)


@dataclasses.dataclass
class Stores:
    group: str
    namespace: str
    pg_dsn: str
    client: KubeClient
    """Straight to the API server."""
    cut_client: KubeClient
    """Through ``proxy``."""
    proxy: CuttableProxy
    made: list[PostgresBackend | LeaseBackend] = dataclasses.field(default_factory=list)

    def postgres(self, *, predecessor_prefix: str | None = None) -> PostgresBackend:
        backend = PostgresBackend(group=self.group, dsn=self.pg_dsn, timings=TIMINGS,
                                  predecessor_prefix=predecessor_prefix)
        self.made.append(backend)
        return backend

    def lease(self, *, through_proxy: bool = False, predecessor_prefix: str | None = None) -> LeaseBackend:
        backend = LeaseBackend(client=self.cut_client if through_proxy else self.client, namespace=self.namespace,
                               name=self.group, timings=TIMINGS, predecessor_prefix=predecessor_prefix)
        self.made.append(backend)
        return backend

    def both(self, *, through_proxy: bool = False) -> BothBackend:
        return BothBackend(postgres=self.postgres(), lease=self.lease(through_proxy=through_proxy))

    async def restarted_takes_over(self, prefix: str) -> tuple[Term, float]:
        """The dead holder's restarted incarnation (its pod's sole candidate) campaigns: its
        term, and the seconds it took."""
        restarted = BothBackend(postgres=self.postgres(predecessor_prefix=prefix),
                                lease=self.lease(predecessor_prefix=prefix))
        started = time.monotonic()
        term = await restarted.acquire(Identity(prefix + "44444444"), timeout=3)
        took = time.monotonic() - started
        assert isinstance(term, Term), term
        return term, took


@pytest_asyncio.fixture(loop_scope="function")
async def stores(cluster: Cluster, namespace: str, pg_dsn: str) -> AsyncIterator[Stores]:
    config = load_kube_config(str(cluster.kubeconfig))
    server = urlsplit(config.server)
    assert server.hostname is not None and server.port is not None
    proxy = await CuttableProxy(server.hostname, server.port).start()
    cut_config = dataclasses.replace(config, server=f"https://127.0.0.1:{proxy.port}")
    async with KubeClient(config) as client, KubeClient(cut_config) as cut_client:
        made = Stores(f"both-{uuid.uuid4().hex[:10]}", namespace, pg_dsn, client, cut_client, proxy)
        try:
            yield made
        finally:
            proxy.heal()
            for backend in made.made:
                await backend.close()
            await proxy.close()


async def test_a_leader_cut_off_from_the_api_server_still_frees_postgres_when_it_steps_down(
        stores: Stores) -> None:
    """The PostgreSQL half of a renewal succeeds while the Lease half times out; the
    step-down's release must then name the renewed PostgreSQL term, or the lock stays
    held until PostgreSQL's own expiry and the failover waits for it."""
    leader = stores.both(through_proxy=True)
    term = await leader.acquire(Identity("pod-a"), timeout=5)
    assert isinstance(term, Term)
    stores.proxy.cut()
    with pytest.raises(BackendUnavailable):
        await leader.renew(term, timeout=0.5)
    with pytest.raises(BackendUnavailable):  # the Lease half cannot be written
        await leader.release(term, timeout=0.5)
    standby = stores.postgres()
    started = time.monotonic()
    taken = await standby.acquire(Identity("pod-b"), timeout=1.0)
    assert isinstance(taken, Term), f"the PostgreSQL lock is still held: {taken}"
    assert taken.token > term.token
    assert time.monotonic() - started < 0.5


async def test_a_standby_times_the_lease_from_its_last_change_while_it_waits_for_postgres(
        stores: Stores) -> None:
    """A `both` leader whose Lease went silent keeps the PostgreSQL lock until it steps down
    (here after 1.5 s). The standby must take over one lease duration after the Lease last
    changed, not one lease duration after it got the PostgreSQL lock."""
    old_pg, old_lease = stores.postgres(), stores.lease()
    pg_term = await old_pg.acquire(Identity("pod-a"), timeout=5)
    assert isinstance(pg_term, Term)
    lease_term = await old_lease.acquire(Identity("pod-a"), timeout=5)
    assert isinstance(lease_term, Term)
    last_write = time.monotonic()  # no renewal from here on: the leader is cut off from the API

    standby = stores.both()

    async def campaign() -> float:
        while True:
            result = await standby.acquire(Identity("pod-b"), timeout=0.5)
            if isinstance(result, Term):
                return time.monotonic()

    campaigning = asyncio.create_task(campaign())
    await asyncio.sleep(RENEW_DEADLINE - (time.monotonic() - last_write))
    await old_pg.release(pg_term, timeout=2)  # the old leader steps down at its renew deadline
    took_over = await asyncio.wait_for(campaigning, 10)
    assert took_over - last_write < LEASE_DURATION + 0.4, (
        f"took over {took_over - last_write:.2f}s after the Lease's last change")
    assert took_over - last_write >= LEASE_DURATION - 0.05  # and never before the Lease expired


async def test_a_restarted_sole_candidate_takes_both_locks_at_once_beside_a_waiting_standby(
        stores: Stores) -> None:
    """The leader's sidecar was killed (its session ended, its Lease left behind); a standby of
    another pod campaigns all along. The leader's restarted incarnation takes both locks at
    once and acts at once: the standby, waiting on the Lease, holds no PostgreSQL lock that
    would keep it out; the standby itself still waits the Lease out."""
    prefix = "poller-0/0a1b2c3d/"
    dead_pg, dead_lease = stores.postgres(), stores.lease()
    dead = BothBackend(postgres=dead_pg, lease=dead_lease)
    old = await dead.acquire(Identity(prefix + "11111111"), timeout=5)
    assert isinstance(old, Term)
    await dead_lease.close()
    await dead_pg.close()  # the session ends: PostgreSQL frees the lock, the Lease stays

    standby = stores.both()
    standby_attempt = asyncio.create_task(standby.acquire(Identity("poller-1/99999999/22222222"), timeout=1.5))
    await asyncio.sleep(0.3)
    term, took = await stores.restarted_takes_over(prefix)
    assert took < 1.2, f"took {took:.2f}s"  # not the 2 s lease
    assert term.token > old.token and term.acting_from <= time.monotonic() + 0.001
    result = await standby_attempt
    assert not isinstance(result, Term) and result.holder == prefix + "44444444"
    assert result.token == term.token  # PostgreSQL's view of the holder: the term's token


async def test_a_standby_that_loses_the_race_for_a_released_lease_keeps_off_the_postgres_lock(
        stores: Stores) -> None:
    """The leader releases; both (warm) standbys find the Lease free at once and one wins. The loser
    must not wait on the PostgreSQL lock: it would get it the instant the winner's sidecar dies
    (its session ends) and keep out the winner's restarted incarnation, the one candidate that
    may take over at once, until its own attempt ends (measured on the real node: 1.5 to 2.3 s
    more, in every run after a handover)."""
    leader = stores.both()
    old = await leader.acquire(Identity("poller-2/22222222/00000000"), timeout=5)
    assert isinstance(old, Term)
    parts = {prefix: (stores.postgres(), stores.lease()) for prefix in ("poller-0/0a0a0a0a/", "poller-1/1b1b1b1b/")}
    attempts = {asyncio.create_task(BothBackend(postgres=pg, lease=lease).acquire(Identity(prefix + "11111111"),
                                                                                  timeout=1.9)): prefix
                for prefix, (pg, lease) in parts.items()}
    await asyncio.sleep(NEWCOMER_DEFERENCE + 0.1)  # both wait on the Lease, warm standbys by the release
    await leader.release(old, timeout=5)
    waiting: set[asyncio.Task[Term | LockRecord]] = set(attempts)
    winner = None
    while winner is None and waiting:  # the loser may answer first: it lost the Lease and waits on nothing
        done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        winner = next((attempts[task] for task in done if isinstance(task.result(), Term)), None)
    assert winner is not None, [task.result() for task in attempts]
    dead_pg, dead_lease = parts[winner]
    await dead_lease.close()
    await dead_pg.close()  # the winner's sidecar dies: its session ends, its Lease stays

    term, took = await stores.restarted_takes_over(winner)
    assert took < 0.6, f"took {took:.2f}s: the other standby held the PostgreSQL lock"
    assert term.token > old.token and term.acting_from <= time.monotonic()  # and acts at once
    lost = await next(task for task, prefix in attempts.items() if prefix != winner)
    assert not isinstance(lost, Term), lost


async def test_a_lost_half_keeps_the_other_held_until_the_term_is_released(stores: Stores) -> None:
    """The Lease half is lost (here: taken by another after a forced release) while the
    PostgreSQL half renews. The renewal reports the loss, but the PostgreSQL lock stays held
    until the elector releases the term, after stopping the app: released at once, it would let
    the candidate holding the Lease act beside this app."""
    leader = stores.both()
    term = await leader.acquire(Identity("pod-a"), timeout=5)
    assert isinstance(term, Term)
    other_lease = stores.lease()
    lease_part = leader._parts[term.token][1]
    await leader.lease.release(lease_part, timeout=5)  # a forced release of the Lease half
    taken = await other_lease.acquire(Identity("pod-b"), timeout=5)
    assert isinstance(taken, Term)
    assert await leader.renew(term, timeout=5) is None
    standby_pg = stores.postgres()
    assert not isinstance(await standby_pg.acquire(Identity("pod-b"), timeout=1.0), Term)  # still held
    await leader.release(term, timeout=5)  # the elector's release, once the app has stopped
    assert isinstance(await standby_pg.acquire(Identity("pod-b"), timeout=5), Term)
