"""PostgresBackend against the real PostgreSQL server of the test session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import pytest_asyncio

from singleton_election.backends.postgres.connection import (
    ACQUIRE_GUARD_SLACK,
    keepalive_settings,
    server_session,
    session_settings,
)
from singleton_election.backends.postgres.session_mode import PostgresBackend, force_release, takeover_wait
from singleton_election.backends.postgres.sql import NAMESPACE, Statements
from singleton_election.core.lock import (
    BackendMisconfigured,
    BackendUnavailable,
    ForceReleaseFailed,
    Identity,
    LockRecord,
    Term,
    Token,
)
from singleton_sdk.asyncpg import ensure_fence_table, fence
from singleton_testbed.pgbouncer import PgBouncer, PoolMode
from singleton_testbed.postgres import PostgresInfo, PostgresServer
from tests.support.backend_timings import timings_for
from tests.support.pgquery import fetchval
from tests.support.tcpproxy import CuttableProxy

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]

SQL = Statements.build("public", "singleton_leases")

HOLDER_SCRIPT = """
import asyncio, sys
from singleton_election.core.lock import Identity
from singleton_election.backends.postgres.session_mode import PostgresBackend
from singleton_election.core.timings import Timings

async def main() -> None:
    group, dsn, lease, identity = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    timings = Timings(lease_duration=lease, renew_deadline=lease / 2, retry_period=lease / 4)
    backend = PostgresBackend(group=group, dsn=dsn, timings=timings)
    result = await backend.acquire(Identity(identity), timeout=10)
    print(getattr(result, "token", "none"), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


CLOCK_SLACK_MS = 1000  # the server and this process read the same machine's clock


def unique(prefix: str = "g") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def wall_ms() -> int:
    """The wall clock in milliseconds since the epoch, as the Lease backend's tokens."""
    return int(time.time() * 1000)


Factory = Callable[..., PostgresBackend]


@pytest_asyncio.fixture(loop_scope="function")
async def make_backend(pg_dsn: str) -> AsyncIterator[Factory]:
    """Backends for one test (default: one group); all closed at the end."""
    created: list[PostgresBackend] = []
    default_group = unique()

    def make(**kwargs: object) -> PostgresBackend:
        options: dict[str, object] = {
            "group": default_group, "dsn": pg_dsn, "timings": timings_for(10.0, 5.0),
        }
        options.update(kwargs)
        backend = PostgresBackend(**options)  # type: ignore[arg-type]
        created.append(backend)
        return backend

    yield make
    for backend in created:
        await backend.close()


async def acquired(backend: PostgresBackend, identity: str, timeout: float = 5.0) -> Term:
    result = await backend.acquire(Identity(identity), timeout=timeout)
    assert isinstance(result, Term), result
    return result


admin_fetchval = fetchval


async def acquire_within(backend: PostgresBackend, identity: str, seconds: float
                         ) -> tuple[Term, list[Term | LockRecord]]:
    """Try to acquire in short attempts until it works; the term and every attempt's result."""
    started = time.monotonic()
    seen: list[Term | LockRecord] = []
    while time.monotonic() - started < seconds:
        result = await backend.acquire(Identity(identity), timeout=1.0)
        seen.append(result)
        if isinstance(result, Term):
            return result, seen
    pytest.fail(f"{identity} never acquired: {seen}")


async def holder_pid(admin_dsn: str, group: str) -> int:
    pid = await admin_fetchval(
        admin_dsn, "SELECT holder_pid FROM singleton_leases WHERE group_name = $1", group)
    assert isinstance(pid, int)
    return pid


class Holder:
    """A lock holder in another process, to crash or freeze for real."""

    def __init__(self, proc: asyncio.subprocess.Process, token: int) -> None:
        self.proc = proc
        self.token = token

    @classmethod
    async def start(cls, group: str, dsn: str, *, lease: float = 10.0) -> Holder:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLDER_SCRIPT, group, dsn, str(lease), f"proc-{group}",
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            return cls(proc, int(line))
        except BaseException:
            await cls(proc, 0).stop()
            raise

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await asyncio.wait_for(self.proc.wait(), 10)


@pytest_asyncio.fixture(loop_scope="function")
async def holders() -> AsyncIterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        await holder.stop()


async def test_first_acquire_gets_token_as_non_superuser(make_backend: Factory, pg_dsn: str) -> None:
    assert await admin_fetchval(pg_dsn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user") is False
    backend = make_backend()
    assert backend.name == "postgres"
    term = await acquired(backend, "a")
    assert term.identity == "a" and term.token > 0 and term.version == str(term.token)
    record = await backend.observe(timeout=2)
    assert (record.holder, record.token, record.version) == ("a", term.token, str(term.token))
    renewed = await backend.renew(term, timeout=2)
    assert renewed is not None and (renewed.identity, renewed.token) == (term.identity, term.token)
    assert renewed.written_at >= term.written_at > 0
    term = renewed
    # observe from another backend uses a short-lived connection
    assert (await make_backend().current_leader()).holder == "a"


async def test_the_row_expires_after_the_timings_lease_duration(make_backend: Factory, pg_admin_dsn: str) -> None:
    """The backend writes the lease duration of the Timings it is handed, on taking and on
    renewing (23 s: neither the factory's 10 s nor any default)."""
    timings = timings_for(23.0, 7.0)
    backend = make_backend(timings=timings)
    assert (backend.lease_duration, backend.renew_deadline) == (23.0, 7.0)
    expiry_sql = "SELECT extract(epoch FROM expires_at - now())::float8 FROM singleton_leases WHERE group_name = $1"
    term = await acquired(backend, "a")
    left = await admin_fetchval(pg_admin_dsn, expiry_sql, backend.group)
    assert isinstance(left, float) and 22.0 < left <= 23.0, left
    await admin_fetchval(pg_admin_dsn, "UPDATE singleton_leases SET expires_at = now() + interval '2 seconds'"
                         " WHERE group_name = $1", backend.group)  # so the renewal must write it again
    assert await backend.renew(term, timeout=2) is not None
    left = await admin_fetchval(pg_admin_dsn, expiry_sql, backend.group)
    assert isinstance(left, float) and 22.0 < left <= 23.0, left


async def test_connection_settings(make_backend: Factory, pg_admin_dsn: str) -> None:
    backend = make_backend(timings=timings_for(15.0, 10.0))
    await acquired(backend, "a")
    conn = backend._conn
    assert conn is not None
    assert await conn.fetchval("SHOW tcp_keepalives_idle") == "11"
    assert await conn.fetchval("SHOW tcp_keepalives_interval") == "1"
    assert await conn.fetchval("SHOW tcp_keepalives_count") == "3"
    name = await admin_fetchval(
        pg_admin_dsn, "SELECT application_name FROM pg_stat_activity WHERE pid = $1", conn.get_server_pid())
    assert name == f"singleton:{backend.group}"
    settings = keepalive_settings(0.4)
    total = int(settings["tcp_keepalives_idle"]) + int(settings["tcp_keepalives_interval"]) * int(
        settings["tcp_keepalives_count"])
    assert total > 0.4 + 1.0


async def test_second_candidate_sees_holder(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    started = time.monotonic()
    result = await standby.acquire(Identity("b"), timeout=1.0)
    elapsed = time.monotonic() - started
    assert result == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
    assert 0.5 < elapsed < 2.5  # it waited out its budget (1 s: a fresh backend connects within it)
    # the same backend does not hand its session lock to a second identity
    assert await holder.acquire(Identity("c"), timeout=0.3) == result


async def test_release_wakes_blocked_standby_at_once(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    first = await acquired(holder, "a")
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    started = time.monotonic()
    await holder.release(first, timeout=2)
    second = await asyncio.wait_for(waiting, 5)
    elapsed = time.monotonic() - started
    assert isinstance(second, Term) and second.token > first.token
    # Without the wake-up the standby would wait out its 10 s acquire: a bound far below that holds on
    # a loaded machine too (how fast it is lives in the benchmarks, not here).
    assert elapsed < 1.0, f"standby took {elapsed * 1000:.1f} ms after release"
    await holder.release(first, timeout=2)  # idempotent
    assert await holder.renew(first, timeout=2) is None
    assert (await holder.observe(timeout=2)).holder == "b"
    await standby.release(second, timeout=2)
    record = await holder.observe(timeout=2)
    assert record.holder is None and record.token == second.token
    again = await acquired(holder, "a")
    assert again.token > second.token


async def test_sigkilled_holder_frees_lock_at_once(
    make_backend: Factory, holders: list[Holder], pg_dsn: str
) -> None:
    standby = make_backend()
    holder = await Holder.start(standby.group, pg_dsn)
    holders.append(holder)
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    started = time.monotonic()
    holder.signal(signal.SIGKILL)
    term = await asyncio.wait_for(waiting, 5)
    elapsed = time.monotonic() - started
    assert isinstance(term, Term) and term.token > holder.token
    assert elapsed < 1.0, f"failover took {elapsed * 1000:.1f} ms"  # the session's end, not an expiry


async def test_crashed_holder_without_standby_is_not_reported(make_backend: Factory, pg_dsn: str) -> None:
    holder, observer = make_backend(), make_backend()
    term = await acquired(holder, "a")
    assert holder._conn is not None
    holder._conn.terminate()  # crash: the session ends, nobody has taken over yet
    await asyncio.sleep(0.1)
    record = await observer.observe(timeout=2)
    assert record.holder is None and record.token == term.token


async def test_terminated_session_fires_loss_callback(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder, standby = make_backend(), make_backend()
    lost: list[str] = []
    fired = asyncio.Event()

    def on_loss(reason: str) -> None:
        lost.append(reason)
        fired.set()

    holder.set_loss_callback(on_loss)
    term = await acquired(holder, "a")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    started = time.monotonic()
    assert await admin_fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid) is True
    await asyncio.wait_for(fired.wait(), 1)
    assert time.monotonic() - started < 1 and len(lost) == 1
    with contextlib.suppress(BackendUnavailable):
        assert await holder.renew(term, timeout=2) is None
    taken = await acquired(standby, "b", timeout=2)
    assert taken.token > term.token
    # the old holder reconnects on its next acquire and sees the new holder
    assert await holder.acquire(Identity("a"), timeout=1.0) == LockRecord(
        holder=Identity("b"), token=taken.token, version=str(taken.token))
    assert len(lost) == 1


async def test_renew_checks_row_count(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    # someone rewrote the record (an operator, or a takeover recorded behind our back)
    await admin_fetchval(
        pg_admin_dsn,
        "UPDATE singleton_leases SET holder = 'intruder', token = nextval('singleton_leases_token_seq')"
        " WHERE group_name = $1",
        holder.group,
    )
    assert await holder.renew(term, timeout=2) is None
    # the lock is kept until the release, which comes once the app has stopped
    assert not isinstance(await standby.acquire(Identity("b"), timeout=1.0), Term)
    assert await holder.renew(term, timeout=2) is None
    await holder.release(term, timeout=2)
    taken = await acquired(standby, "b", timeout=2)
    assert taken.token > term.token


async def holds_lock(backend: PostgresBackend) -> bool:
    """Whether ``backend``'s session holds its group's advisory lock."""
    assert backend._conn is not None and backend._lock_id is not None
    return bool(await backend._conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid::bigint = $1 AND objid::bigint = $2 AND pid = pg_backend_pid())", NAMESPACE, backend._lock_id))


async def test_a_renewal_that_matches_no_row_keeps_the_lock_until_the_release(
    make_backend: Factory, pg_admin_dsn: str
) -> None:
    """Issue 31, item 6: the old app acts until the elector has stopped it, so the lock stays
    held until the release that follows; a standby must not take the term meanwhile."""
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    assert isinstance(await standby.acquire(Identity("b"), timeout=1.0), LockRecord)  # waiting on the group's lock
    await admin_fetchval(pg_admin_dsn, "DELETE FROM singleton_leases WHERE group_name = $1", holder.group)
    assert await holder.renew(term, timeout=2) is None  # the loss, reported to the elector
    assert await holds_lock(holder)
    for _ in range(3):
        result = await standby.acquire(Identity("b"), timeout=1.0)
        assert not isinstance(result, Term), "a standby took the term before the old holder released it"
    await holder.release(term, timeout=2)  # the elector: the app has stopped
    taken, _ = await acquire_within(standby, "b", 5)
    assert taken.token > term.token


async def test_a_lock_kept_after_a_renewal_that_matched_no_row_is_given_up_at_the_lease_without_a_release(
    make_backend: Factory, pg_admin_dsn: str
) -> None:
    """An app never confirmed stopped is never released: the lock is given up at the next
    campaign once the term's lease (from its last renewal) has run out, as at an expiry."""
    options = {"timings": timings_for(1.0, 0.5)}
    holder, standby = make_backend(**options), make_backend(**options)
    term = await acquired(holder, "a")
    await admin_fetchval(pg_admin_dsn, "UPDATE singleton_leases SET holder = NULL, holder_pid = NULL,"
                         " expires_at = now() WHERE group_name = $1", holder.group)  # cleared by someone
    assert await holder.renew(term, timeout=2) is None
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=5))
    try:
        assert not isinstance(await holder.acquire(Identity("a"), timeout=0.2), Term)  # within the lease: kept
        assert not waiting.done() and await holds_lock(holder)
        await asyncio.sleep(max(term.written_at + 1.0 - time.monotonic(), 0.0))
        again = await holder.acquire(Identity("a"), timeout=0.5)  # gives the lock up: the standby had queued
    finally:
        taken = await asyncio.wait_for(waiting, 5)
    assert isinstance(taken, Term) and taken.token > term.token
    assert again == LockRecord(holder=Identity("b"), token=taken.token, version=str(taken.token))



async def row_lock_id(admin_dsn: str, group: str) -> object:
    return await admin_fetchval(admin_dsn, "SELECT lock_id FROM singleton_leases WHERE group_name = $1", group)


async def test_a_deleted_row_comes_back_under_the_lock_id_its_holder_still_holds(
    make_backend: Factory, pg_admin_dsn: str
) -> None:
    """Issue 31, item 6: a candidate that re-creates a deleted row must not take the term under
    a new lock id while the old holder's session still holds the old one (two holders)."""
    holder = make_backend()
    term = await acquired(holder, "a")
    lock_id = holder._lock_id
    await admin_fetchval(pg_admin_dsn, "DELETE FROM singleton_leases WHERE group_name = $1", holder.group)
    newcomer = make_backend()  # never saw the group: it creates the row again
    result = await newcomer.acquire(Identity("b"), timeout=1.0)
    assert not isinstance(result, Term), "the term was taken under a new lock id while the old one is held"
    assert await row_lock_id(pg_admin_dsn, holder.group) == lock_id
    other = make_backend(group=unique())  # another group is not given the lock id its row lost
    await acquired(other, "c")
    assert other._lock_id != lock_id
    assert await holder.renew(term, timeout=2) is None
    waiting = asyncio.create_task(newcomer.acquire(Identity("b"), timeout=5))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await holder.release(term, timeout=2)  # the app has stopped
    taken = await asyncio.wait_for(waiting, 5)
    assert isinstance(taken, Term) and taken.token > term.token and taken.acting_from <= time.monotonic()


async def test_a_deleted_row_whose_lock_id_is_not_known_for_sure_is_not_created_again(
    make_backend: Factory, pg_admin_dsn: str
) -> None:
    """Two groups whose names share their first 53 characters have the same application_name
    (63 characters at most): with both rows deleted while held, which held lock id was whose
    is not known, so neither row is created again until those locks are given back."""
    prefix = "g" * 53 + uuid.uuid4().hex[:6]
    first, second = make_backend(group=prefix + "_one"), make_backend(group=prefix + "_two")
    terms = [await acquired(first, "a"), await acquired(second, "a")]
    await admin_fetchval(pg_admin_dsn, "DELETE FROM singleton_leases WHERE group_name LIKE $1", prefix + "%")
    newcomer = make_backend(group=first.group)
    with pytest.raises(BackendUnavailable, match="held lock"):
        await newcomer.acquire(Identity("b"), timeout=0.5)
    assert await row_lock_id(pg_admin_dsn, first.group) is None
    await second.release(terms[1], timeout=2)  # now the one left is first's own
    assert not isinstance(await newcomer.acquire(Identity("b"), timeout=1.0), Term)
    assert await row_lock_id(pg_admin_dsn, first.group) == first._lock_id
    await first.release(terms[0], timeout=2)
    taken, _ = await acquire_within(newcomer, "b", 5)
    assert taken.token > terms[0].token

async def test_stalled_holder_is_terminated_after_expiry(
    make_backend: Factory, holders: list[Holder], pg_dsn: str
) -> None:
    standby = make_backend(timings=timings_for(1.0, 0.5))
    holder = await Holder.start(standby.group, pg_dsn, lease=1.0)
    holders.append(holder)
    holder.signal(signal.SIGSTOP)
    started = time.monotonic()
    result, seen = await acquire_within(standby, "b", 8)
    elapsed = time.monotonic() - started
    assert isinstance(result, Term) and result.token > holder.token
    assert seen[0] == LockRecord(holder=Identity(f"proc-{standby.group}"), token=Token(holder.token),
                                 version=str(holder.token))
    assert elapsed < 4, f"took {elapsed:.2f}s"
    holder.signal(signal.SIGCONT)


async def test_a_stalled_holder_is_replaced_at_its_expiry_within_one_attempt(
    make_backend: Factory, holders: list[Holder], pg_dsn: str
) -> None:
    """A standby whose attempt outlasts the frozen holder's lease ends its lock wait at that
    expiry, ends the holder's session and takes the term in the same attempt: at the expiry,
    not at the end of its attempt (here 3 s later)."""
    standby = make_backend(timings=timings_for(1.0, 0.5))
    holder = await Holder.start(standby.group, pg_dsn, lease=1.0)
    holders.append(holder)
    before = await standby.observe(timeout=2)  # the row as a standby last read it
    assert before.holder is not None
    holder.signal(signal.SIGSTOP)
    frozen = time.monotonic()
    result = await standby.acquire(Identity("b"), timeout=4.0)
    took = time.monotonic() - frozen
    assert isinstance(result, Term) and result.token > holder.token, result
    assert took < 1.6, f"took {took:.2f}s: the lease is 1 s"
    holder.signal(signal.SIGCONT)


async def test_a_lock_taken_twice_is_given_back_whole_and_a_lock_without_a_term_is_reported(
        make_backend: Factory, pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Session advisory locks stack. A holder whose session took the lock twice gives back every
    level at its release (a campaign once saw a released lock stay held for a lease duration);
    a standby kept out by a session that holds the lock while the row names no holder says
    which session that is."""
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    assert holder._conn is not None
    await holder._conn.execute("SELECT pg_advisory_lock($1::int4, $2::int4)", NAMESPACE, holder._held_lock_id)
    caplog.set_level("WARNING", logger="singleton_election.backends.postgres.session_mode")
    await holder.release(term, timeout=2)
    assert "this session held the group's lock more than once; gave back every level" in caplog.text
    second = await acquired(standby, "b", timeout=5)
    await standby.release(second, timeout=2)
    # A session that holds the lock and no term: the standby names it.
    outsider = await asyncpg.connect(pg_dsn)
    try:
        await outsider.execute("SELECT pg_advisory_lock($1::int4, $2::int4)", NAMESPACE, standby._held_lock_id)
        pid = outsider.get_server_pid()
        # The budget covers the lock wait and the two reads after it: 0.3 s was too short for a
        # busy machine (BackendUnavailable instead of the record, once in a helper's run).
        assert isinstance(await standby.acquire(Identity("b"), timeout=2.0), LockRecord)
        assert "the group's row names no holder, yet a session holds its lock" in caplog.text
        assert any(getattr(r, "holder_pid", None) == pid for r in caplog.records)
    finally:
        await outsider.close()


async def test_a_lock_granted_as_its_wait_timed_out_is_taken_not_leaked(
        make_backend: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL keeps a lock granted in the instant its lock_timeout fired and still reports
    the timeout. The server's side of that is made exact here: the lock statement runs, then
    the timeout error is raised. The standby sees that it holds the lock and takes the term;
    taken for "not granted", its next wait would be granted at once (locks stack) and its
    release would leave one level held, keeping every other standby out."""
    standby, other = make_backend(), make_backend()
    real_execute = asyncpg.Connection.execute
    raised: list[str] = []

    async def lock_then_time_out(conn: asyncpg.Connection, query: str, *args: object, **kwargs: object) -> str:
        result: str = await real_execute(conn, query, *args, **kwargs)  # type: ignore[arg-type]
        if query.startswith("SELECT pg_advisory_lock(") and not raised:
            raised.append(query)
            raise asyncpg.LockNotAvailableError("canceling statement due to lock timeout")
        return result

    monkeypatch.setattr(asyncpg.Connection, "execute", lock_then_time_out)
    term = await standby.acquire(Identity("a"), timeout=2)
    assert raised and isinstance(term, Term), term
    monkeypatch.setattr(asyncpg.Connection, "execute", real_execute)
    await standby.release(term, timeout=2)
    assert isinstance(await other.acquire(Identity("b"), timeout=1), Term)  # nothing left held


async def test_cancelled_wait_leaves_backend_usable(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    first = await acquired(holder, "a")
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=10))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await standby.acquire(Identity("b"), timeout=1.0) == LockRecord(
        holder=Identity("a"), token=first.token, version=str(first.token))
    await holder.release(first, timeout=2)
    second = await acquired(standby, "b", timeout=2)
    assert second.token > first.token
    # A budget too short for any wait still gets the holder: the guard allows the statements
    # after the lock wait ACQUIRE_GUARD_SLACK more.
    assert await holder.acquire(Identity("a"), timeout=0.000001) == LockRecord(
        holder=Identity("b"), token=second.token, version=str(second.token))


async def test_a_server_that_stops_answering_is_reported_within_the_budget_and_its_slack(
        make_backend: Factory, pg_dsn: str) -> None:
    """The guard bounds a standby's call when the server goes silent mid-wait (packets dropped,
    no reset): "unavailable" comes at the budget plus ACQUIRE_GUARD_SLACK, not later."""
    parts = urlsplit(pg_dsn)
    proxy = await CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    try:
        holder = make_backend()
        through = parts.netloc.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
        standby = make_backend(dsn=urlunsplit(parts._replace(netloc=through)))
        first = await acquired(holder, "a")
        assert await standby.acquire(Identity("b"), timeout=0.5) == LockRecord(
            holder=Identity("a"), token=first.token, version=str(first.token))  # connected through the proxy
        proxy.cut()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"acquire of group .* timed out after 1\.5s"):
            await standby.acquire(Identity("b"), timeout=1.0)
        took = time.monotonic() - started
        assert 1.0 + ACQUIRE_GUARD_SLACK - 0.05 < took < 1.0 + ACQUIRE_GUARD_SLACK + 1.0, took
    finally:
        proxy.heal()
        await proxy.close()


async def test_tokens_increase_across_server_restart(
    make_backend: Factory, postgres_server: PostgresServer | None
) -> None:
    if postgres_server is None:
        pytest.skip("the server is not ours to restart")
    first, second = make_backend(), make_backend()
    tokens = [(await acquired(first, "a")).token]
    lost = asyncio.Event()
    first.set_loss_callback(lambda _reason: lost.set())
    postgres_server.restart()  # main thread: servers die with the thread that started them
    await asyncio.wait_for(lost.wait(), 5)
    term = await acquired(second, "b", timeout=10)
    tokens.append(term.token)
    await second.release(term, timeout=2)
    tokens.append((await acquired(first, "a", timeout=10)).token)
    assert tokens == sorted(set(tokens)), tokens


async def test_tokens_increase_across_server_crash(
    make_backend: Factory, postgres_server: PostgresServer | None
) -> None:
    """SIGKILL of the server right after an acquire: the token's commit was durable."""
    if postgres_server is None:
        pytest.skip("the server is not ours to crash")
    backend = make_backend()
    first = await acquired(backend, "a")
    await asyncio.to_thread(postgres_server.kill)
    postgres_server._start_process()  # main thread: servers die with the thread that started them
    # As the elector does: an attempt on the dead session fails (BackendUnavailable), the next one works.
    second: Term | None = None
    for _ in range(20):
        try:
            second = await acquired(backend, "a", timeout=10)
            break
        except BackendUnavailable:
            await asyncio.sleep(0.2)
    assert second is not None
    assert second.token > first.token
    assert (await backend.observe(timeout=5)).token == second.token


async def test_cancelled_acquire_leaks_nothing(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    await acquired(holder, "a")
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=10))
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # the autouse leak check runs right after this


async def test_groups_do_not_block_each_other(make_backend: Factory) -> None:
    one, two = make_backend(group=unique()), make_backend(group=unique())
    a = await acquired(one, "a")
    b = await acquired(two, "b", timeout=0.5)
    assert a.token != b.token
    assert (await one.observe(timeout=2)).holder == "a"
    assert (await two.observe(timeout=2)).holder == "b"


async def test_application_bigint_lock_does_not_block(make_backend: Factory, pg_dsn: str) -> None:
    backend = make_backend()
    await backend.release(await acquired(backend, "a"), timeout=2)
    lock_id = await admin_fetchval(
        pg_dsn, "SELECT lock_id FROM singleton_leases WHERE group_name = $1", backend.group)
    assert isinstance(lock_id, int)
    app = await asyncpg.connect(pg_dsn)
    try:
        # the bigint with the same 32-bit halves as our two-int key: the worst case
        await app.execute("SELECT pg_advisory_lock($1::bigint)", (NAMESPACE << 32) | lock_id)
        await app.execute("SELECT pg_advisory_lock($1::bigint)", lock_id)
        await acquired(backend, "a", timeout=0.5)
    finally:
        await app.close()


async def test_schema_creation_is_concurrent_and_idempotent(make_backend: Factory, pg_dsn: str) -> None:
    schema, table = unique("s"), unique("t")
    backends = [make_backend(group=unique(), schema=schema, table=table) for _ in range(5)]
    started_ms = wall_ms()
    terms = await asyncio.gather(*(acquired(b, f"c{i}", timeout=10) for i, b in enumerate(backends)))
    # Tokens are per group (the server's clock in ms at least): two groups may share one.
    assert all(t.token >= started_ms - CLOCK_SLACK_MS for t in terms), (started_ms, terms)
    again = make_backend(group=backends[0].group, schema=schema, table=table)
    assert (await again.observe(timeout=2)).holder == "c0"
    assert isinstance(await again.acquire(Identity("x"), timeout=1.0), LockRecord)
    other = make_backend(group=unique(), schema=schema, table=table)
    await acquired(other, "y")
    versions = await admin_fetchval(pg_dsn, f'SELECT count(*) FROM "{schema}"."{table}_schema_version"')
    assert versions == 1
    # a table nobody created yet: observe reports a free lock without creating anything
    fresh = make_backend(table=unique("t"))
    assert await fresh.observe(timeout=2) == LockRecord(holder=None, token=None)


@pytest.mark.parametrize(
    ("schema", "table"),
    [("public", "bad-name"), ("public", "1abc"), ("public", 'x"; DROP TABLE y; --'), ("public", ""),
     ("public", "t" * 49), ("sch ema", "ok"), ("s" * 64, "ok")],
)
def test_bad_identifiers_rejected(schema: str, table: str) -> None:
    with pytest.raises(ValueError, match=r"invalid (schema|table) name"):
        PostgresBackend(group="g", dsn="postgresql://x", timings=timings_for(10.0), schema=schema, table=table)


async def test_unreachable_server_is_backend_unavailable(make_backend: Factory, pg_dsn: str) -> None:
    dead = make_backend(dsn="postgresql://singleton@127.0.0.1:1/singleton", connect_timeout=1.0)
    with pytest.raises(BackendUnavailable) as caught:
        await dead.acquire(Identity("a"), timeout=2)
    assert caught.value.__cause__ is not None
    with pytest.raises(BackendUnavailable):
        await dead.observe(timeout=2)


# --- tokens: a hybrid logical clock ---------------------------------------------------------


async def test_first_token_passes_a_fence_that_saw_lease_tokens(make_backend: Factory, pg_dsn: str) -> None:
    """A group switched from the Lease backend: its fence row holds a wall-clock-ms token."""
    backend = make_backend()
    lease_token = wall_ms() - 1  # what the Lease backend issued for a Lease created just now
    conn = await asyncpg.connect(pg_dsn)
    try:
        await ensure_fence_table(conn)
        async with conn.transaction():
            await fence(conn, key=backend.group, token=lease_token)
        term = await acquired(backend, "a")
        assert term.token > lease_token
        async with conn.transaction():
            await fence(conn, key=backend.group, token=term.token)  # accepted: no StaleToken
    finally:
        await conn.close()


async def test_tokens_follow_the_server_clock_and_always_increase(
    make_backend: Factory, pg_admin_dsn: str
) -> None:
    table = unique("t")  # its own token sequence, untouched by other tests
    backend = make_backend(table=table)
    before = wall_ms()
    tokens: list[int] = []
    for _ in range(5):  # several within one millisecond: the +1 rules, not the clock
        term = await acquired(backend, "a")
        tokens.append(term.token)
        await backend.release(term, timeout=2)
    after = wall_ms()
    assert tokens == sorted(set(tokens)), tokens
    assert before - CLOCK_SLACK_MS <= tokens[0] and tokens[-1] <= after + CLOCK_SLACK_MS, (before, tokens, after)
    # The sequence was advanced past them, so its next value starts above the last token.
    following = await admin_fetchval(pg_admin_dsn, f"SELECT nextval('\"{table}_token_seq\"')")
    assert isinstance(following, int) and following > tokens[-1]


async def test_token_after_one_from_a_clock_far_ahead_is_one_more(make_backend: Factory, pg_admin_dsn: str) -> None:
    table = unique("t")
    backend = make_backend(table=table)
    await backend.release(await acquired(backend, "a"), timeout=2)
    future = wall_ms() + 10**9  # written under a clock 11.6 days fast
    await admin_fetchval(
        pg_admin_dsn, f'UPDATE "{table}" SET token = $2 WHERE group_name = $1', backend.group, future)
    second = await acquired(backend, "a")
    assert second.token == future + 1
    await backend.release(second, timeout=2)
    # The sequence is shared by groups (and may be reset, restored, recreated): the group's
    # own row keeps its tokens increasing.
    await admin_fetchval(pg_admin_dsn, f"SELECT setval('\"{table}_token_seq\"', 1)")
    third = await acquired(backend, "a")
    assert third.token == future + 2


# --- session settings ---------------------------------------------------------------------------

ROLE_TIMEOUTS = {"statement_timeout": "50ms", "lock_timeout": "20ms",
                 "idle_in_transaction_session_timeout": "100ms", "idle_session_timeout": "500ms"}


@pytest_asyncio.fixture(loop_scope="function")
async def strict_role(pg_dsn: str, pg_admin_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """(DSN, schema) of a role whose settings time out statements, lock waits and idle sessions."""
    role, password = unique("r"), uuid.uuid4().hex
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        await admin.execute(f"CREATE SCHEMA {role} AUTHORIZATION {role}")
        for name, value in ROLE_TIMEOUTS.items():
            await admin.execute(f"ALTER ROLE {role} SET {name} = '{value}'")
        parts = urlsplit(pg_dsn)
        dsn = urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port}"))
        yield dsn, role
    finally:
        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
        await admin.execute(f"DROP SCHEMA IF EXISTS {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


def test_session_settings_by_server_version() -> None:
    old, new = session_settings(4.0, 13), session_settings(4.0, 14)
    assert "idle_session_timeout" not in old  # unknown before 14: setting it would fail
    assert new == {**old, "idle_session_timeout": "0"}
    assert {old[name] for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")} == {"0"}
    assert {k: old[k] for k in keepalive_settings(4.0)} == keepalive_settings(4.0)


async def test_role_timeouts_are_off_on_the_lock_connection(
    make_backend: Factory, strict_role: tuple[str, str]
) -> None:
    dsn, schema = strict_role
    plain = await asyncpg.connect(dsn)
    try:  # the role's settings are in force for everyone else
        assert await plain.fetchval("SHOW statement_timeout") == "50ms"
        assert await plain.fetchval("SHOW idle_session_timeout") == "500ms"
    finally:
        await plain.close()
    backend = make_backend(dsn=dsn, schema=schema)
    await acquired(backend, "a")
    conn = backend._conn
    assert conn is not None
    assert {name: await conn.fetchval(f"SHOW {name}") for name in ROLE_TIMEOUTS} == dict.fromkeys(ROLE_TIMEOUTS, "0")


async def test_leads_and_waits_under_role_timeouts(make_backend: Factory, strict_role: tuple[str, str]) -> None:
    dsn, schema = strict_role
    holder, standby = make_backend(dsn=dsn, schema=schema), make_backend(dsn=dsn, schema=schema)
    lost: list[str] = []
    holder.set_loss_callback(lost.append)
    term = await acquired(holder, "a")
    for _ in range(2):
        # a lock wait far longer than statement_timeout, then idle past idle_session_timeout
        result = await standby.acquire(Identity("b"), timeout=0.4)
        assert result == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
        await asyncio.sleep(0.7)
        renewed = await holder.renew(term, timeout=2)
        assert renewed is not None and renewed.token == term.token
        term = renewed
    assert lost == []


async def test_stalled_holder_is_replaced_under_role_timeouts(
    make_backend: Factory, strict_role: tuple[str, str]
) -> None:
    """The standby's expiry check (row expired, session still holds the lock) ends the holder's session."""
    dsn, schema = strict_role
    options = {"dsn": dsn, "schema": schema, "timings": timings_for(1.0, 0.5)}
    holder, standby = make_backend(**options), make_backend(**options)
    lost = asyncio.Event()
    holder.set_loss_callback(lambda _reason: lost.set())
    term = await acquired(holder, "a")  # and never renewed, as by a stalled process
    started = time.monotonic()
    result, seen = await acquire_within(standby, "b", 8)
    elapsed = time.monotonic() - started
    waiting = LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
    assert len(seen) > 1 and all(r == waiting for r in seen[:-1]), seen
    assert isinstance(result, Term) and result.token > term.token
    # after the lease (1 s), not at idle_session_timeout (0.5 s), and soon after
    assert 0.9 <= elapsed < 4, f"took {elapsed:.2f}s"
    await asyncio.wait_for(lost.wait(), 2)


async def test_lock_timeout_is_reset_after_each_wait(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    first = await acquired(holder, "a")
    assert isinstance(await standby.acquire(Identity("b"), timeout=1.0), LockRecord)
    assert standby._conn is not None
    assert await standby._conn.fetchval("SHOW lock_timeout") == "0"
    await holder.release(first, timeout=2)
    await acquired(standby, "b", timeout=2)
    assert await standby._conn.fetchval("SHOW lock_timeout") == "0"


# --- a closed connection is a lost term -------------------------------------------------------


async def wait_for_lock_wait(admin: asyncpg.Connection, pid: int) -> None:
    """Until backend ``pid`` waits for a lock (a row lock the test holds)."""
    for _ in range(200):
        if await admin.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid) == "Lock":
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"backend {pid} never waited for the row lock")


async def test_failed_renewal_reports_the_loss(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder, standby = make_backend(), make_backend()
    lost: list[str] = []
    holder.set_loss_callback(lost.append)
    term = await acquired(holder, "a")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        async with admin.transaction():
            await admin.execute("SELECT 1 FROM singleton_leases WHERE group_name = $1 FOR UPDATE", holder.group)
            renewal = asyncio.create_task(holder.renew(term, timeout=5))
            await wait_for_lock_wait(admin, pid)
            assert await admin.fetchval("SELECT pg_cancel_backend($1)", pid) is True
            with pytest.raises(BackendUnavailable):
                await renewal
            assert len(lost) == 1 and "renewal failed" in lost[0], lost
    finally:
        await admin.close()
    # the loss is real: the server freed the lock with the session
    taken = await acquired(standby, "b", timeout=1)
    assert taken.token > term.token
    assert await holder.renew(term, timeout=2) is None
    assert len(lost) == 1


async def test_failed_release_reports_the_loss(make_backend: Factory, pg_admin_dsn: str) -> None:
    holder, standby = make_backend(), make_backend()
    lost: list[str] = []
    holder.set_loss_callback(lost.append)
    term = await acquired(holder, "a")
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        async with admin.transaction():
            await admin.execute("SELECT 1 FROM singleton_leases WHERE group_name = $1 FOR UPDATE", holder.group)
            with pytest.raises(BackendUnavailable):
                await holder.release(term, timeout=0.3)  # stuck behind the row lock: times out
            assert len(lost) == 1 and "release failed" in lost[0], lost
    finally:
        await admin.close()
    assert (await acquired(standby, "b", timeout=1)).token > term.token
    assert len(lost) == 1


# --- poolers ----------------------------------------------------------------------------------


Bouncers = Callable[..., PgBouncer]


@pytest.fixture
def pgbouncer(pg_info: PostgresInfo | None) -> Iterator[Bouncers]:
    """Start PgBouncers (``pool_mode``, ``settings``) in front of the session's server; all
    stopped at the end."""
    if pg_info is None:
        pytest.skip("PgBouncer needs the session's own server")
    with contextlib.ExitStack() as stack:
        yield lambda mode, **settings: stack.enter_context(PgBouncer(pg_info, pool_mode=mode, settings=settings))


async def warm_server_connections(dsn: str, count: int) -> None:
    """Make a transaction-mode PgBouncer open ``count`` server connections, left idle."""
    clients = [await asyncpg.connect(dsn) for _ in range(count)]
    try:
        for client in clients:
            await client.execute("BEGIN")  # simple protocol; pins a server connection until COMMIT
        for client in clients:
            await client.execute("COMMIT")
    finally:
        for client in clients:
            await client.close()


@pytest.mark.parametrize(
    ("pool_mode", "settings", "evidence"),
    [
        # LIFO reuse (the default): the second client gets the server connection just left
        ("transaction", {}, "a second connection saw the first one's session setting"),
        ("statement", {}, "a second connection saw the first one's session setting"),
        # round robin over idle server connections: the next statement runs on another one
        ("transaction", {"server_round_robin": "1"}, "a setting made on the connection was gone at its next statement"),
        # DISCARD ALL after every transaction: the mark is wiped before the next statement
        ("transaction", {"server_reset_query_always": "1"},
         "a setting made on the connection was gone at its next statement"),
    ],
    ids=["transaction", "statement", "round-robin", "reset-always"],
)
async def test_transaction_pooler_is_refused(
    make_backend: Factory, pgbouncer: Bouncers, pool_mode: PoolMode, settings: dict[str, str], evidence: str
) -> None:
    bouncer = pgbouncer(pool_mode, **settings)
    if "server_round_robin" in settings:
        await warm_server_connections(bouncer.dsn, 3)
    backend = make_backend(dsn=bouncer.dsn)
    with pytest.raises(BackendMisconfigured) as caught:  # as is: not wrapped in BackendUnavailable
        await backend.acquire(Identity("a"), timeout=5)
    message = str(caught.value)
    assert "\n" not in message
    assert "through a connection pooler in transaction or statement pooling mode" in message
    assert f"({evidence};" in message
    assert "connect directly to PostgreSQL or use session pooling" in message
    assert backend._conn is None and backend._lock_id is None  # refused before any lock or row


async def test_session_pooler_works(make_backend: Factory, pgbouncer: Bouncers) -> None:
    dsn = pgbouncer("session").dsn
    holder, standby = make_backend(dsn=dsn), make_backend(dsn=dsn)
    term = await acquired(holder, "a")
    assert await standby.acquire(Identity("b"), timeout=1.0) == LockRecord(
        holder=Identity("a"), token=term.token, version=str(term.token))
    renewed = await holder.renew(term, timeout=2)
    assert renewed is not None
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=5))
    await asyncio.sleep(0.1)
    await holder.release(renewed, timeout=2)
    second = await asyncio.wait_for(waiting, 5)
    assert isinstance(second, Term) and second.token > term.token


async def test_a_deleted_row_comes_back_under_its_lock_id_through_a_session_pooler(
    make_backend: Factory, pgbouncer: Bouncers, pg_admin_dsn: str
) -> None:
    """The server sees the application_name a session pooler's client sent, so the lock id a
    holder behind it still holds is found when its row is deleted."""
    holder = make_backend(dsn=pgbouncer("session").dsn)
    term = await acquired(holder, "a")
    await admin_fetchval(pg_admin_dsn, "DELETE FROM singleton_leases WHERE group_name = $1", holder.group)
    assert not isinstance(await make_backend().acquire(Identity("b"), timeout=1.0), Term)
    assert await row_lock_id(pg_admin_dsn, holder.group) == holder._lock_id
    await holder.release(term, timeout=2)

async def test_direct_connections_pass_the_pooler_check(
    make_backend: Factory, postgres_server: PostgresServer | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TCP the session's two ends prove a direct connection; over a Unix socket the
    backend pid announced at connect does: neither needs the probe's second connection."""
    if postgres_server is None:
        pytest.skip("needs the session's own server (its Unix socket)")
    info = postgres_server.info
    sockets = postgres_server.workdir / "sockets"
    tcp = make_backend()
    unix = make_backend(dsn=f"postgresql://singleton@/singleton?host={sockets}&port={info.port}")
    opened: dict[str, int] = {}
    for name, backend in (("tcp", tcp), ("unix", unix)):
        real_open = backend._open

        async def counting_open(deadline: float, *, name: str = name, real_open: Callable[..., object] = real_open
                                ) -> asyncpg.Connection:
            opened[name] = opened.get(name, 0) + 1
            conn = await real_open(deadline)  # type: ignore[misc]
            assert isinstance(conn, asyncpg.Connection)
            return conn

        monkeypatch.setattr(backend, "_open", counting_open)
    term = await acquired(tcp, "a")
    assert await unix.acquire(Identity("b"), timeout=1.0) == LockRecord(
        holder=Identity("a"), token=term.token, version=str(term.token))
    assert opened == {"tcp": 1, "unix": 1}


async def test_only_a_connection_to_the_server_itself_is_a_server_session(
        postgres_server: PostgresServer | None, pgbouncer: Bouncers, pg_dsn: str) -> None:
    """The answer does not depend on what other clients do: a pooler's cancel key is its own
    in every pool mode, however quiet or busy it is."""
    if postgres_server is None:
        pytest.skip("needs the session's own server (its Unix socket)")
    sockets = postgres_server.workdir / "sockets"
    unix_dsn = f"postgresql://singleton@/singleton?host={sockets}&port={postgres_server.info.port}"
    answers: dict[str, bool] = {}
    for name, dsn in (("tcp", pg_dsn), ("unix", unix_dsn), ("session pooler", pgbouncer("session").dsn),
                      ("transaction pooler", pgbouncer("transaction").dsn)):
        conn = await asyncpg.connect(dsn, statement_cache_size=0)
        try:
            answers[name] = await server_session(conn)
        finally:
            await conn.close()
    assert answers == {"tcp": True, "unix": True, "session pooler": False, "transaction pooler": False}


# --- a takeover waits until the previous holder's app is surely stopped ----------------------------


@pytest.mark.parametrize(
    ("unreleased", "expiry_left", "stop_bound", "wait"),
    [
        pytest.param(False, 5.0, None, 0.0, id="released: at once"),
        pytest.param(True, 5.0, None, 5.0, id="not released, no bound: until its expiry"),
        pytest.param(True, 5.0, 1.5, 1.5, id="not released, exec gate: its stop bound"),
        pytest.param(True, 0.4, 1.5, 0.4, id="never past its expiry"),
        pytest.param(True, -2.0, None, 0.0, id="expired long ago (a stalled holder replaced)"),
        pytest.param(True, None, None, 0.0, id="never held"),
    ],
)
def test_takeover_wait(unreleased: bool, expiry_left: float | None, stop_bound: float | None, wait: float) -> None:
    assert takeover_wait(unreleased=unreleased, expiry_left=expiry_left, stop_bound=stop_bound) == wait


@pytest.mark.parametrize(("stop_bound", "low", "high"), [(0.3, 0.25, 0.6), (None, 9.0, 10.1)],
                         ids=["declared stop bound", "no bound: the lease"])
async def test_a_takeover_after_a_lost_session_waits_for_the_old_app(
        make_backend: Factory, pg_admin_dsn: str, stop_bound: float | None, low: float, high: float) -> None:
    """The server frees a session lock the instant the session ends (pg_terminate_backend, a
    restart, a dropped connection), while the old holder's app may still be stopping."""
    holder, standby = make_backend(stop_bound=stop_bound), make_backend()
    await acquired(holder, "a")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    assert await admin_fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid) is True
    taken = await acquired(standby, "b", timeout=2)
    assert low < taken.acting_from - time.monotonic() < high


async def test_a_takeover_after_a_release_acts_at_once(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    term = await acquired(holder, "a")
    await holder.release(term, timeout=2)
    taken = await acquired(standby, "b", timeout=2)
    assert taken.acting_from <= time.monotonic()


@pytest.mark.parametrize(("new_identity", "prefix", "acts_at_once"), [
    ("pod-a/0a1b2c3d/22222222", "pod-a/0a1b2c3d/", True),
    ("pod-a/0a1b2c3d/22222222", None, False),  # not declared its pod's sole candidate
], ids=["own predecessor", "not sole in its pod"])
async def test_a_restarted_sole_candidate_acts_at_once_after_its_own_predecessor(
        make_backend: Factory, pg_admin_dsn: str, new_identity: str, prefix: str | None,
        acts_at_once: bool) -> None:
    """Its earlier incarnation in the same pod held the lock and died (the session ended, no
    release): its only app is this pod's own, so no wait for it to stop."""
    holder = make_backend()
    await acquired(holder, "pod-a/0a1b2c3d/11111111")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    assert await admin_fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid) is True
    taken = await acquired(make_backend(predecessor_prefix=prefix), new_identity, timeout=2)
    wait = taken.acting_from - time.monotonic()
    if acts_at_once:
        assert wait <= 0
    else:
        assert wait > 5.0  # the rest of the 10 s lease: no stop bound declared


async def test_another_pods_sole_candidate_leaves_the_lock_to_the_restarted_holder(
        make_backend: Factory, pg_admin_dsn: str) -> None:
    """The holder's session ended without a release (its sidecar was killed). A standby of
    another pod gets the lock at once but must not act for the rest of the old lease (no stop
    bound declared): it gives the lock back rather than sit on it, so the holder's restarted
    incarnation, which may act at once, takes its own term without waiting for the standby."""
    holder = make_backend()
    old = await acquired(holder, "pod-a/0a1b2c3d/11111111")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    assert await admin_fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid) is True
    standby = make_backend(predecessor_prefix="pod-b/99999999/")
    started = time.monotonic()
    waiting = asyncio.create_task(standby.acquire(Identity("pod-b/99999999/22222222"), timeout=2.0))
    await asyncio.sleep(0.3)
    restarted = make_backend(predecessor_prefix="pod-a/0a1b2c3d/")
    begun = time.monotonic()
    term = await acquired(restarted, "pod-a/0a1b2c3d/33333333", timeout=2.0)
    assert time.monotonic() - begun < 0.5, "the standby sat on the lock"
    assert term.acting_from <= time.monotonic() and term.token > old.token
    seen = await waiting
    assert not isinstance(seen, Term), seen
    assert seen.holder == "pod-a/0a1b2c3d/11111111" and seen.token == old.token
    assert time.monotonic() - started > 1.5  # it used its attempt's budget, as a lock wait does


async def test_another_pods_sole_candidate_takes_over_once_the_old_app_is_stopped(
        make_backend: Factory, pg_admin_dsn: str) -> None:
    """No restarted holder comes: the standby that gave the lock back takes the term once the
    old holder's app is surely stopped (its stop bound, here 0.4 s), and acts at once then: no
    later than a standby that sat on the lock would have."""
    holder = make_backend(stop_bound=0.4)
    old = await acquired(holder, "pod-a/0a1b2c3d/11111111")
    pid = await holder_pid(pg_admin_dsn, holder.group)
    assert await admin_fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid) is True
    ended = time.monotonic()
    term = await acquired(make_backend(predecessor_prefix="pod-b/99999999/"), "pod-b/99999999/22222222", timeout=2.0)
    took = time.monotonic() - ended
    assert 0.35 < took < 0.9, f"took over after {took:.2f}s"
    assert term.acting_from <= time.monotonic() and term.token > old.token


async def test_a_force_release_whose_session_does_not_end_fails(
        make_backend: Factory, pg_dsn: str, postgres_server: PostgresServer | None) -> None:
    """A holder's server process that cannot act on ``pg_terminate_backend`` (stopped here with
    SIGSTOP, as a hung backend would be) keeps its lock: the release says it failed, within its
    timeout, rather than "ended"."""
    if postgres_server is None:
        pytest.skip("the server's processes are not ours to stop")
    holder = make_backend()
    await acquired(holder, "a")
    assert holder._conn is not None
    backend_pid = holder._conn.get_server_pid()
    conn = await asyncpg.connect(pg_dsn)
    os.kill(backend_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(ForceReleaseFailed, match=r"had not ended within 0.5s: it keeps its lock"):
            await force_release(conn, holder.group, sql=SQL, timeout=0.5)
        assert time.monotonic() - started < 2.0
    finally:
        os.kill(backend_pid, signal.SIGCONT)
        await conn.close()


async def test_a_force_release_ends_the_holders_session(make_backend: Factory, pg_dsn: str) -> None:
    """``kubectl singleton release``'s PostgreSQL step (session mode), as the operator carries it out."""
    holder = make_backend()
    conn = await asyncpg.connect(pg_dsn)
    try:
        with pytest.raises(ForceReleaseFailed, match=r"no lock table \S*no_such_table\S* in this database"):
            await force_release(conn, holder.group, sql=Statements.build("public", "no_such_table"), timeout=5)
        await acquired(make_backend(group=unique()), "other")  # the table exists, with another group's row
        assert await force_release(conn, holder.group, sql=SQL, timeout=5) == "no PostgreSQL holder"
        await acquired(holder, "a")
        assert await force_release(conn, holder.group, sql=SQL, timeout=5) == "ended the PostgreSQL session of holder a"
        assert await force_release(conn, holder.group, sql=SQL, timeout=5) == \
            "the session of PostgreSQL holder a had ended already"
    finally:
        await conn.close()
