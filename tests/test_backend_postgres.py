"""PostgresBackend against the real PostgreSQL server of the test session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
import pytest_asyncio

from singleton_sidecar.backends.postgres import PostgresBackend, keepalive_settings
from singleton_sidecar.backends.postgres_sql import NAMESPACE
from singleton_sidecar.core.lock import BackendUnavailable, Identity, LockRecord, Term, Token
from singleton_testbed.postgres import PostgresServer

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]

HOLDER_SCRIPT = """
import asyncio, sys
from singleton_sidecar.core.lock import Identity
from singleton_sidecar.backends.postgres import PostgresBackend

async def main() -> None:
    group, dsn, lease, identity = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    backend = PostgresBackend(group=group, dsn=dsn, lease_duration=lease, renew_deadline=lease / 2)
    result = await backend.acquire(Identity(identity), timeout=10)
    print(getattr(result, "token", "none"), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def unique(prefix: str = "g") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


Factory = Callable[..., PostgresBackend]


@pytest_asyncio.fixture(loop_scope="function")
async def make_backend(pg_dsn: str) -> AsyncIterator[Factory]:
    """Backends for one test (default: one group); all closed at the end."""
    created: list[PostgresBackend] = []
    default_group = unique()

    def make(**kwargs: object) -> PostgresBackend:
        options: dict[str, object] = {
            "group": default_group, "dsn": pg_dsn, "lease_duration": 10.0, "renew_deadline": 5.0,
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


async def admin_fetchval(dsn: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


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


async def test_connection_settings(make_backend: Factory, pg_admin_dsn: str) -> None:
    backend = make_backend(lease_duration=15.0, renew_deadline=10.0)
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
    result = await standby.acquire(Identity("b"), timeout=0.3)
    elapsed = time.monotonic() - started
    assert result == LockRecord(holder=Identity("a"), token=term.token, version=str(term.token))
    assert 0.1 < elapsed < 1.0
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
    assert elapsed < 0.05, f"standby took {elapsed * 1000:.1f} ms after release"
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
    assert elapsed < 0.2, f"failover took {elapsed * 1000:.1f} ms"


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
    assert await holder.acquire(Identity("a"), timeout=0.2) == LockRecord(
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
    # and the session lock was given up with it
    taken = await acquired(standby, "b", timeout=2)
    assert taken.token > term.token
    assert await holder.renew(term, timeout=2) is None


async def test_stalled_holder_is_terminated_after_expiry(
    make_backend: Factory, holders: list[Holder], pg_dsn: str
) -> None:
    standby = make_backend(lease_duration=1.0, renew_deadline=0.5)
    holder = await Holder.start(standby.group, pg_dsn, lease=1.0)
    holders.append(holder)
    holder.signal(signal.SIGSTOP)
    started = time.monotonic()
    seen: list[Term | LockRecord] = []
    while time.monotonic() - started < 8:
        result = await standby.acquire(Identity("b"), timeout=0.3)
        seen.append(result)
        if isinstance(result, Term):
            break
    else:
        pytest.fail(f"standby never acquired: {seen}")
    elapsed = time.monotonic() - started
    assert isinstance(result, Term) and result.token > holder.token
    assert seen[0] == LockRecord(holder=Identity(f"proc-{standby.group}"), token=Token(holder.token),
                                 version=str(holder.token))
    assert elapsed < 4, f"took {elapsed:.2f}s"
    holder.signal(signal.SIGCONT)


async def test_cancelled_wait_leaves_backend_usable(make_backend: Factory) -> None:
    holder, standby = make_backend(), make_backend()
    first = await acquired(holder, "a")
    waiting = asyncio.create_task(standby.acquire(Identity("b"), timeout=10))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await standby.acquire(Identity("b"), timeout=0.2) == LockRecord(
        holder=Identity("a"), token=first.token, version=str(first.token))
    await holder.release(first, timeout=2)
    second = await acquired(standby, "b", timeout=2)
    assert second.token > first.token
    with pytest.raises(BackendUnavailable):
        await holder.acquire(Identity("a"), timeout=0.000001)


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
    terms = await asyncio.gather(*(acquired(b, f"c{i}", timeout=10) for i, b in enumerate(backends)))
    assert len({t.token for t in terms}) == 5
    again = make_backend(group=backends[0].group, schema=schema, table=table)
    assert (await again.observe(timeout=2)).holder == "c0"
    assert isinstance(await again.acquire(Identity("x"), timeout=0.2), LockRecord)
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
        PostgresBackend(group="g", dsn="postgresql://x", lease_duration=10, renew_deadline=5,
                        schema=schema, table=table)


def test_bad_timings_rejected() -> None:
    with pytest.raises(ValueError, match="renew_deadline"):
        PostgresBackend(group="g", dsn="postgresql://x", lease_duration=5, renew_deadline=5)


async def test_unreachable_server_is_backend_unavailable(make_backend: Factory, pg_dsn: str) -> None:
    dead = make_backend(dsn="postgresql://singleton@127.0.0.1:1/singleton", connect_timeout=1.0)
    with pytest.raises(BackendUnavailable) as caught:
        await dead.acquire(Identity("a"), timeout=2)
    assert caught.value.__cause__ is not None
    with pytest.raises(BackendUnavailable):
        await dead.observe(timeout=2)
