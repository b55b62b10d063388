"""PooledPostgresBackend (the pooled mode) against the real PostgreSQL server of the test
session, through a real PgBouncer in transaction mode (and directly, where a count of server
connections is the point)."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from singleton_election.backends.postgres.connection import ACQUIRE_GUARD_SLACK
from singleton_election.backends.postgres.pooled_mode import PooledPostgresBackend
from singleton_election.backends.postgres.session_mode import PostgresBackend, force_release
from singleton_election.backends.postgres.sql import Statements
from singleton_election.core.elector import Elector
from singleton_election.core.lock import BackendUnavailable, Identity, LockRecord, Term
from singleton_election.core.timings import Timings
from singleton_sdk.asyncpg import StaleToken, ensure_fence_table, fence
from singleton_testbed.harness.sidecars import SidecarProcess, one_leader, wait_for
from singleton_testbed.pgbouncer import PgBouncer
from singleton_testbed.postgres import PostgresInfo
from tests.support.acting import assert_never_two_actors, has_acted, spans
from tests.support.paths import DATA
from tests.support.pgquery import fetchval
from tests.support.tcpproxy import CuttableProxy

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(90)]

LEASE, RENEW_DEADLINE, RETRY = 2.0, 1.4, 0.5
TIMINGS = Timings(lease_duration=LEASE, renew_deadline=RENEW_DEADLINE, retry_period=RETRY)
CLOCK_SLACK_MS = 1000  # the server and this process read the same machine's clock


def unique(prefix: str = "p") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def bouncer(pg_info: PostgresInfo | None) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode, its files kept so it can be restarted on its port
    (in a folder of its own under /tmp: as root it runs as the postgres user)."""
    if pg_info is None:
        pytest.skip("PgBouncer needs the session's own server")
    workdir = Path(tempfile.mkdtemp(prefix="singleton-pooled-"))
    try:
        with PgBouncer(pg_info, pool_mode="transaction", settings={"default_pool_size": "5"},
                       workdir=workdir) as running:
            yield running
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


Factory = Callable[..., PooledPostgresBackend]


@pytest_asyncio.fixture(loop_scope="function")
async def make_backend(bouncer: PgBouncer) -> AsyncIterator[Factory]:
    """Pooled backends for one test (default: one group, through the transaction pooler)."""
    created: list[PooledPostgresBackend] = []
    default_group = unique()

    def make(**kwargs: object) -> PooledPostgresBackend:
        options: dict[str, object] = {"group": default_group, "dsn": bouncer.dsn, "timings": TIMINGS}
        options.update(kwargs)
        backend = PooledPostgresBackend(**options)  # type: ignore[arg-type]
        created.append(backend)
        return backend

    yield make
    for backend in created:
        await backend.close()


async def acquired(backend: PooledPostgresBackend, identity: str, timeout: float = 3.0) -> Term:
    result = await backend.acquire(Identity(identity), timeout=timeout)
    assert isinstance(result, Term), result
    return result


async def row(admin_dsn: str, group: str) -> asyncpg.Record:
    conn = await asyncpg.connect(admin_dsn)
    try:
        found = await conn.fetchrow("SELECT holder, holder_pid, token, transitions,"
                                    " extract(epoch FROM expires_at - now())::float8 AS left"
                                    " FROM singleton_leases WHERE group_name = $1", group)
    finally:
        await conn.close()
    assert found is not None
    return found


# --- acquire, renew, release, takeover ------------------------------------------------------------


async def test_acquire_renew_release_through_a_transaction_pooler(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    assert abs(term.token - time.time() * 1000) < CLOCK_SLACK_MS  # the database clock in ms
    state = await row(pg_admin_dsn, holder.group)
    assert (state["holder"], state["holder_pid"], state["token"]) == ("a", None, term.token)
    assert LEASE - 0.5 < state["left"] <= LEASE  # expiry by the database clock

    started = time.monotonic()
    seen = await standby.acquire(Identity("b"), timeout=1.0)
    assert seen == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
    assert time.monotonic() - started >= 0.95, "a standby's call waits out its budget: one check per call"
    # Behind a transaction pooler an idle client connection holds no server connection: kept.
    assert standby.through_pooler is True and standby.holds_connection

    renewed = await holder.renew(term, timeout=1)
    assert renewed is not None and renewed.token == term.token and renewed.written_at > term.written_at
    assert await holder.observe(timeout=1) == seen
    await holder.release(renewed, timeout=1)
    started = time.monotonic()
    second = await acquired(standby, "b")
    assert time.monotonic() - started < 0.6, "a released row is taken at the next check"
    assert second.token > term.token and second.acting_from <= time.monotonic()
    assert (await row(pg_admin_dsn, holder.group))["transitions"] == 2


async def test_a_standby_answer_survives_a_loop_that_wakes_late_at_the_end_of_its_budget(
        make_backend: Factory) -> None:
    """A loaded machine wakes the loop late: the call's end and its guard's timeout are then
    due together. The standby still answers with the holder, not "unavailable"."""
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    # The loop stalls from just before the call's end until past its guard's (budget + slack).
    asyncio.get_running_loop().call_later(0.45, time.sleep, ACQUIRE_GUARD_SLACK + 0.2)
    seen = await standby.acquire(Identity("b"), timeout=0.5)
    assert seen == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))


async def test_a_standby_takes_over_only_after_the_expiry_by_the_database_clock(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")  # then never renewed: a crashed holder
    taken_at = time.monotonic()
    result = await standby.acquire(Identity("b"), timeout=LEASE + 1)
    waited = time.monotonic() - taken_at
    assert isinstance(result, Term) and result.token > term.token
    # Not before the expiry (counted by the database from the take, which began before taken_at),
    # and at it, not a retry period later.
    assert LEASE - 0.2 <= waited < LEASE + 0.5, waited
    assert result.acting_from <= time.monotonic(), "after the expiry the old app's own deadline has stopped it"
    assert await holder.renew(term, timeout=1) is None  # stale: the row is b's now


async def test_a_renewal_that_matches_no_row_is_refused(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder = make_backend()
    term = await acquired(holder, "a")
    await fetchval(pg_admin_dsn, "UPDATE singleton_leases SET token = token + 1 WHERE group_name = $1", holder.group)
    assert await holder.renew(term, timeout=1) is None


async def test_a_renewal_after_the_expiry_is_refused_even_if_nobody_took_over(
        make_backend: Factory, pg_admin_dsn: str) -> None:
    """It can only come from a holder already past its renew deadline (< lease): too late."""
    holder = make_backend()
    term = await acquired(holder, "a")
    await fetchval(pg_admin_dsn, "UPDATE singleton_leases SET expires_at = now() WHERE group_name = $1",
                   holder.group)
    assert await holder.renew(term, timeout=1) is None


async def test_a_lost_answer_to_our_own_acquisition_is_retaken_with_a_new_token(
        make_backend: Factory, pg_admin_dsn: str) -> None:
    """The row names us but we hold no term (the answer never came): take it again, at once."""
    first, again = make_backend(), make_backend()
    term = await acquired(first, "a")
    retaken = await acquired(again, "a", timeout=0.5)
    assert retaken.token > term.token


async def test_tokens_grow_from_a_token_far_ahead_and_across_modes(
        make_backend: Factory, bouncer: PgBouncer, pg_dsn: str, pg_admin_dsn: str) -> None:
    group = unique()
    pooled = make_backend(group=group)
    session = PostgresBackend(group=group, dsn=pg_dsn, timings=TIMINGS)
    try:
        first = await acquired(pooled, "a")
        await pooled.release(first, timeout=1)
        ahead = first.token + 3_600_000  # written under a clock an hour ahead
        await fetchval(pg_admin_dsn, "UPDATE singleton_leases SET token = $2 WHERE group_name = $1", group, ahead)
        second = await acquired(pooled, "a")
        assert second.token == ahead + 1
        await pooled.release(second, timeout=1)
        by_session = await session.acquire(Identity("s"), timeout=2)
        assert isinstance(by_session, Term) and by_session.token == second.token + 1
        await session.release(by_session, timeout=1)
        third = await acquired(pooled, "a")
        assert third.token == by_session.token + 1
    finally:
        await session.close()


async def test_fenced_writes_of_an_older_term_are_refused(make_backend: Factory, bouncer: PgBouncer) -> None:
    holder, standby = make_backend(), make_backend()
    old = await acquired(holder, "a")
    await holder.release(old, timeout=1)
    new = await acquired(standby, "b")
    conn = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
    try:
        await ensure_fence_table(conn)
        async with conn.transaction():
            await fence(conn, key=holder.group, token=new.token)
        with pytest.raises(StaleToken):
            async with conn.transaction():
                await fence(conn, key=holder.group, token=old.token)
    finally:
        await conn.close()


# --- modes side by side (a group moving between them) ----------------------------------------------


async def test_a_session_mode_sidecar_never_takes_a_live_pooled_term(make_backend: Factory, pg_dsn: str) -> None:
    pooled = make_backend()
    session = PostgresBackend(group=pooled.group, dsn=pg_dsn, timings=TIMINGS)
    try:
        term = await acquired(pooled, "a")
        seen = await session.acquire(Identity("s"), timeout=1.0)
        assert seen == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
        renewed = await pooled.renew(term, timeout=1)
        assert renewed is not None
        await pooled.release(renewed, timeout=1)
        taken = await session.acquire(Identity("s"), timeout=1)
        assert isinstance(taken, Term) and taken.token > term.token
        # ... and the pooled mode never takes a row whose session-mode holder holds the lock,
        # even once the row has expired (its session-mode peers replace a stalled holder).
        await asyncio.sleep(LEASE + 0.1)
        assert await make_backend().acquire(Identity("b"), timeout=1.0) == LockRecord(
            holder=None, token=taken.token, version=str(taken.token))
    finally:
        await session.close()


async def test_a_pooled_sidecar_recreates_a_deleted_row_under_the_lock_id_a_session_holder_still_holds(
    make_backend: Factory, pg_dsn: str, pg_admin_dsn: str
) -> None:
    """Issue 31, item 6: the row of a session-mode term deleted under it comes back under the
    lock id its holder's session holds, so a pooled sidecar (which checks that lock) waits."""
    pooled = make_backend()
    session = PostgresBackend(group=pooled.group, dsn=pg_dsn, timings=TIMINGS)
    try:
        term = await session.acquire(Identity("s"), timeout=2)
        assert isinstance(term, Term)
        await fetchval(pg_admin_dsn, "DELETE FROM singleton_leases WHERE group_name = $1", pooled.group)
        seen = await pooled.acquire(Identity("b"), timeout=1.0)
        assert not isinstance(seen, Term), "taken under a new lock id while the session holder holds the old one"
        assert await fetchval(pg_admin_dsn, "SELECT lock_id FROM singleton_leases WHERE group_name = $1",
                              pooled.group) == session._lock_id
        assert await session.renew(term, timeout=1) is None
        await session.release(term, timeout=1)
        assert isinstance(await pooled.acquire(Identity("b"), timeout=1), Term)
    finally:
        await session.close()


# --- what a pooler and the server may do ----------------------------------------------------------


async def renew_within(backend: PooledPostgresBackend, term: Term, seconds: float) -> tuple[Term, int]:
    """Renew as the elector does (retry soon after a failure) until it works; the term and the
    number of failed attempts."""
    deadline = time.monotonic() + seconds
    failures = 0
    while time.monotonic() < deadline:
        try:
            renewed = await backend.renew(term, timeout=max(deadline - time.monotonic(), 0.01))
        except BackendUnavailable:
            failures += 1
            await asyncio.sleep(0.1)
            continue
        assert renewed is not None, "the term was lost"
        return renewed, failures
    pytest.fail(f"no renewal within {seconds}s ({failures} failures)")


async def test_a_pgbouncer_restart_within_the_renew_deadline_keeps_the_term(
        make_backend: Factory, bouncer: PgBouncer) -> None:
    holder, standby = make_backend(), make_backend()
    lost: list[str] = []
    holder.set_loss_callback(lost.append)
    term = await acquired(holder, "a")
    bouncer.stop()
    with pytest.raises(BackendUnavailable):
        await holder.renew(term, timeout=0.5)
    bouncer.start()
    renewed, _ = await renew_within(holder, term, RENEW_DEADLINE)
    assert renewed.token == term.token and lost == []
    assert await standby.acquire(Identity("b"), timeout=1) == LockRecord(
        holder=Identity("a"), token=term.token, version=str(term.token))


@pytest.mark.parametrize("through", ["pgbouncer", "direct"])
async def test_terminated_server_sessions_cost_no_term(
        make_backend: Factory, pg_dsn: str, pg_admin_dsn: str, through: str) -> None:
    holder = make_backend(**({"dsn": pg_dsn} if through == "direct" else {}))
    lost: list[str] = []
    holder.set_loss_callback(lost.append)
    term = await acquired(holder, "a")
    pid = holder._conn.get_server_pid() if holder._conn is not None else None
    ended = await fetchval(pg_admin_dsn, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                           " WHERE usename = 'singleton' AND pid <> pg_backend_pid()")
    assert isinstance(ended, int) and ended >= 1
    renewed, _ = await renew_within(holder, term, RENEW_DEADLINE)
    assert renewed.token == term.token and lost == []
    assert holder._conn is not None
    if through == "direct":  # its own session was ended: the renewal ran on a new one
        assert holder._conn.get_server_pid() != pid


async def test_standbys_connected_directly_hold_no_connection_between_checks(
        make_backend: Factory, pg_dsn: str, pg_admin_dsn: str) -> None:
    """Connected directly (every client connection is a server session): a group of one leader
    and 20 polling standbys holds one connection at rest, the leader's."""
    group = unique()
    leader = make_backend(group=group, dsn=pg_dsn)
    standbys = [make_backend(group=group, dsn=pg_dsn) for _ in range(20)]
    await acquired(leader, "leader")
    polls = [asyncio.create_task(s.acquire(Identity(f"s{i}"), timeout=1.5)) for i, s in enumerate(standbys)]
    try:
        await asyncio.sleep(0.7)  # every standby has checked once and sleeps until its next check
        count = await fetchval(pg_admin_dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                               f"singleton:{group}")
        assert count == 1
        assert not any(s.holds_connection for s in standbys)
        assert not any(s.through_pooler for s in standbys)
    finally:
        results = await asyncio.gather(*polls)
    assert all(isinstance(r, LockRecord) and r.holder == "leader" for r in results)


async def test_through_a_transaction_pooler_many_groups_share_a_few_server_connections(
        make_backend: Factory, pg_admin_dsn: str) -> None:
    """10 groups of 3 (30 client connections kept at PgBouncer) renew and poll through its pool
    of 5 server connections: the server never sees more."""
    groups = [unique() for _ in range(10)]
    members = [[make_backend(group=group) for _ in range(3)] for group in groups]
    terms = [await acquired(group[0], "leader") for group in members]
    polls = [asyncio.create_task(b.acquire(Identity(f"s{i}"), timeout=1.0))
             for group in members for i, b in enumerate(group[1:])]
    peak = 0
    try:
        for _ in range(4):
            renewed = await asyncio.gather(*(group[0].renew(term, timeout=1)
                                             for group, term in zip(members, terms, strict=True)))
            assert all(isinstance(term, Term) for term in renewed)
            terms = [term for term in renewed if term is not None]
            count = await fetchval(pg_admin_dsn, "SELECT count(*) FROM pg_stat_activity WHERE usename = 'singleton'")
            assert isinstance(count, int)
            peak = max(peak, count)
            await asyncio.sleep(0.2)
    finally:
        results = await asyncio.gather(*polls)
    assert all(isinstance(r, LockRecord) and r.holder == "leader" for r in results)
    assert all(b.holds_connection for group in members for b in group)
    assert 1 <= peak <= 5


# --- S1: a holder that cannot renew stops before anyone takes over --------------------------------


class ActingLog:
    """When each elector may act (``acting_term()``: what the gates follow), sampled every 5 ms."""

    def __init__(self) -> None:
        self.spans: dict[int, list[float]] = {}  # token -> [first, last] moment seen acting

    async def sample(self, electors: list[Elector]) -> None:
        while True:
            now = time.monotonic()
            for elector in electors:
                term = elector.acting_term()
                if term is not None:
                    span = self.spans.setdefault(term.token, [now, now])
                    span[1] = now
            await asyncio.sleep(0.005)

    def gaps(self) -> list[float]:
        ordered = sorted(self.spans.values())
        return [later[0] - earlier[1] for earlier, later in itertools.pairwise(ordered)]


async def test_a_holder_whose_renewals_fail_stops_before_a_standby_takes_over(bouncer: PgBouncer) -> None:
    group = unique()
    proxies = [await CuttableProxy("127.0.0.1", bouncer.port).start() for _ in range(2)]
    backends = [PooledPostgresBackend(group=group, dsn=bouncer.dsn.replace(str(bouncer.port), str(proxy.port)),
                                      timings=TIMINGS) for proxy in proxies]
    electors = [Elector(group=group, identity=Identity(f"e{i}"), backend=backend, timings=TIMINGS,
                        wall_clock=time.time) for i, backend in enumerate(backends)]
    log = ActingLog()
    tasks = [asyncio.create_task(e.run()) for e in electors]
    sampler = asyncio.create_task(log.sample(electors))
    try:
        deadline = time.monotonic() + 5
        while not any(e.is_ready_leader() for e in electors):
            assert time.monotonic() < deadline, "no leader"
            await asyncio.sleep(0.01)
        first = next(i for i, e in enumerate(electors) if e.is_ready_leader())
        await asyncio.sleep(RETRY * 2)
        cut_at = time.monotonic()
        proxies[first].cut()  # its renewals time out; the database and the standby are fine
        while len(log.spans) < 2:
            assert time.monotonic() - cut_at < LEASE + 3, "no takeover"
            await asyncio.sleep(0.01)
        old, new = sorted(log.spans.values())
        assert old[1] < cut_at + RENEW_DEADLINE, "the cut leader stopped acting at its renew deadline"
        (gap,) = log.gaps()
        assert gap >= LEASE - RENEW_DEADLINE - RETRY, f"takeover {gap:.3f}s after the old leader stopped"
        assert new[0] - cut_at <= LEASE + RETRY + 0.3, "crash failover within lease + retry"
    finally:
        for proxy in proxies:
            proxy.heal()
        sampler.cancel()
        for elector in electors:
            elector.request_drain()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        await asyncio.gather(sampler, return_exceptions=True)
        for backend in backends:
            await backend.close()
        for proxy in proxies:
            await proxy.close()


async def test_an_unreachable_pooler_is_backend_unavailable() -> None:
    backend = PooledPostgresBackend(group=unique(), dsn="postgresql://singleton@127.0.0.1:1/singleton",
                                    timings=TIMINGS)
    with pytest.raises(BackendUnavailable, match="acquire of group"):
        await backend.acquire(Identity("a"), timeout=1)
    assert not backend.holds_connection


async def test_campaigning_again_after_an_unreleased_term_retakes_the_row(make_backend: Factory) -> None:
    """The elector leaves a term unreleased when its app was not confirmed stopped, and campaigns
    again only later: the backend then forgets that term and retakes its own row."""
    backend = make_backend()
    term = await acquired(backend, "a")
    again = await acquired(backend, "a", timeout=0.5)
    assert again.token > term.token
    assert await backend.renew(term, timeout=1) is None  # the forgotten term is not ours any more
    assert await backend.renew(again, timeout=1) is not None


async def test_renewals_and_releases_quote_their_values(make_backend: Factory, pg_admin_dsn: str) -> None:
    """Sent with the simple query protocol, values quoted into the text: a lock key with quotes
    and backslashes (any printable key is allowed) renews and releases its own row only."""
    group = "team-a/o'brien\\" + unique()
    holder = make_backend(group=group)
    term = await acquired(holder, "a")
    renewed = await holder.renew(term, timeout=1)
    assert renewed is not None
    await holder.release(renewed, timeout=1)
    state = await row(pg_admin_dsn, group)
    assert state["holder"] is None and state["token"] == term.token


# --- real sidecar processes in the pooled mode ---------------------------------------------------

APP = str(DATA / "acting_app.py")
SIDECAR_TIMINGS = {"SINGLETON_LEASE_DURATION": "3", "SINGLETON_RENEW_DEADLINE": "2", "SINGLETON_RETRY_PERIOD": "0.5"}


def test_real_sidecars_in_the_pooled_mode_hand_over_and_fail_over_with_the_exec_gate(
        bouncer: PgBouncer, tmp_path: Path) -> None:
    """Three sidecar processes through PgBouncer in transaction mode, each running
    ``acting_app.py`` behind the exec gate: a drained leader's app stops before the next one
    acts (taken at the next check), and a SIGKILLed one (sidecar, keeper and app) is replaced
    once its row has expired. Judged by what the apps did."""
    acts = tmp_path / "acts.log"
    group = "pooled-" + uuid.uuid4().hex[:8]
    sidecars = [SidecarProcess(f"p{index}", {
        "SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_MODE": "pooled",
        "SINGLETON_POSTGRES_DSN": bouncer.dsn, "SINGLETON_IDENTITY": f"p{index}-{uuid.uuid4().hex[:6]}",
        "ACT_LOG": str(acts), **SIDECAR_TIMINGS}, tmp_path / f"p{index}.log", command=[sys.executable, APP])
        for index in range(3)]
    try:
        for sidecar in sidecars:
            sidecar.start()
        first = one_leader(sidecars, timeout=20)
        wait_for(lambda: has_acted(acts), 10, "the first leader's app to act")
        first.signal_sidecar_only(signal.SIGTERM)  # a drain: stop the app, release, exit
        wait_for(lambda: len(spans(acts)) >= 2, 10, "a standby's app to act after the release")
        second = one_leader([s for s in sidecars if s is not first], timeout=5)
        time.sleep(0.5)
        killed_at = time.monotonic()
        second.signal(signal.SIGKILL)  # its whole process group: sidecar, keeper, app
        lease = float(SIDECAR_TIMINGS["SINGLETON_LEASE_DURATION"])
        retry = float(SIDECAR_TIMINGS["SINGLETON_RETRY_PERIOD"])
        wait_for(lambda: len(spans(acts)) >= 3, lease + retry + 5, "the last standby's app to act after the crash")
        third = spans(acts)[2]
        assert third.first - killed_at <= lease + retry + 0.5, "crash failover within lease + retry"
        assert third.first - killed_at >= lease - retry - 0.5, "not before the killed holder's row expired"
        assert_never_two_actors(acts, terms=3)
    finally:
        for sidecar in sidecars:
            sidecar.stop()


async def test_a_force_release_leaves_a_live_pooled_term_to_expire(make_backend: Factory, pg_dsn: str) -> None:
    """Pooled mode has no session to end, and expiring the row at once would let a standby act
    beside a holder that acts until its next renewal: the row stays, the holder renews."""
    backend = make_backend()
    term = await backend.acquire(Identity("a"), timeout=5)
    assert isinstance(term, Term)
    conn = await asyncpg.connect(pg_dsn)
    try:
        done = await force_release(conn, backend.group, sql=Statements.build("public", "singleton_leases"), timeout=5)
    finally:
        await conn.close()
    assert done.startswith("PostgreSQL holder a (pooled mode: no session to end) keeps its row until it expires, in ")
    assert await backend.renew(term, timeout=5) is not None
