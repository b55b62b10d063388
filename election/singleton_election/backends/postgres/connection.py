"""What the PostgreSQL backend's lock connection must be: a session of its own, with the
settings the backend depends on. Used by ``backends.postgres.session_mode`` when it opens that connection.

- ``check_session`` refuses a connection pooler in transaction or statement mode, which
  hands a server session (and the advisory lock in it) to other clients between
  transactions, so two sidecars could hold one lock. It raises ``BackendMisconfigured``
  (never retried: the sidecar exits with the message).
- ``session_settings``: server-side timeouts off, ``synchronous_commit`` on and TCP
  keepalives, set with one statement after connecting (poolers refuse such startup
  parameters, older servers unknown ones).
- ``ensure_schema``: the tables and sequences, created on first use (both modes, session and
  pooled: one explicit transaction under a transaction-level advisory lock, which a
  transaction pooler carries).
- ``DB_ERRORS``, ``lock_record`` and ``close_connection``: what both modes' backends share
  about their connections and the group's row.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, NoReturn, TypeAlias

import asyncpg

from singleton_election.backends.postgres.sql import (
    DDL_LOCK_ID,
    NAMESPACE,
    PROBE_SETTING,
    SCHEMA_VERSION,
    SessionProbe,
    Statements,
    same_tcp_connection,
)
from singleton_election.core.lock import BackendMisconfigured, BackendUnavailable, Identity, LockRecord, Token

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[asyncpg.Record]

log = logging.getLogger(__name__)

DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
"""What a failure to reach or use the server raises (asyncpg's and the socket's)."""

KEEPALIVE_MARGIN = 1.0
KEEPALIVE_INTERVAL = 1
KEEPALIVE_COUNT = 3

PROBE_ROUNDS = 3
"""Rounds of the session-setting probe behind a pooler (``check_session``)."""


def keepalive_settings(renew_deadline: float) -> dict[str, str]:
    """Server-side keepalives that drop a silent client only after ``renew_deadline`` + margin."""
    idle = max(1, math.ceil(renew_deadline + KEEPALIVE_MARGIN))
    return {
        "tcp_keepalives_idle": str(idle),
        "tcp_keepalives_interval": str(KEEPALIVE_INTERVAL),
        "tcp_keepalives_count": str(KEEPALIVE_COUNT),
    }


def session_settings(renew_deadline: float, server_major: int) -> dict[str, str]:
    """Everything the lock's session must have, whatever the role or database sets.

    Server-side timeouts are off: asyncio bounds every call on the client, while a
    ``statement_timeout`` would cancel a standby's lock wait, a ``lock_timeout`` would fail a
    renewal queued behind a row lock, and an idle timeout would end the holder's session
    (and free its lock) between renewals. ``idle_session_timeout`` exists from PostgreSQL 14
    on; setting it on an older server would fail.

    ``synchronous_commit`` is on: a take or renewal acknowledged and then lost in a server crash
    would leave the row an older token floor, or an older expiry, which a standby's takeover
    wait counts from while the holder acted on the lost renewal's deadline.
    """
    settings = keepalive_settings(renew_deadline)
    settings.update(statement_timeout="0", lock_timeout="0", idle_in_transaction_session_timeout="0",
                    synchronous_commit="on")
    if server_major >= 14:
        settings["idle_session_timeout"] = "0"
    return settings


async def check_session(
    conn: Connection, *, group: str, second: Callable[[], AbstractAsyncContextManager[Connection]]
) -> None:
    """Raise ``BackendMisconfigured`` unless ``conn`` is a server session of its own.

    A connection to the server itself proves itself (``server_session``). Otherwise (a
    pooler, or a proxy that rewrites the addresses) the probe marks this session (a
    session-level setting holding a nonce and the backend pid) and checks, each in its own
    statement and so its own transaction:

    1. this connection still sees its mark (a round-robin pooler with two idle server
       connections moves the next statement elsewhere; one that resets a server connection
       after each transaction wipes the mark);
    2. a ``second`` connection does not see it (a LIFO pooler, PgBouncer's default, gives the
       second client the server connection this one just left);
    3. this connection still sees it after that (a pooler that resets server connections
       between clients wiped it).

    A session-mode pooler passes all three by construction; a transaction pooler that other
    clients keep busy may route a round so that it passes too, so the probe runs
    ``PROBE_ROUNDS`` times and one failed round is enough (and the renewal, which names the
    holder's backend pid, fails at once if a later statement lands elsewhere). Only the
    simple query protocol is used: behind such a pooler, prepared statements would fail
    first, with a less clear error.
    """
    if await server_session(conn):
        return
    for _ in range(PROBE_ROUNDS):
        evidence = await _pooler_evidence(conn, second=second)
        if evidence is not None:
            _misconfigured(group, evidence)


async def server_session(conn: Connection) -> bool:
    """Whether ``conn`` is known to reach the server itself, with no pooler between: either its
    TCP connection is the one the server sees, or the backend pid the server announced at
    connect (the cancel key's pid, which the client keeps) is the pid of the backend that
    answers. A pooler answers the connect itself with a cancel key of its own (PgBouncer's is
    random), since its clients' cancel requests must come to it. False means "through a pooler
    or a proxy", whichever its mode."""
    if await _direct_tcp(conn):
        return True
    announced = conn.get_server_pid()
    if not isinstance(announced, int) or announced <= 0:
        return False
    # The simple query protocol: a prepared statement could fail first behind a pooler.
    return await conn.execute(f"SELECT 1 WHERE pg_backend_pid() = {announced}") == "SELECT 1"


async def _pooler_evidence(
    conn: Connection, *, second: Callable[[], AbstractAsyncContextManager[Connection]]
) -> str | None:
    """What one round of the probe of ``check_session`` saw of a transaction or statement
    pooler sharing ``conn``, or None if it saw nothing."""
    probe = SessionProbe(secrets.token_hex(16))
    await conn.execute(probe.mark)
    if await conn.execute(probe.still_mine) != "SELECT 1":
        return "a setting made on the connection was gone at its next statement"
    async with second() as other:
        seen = await other.execute(probe.seen_elsewhere)
    if seen != "SELECT 0":
        return "a second connection saw the first one's session setting"
    if await conn.execute(probe.still_mine) != "SELECT 1":
        return "a setting made on the connection was gone after another client connected"
    return None


async def _direct_tcp(conn: Connection) -> bool:
    # asyncpg has no public accessor for its socket; without one, the probe decides.
    transport = getattr(conn, "_transport", None)
    if transport is None:
        return False
    ours, theirs = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
    if not (isinstance(ours, tuple) and isinstance(theirs, tuple)):
        return False  # a Unix socket
    try:
        query = same_tcp_connection(ours[:2], theirs[:2])
    except ValueError:
        return False  # an address the check does not cover (an IPv6 zone)
    return await conn.execute(query) == "SELECT 1"


def _misconfigured(group: str, evidence: str) -> NoReturn:
    message = (
        f"postgres group {group!r}: the DSN reaches PostgreSQL through a connection pooler in "
        f"transaction or statement pooling mode ({evidence}; probe setting {PROBE_SETTING}), which could "
        "grant one session advisory lock to two sidecars: connect directly to PostgreSQL or use session "
        "pooling (PgBouncer: pool_mode = session), or keep the pooler and set SINGLETON_POSTGRES_MODE=pooled")
    log.error("%s", message, extra={"lock_key": group})
    raise BackendMisconfigured(message)


async def ensure_schema(conn: Connection, sql: Statements, group: str) -> None:
    """Create the backend's tables and sequences if missing (idempotent, concurrent-safe);
    raise ``BackendUnavailable`` for a layout newer than this sidecar knows."""
    names = (sql.leases, sql.version_table, sql.token_seq, sql.lock_id_seq)
    version: int | None = None
    if await conn.fetchval(sql.objects_exist, *names):
        version = await conn.fetchval(sql.read_schema_version)
    if version is None or version < SCHEMA_VERSION:
        async with conn.transaction():
            await conn.execute(sql.ddl_lock, NAMESPACE, DDL_LOCK_ID)
            if not await conn.fetchval(sql.schema_exists, sql.schema):
                await conn.execute(sql.create_schema)
            for statement in sql.create_objects:
                await conn.execute(statement)
            await conn.execute(sql.record_schema_version, SCHEMA_VERSION)
            version = await conn.fetchval(sql.read_schema_version)
        log.info("schema ready", extra={"lock_key": group, "table": sql.leases, "schema_version": version})
    if version is not None and version > SCHEMA_VERSION:
        raise BackendUnavailable(
            f"{sql.leases} has schema version {version}; this sidecar knows only {SCHEMA_VERSION}")


def lock_record(row: asyncpg.Record | None) -> LockRecord:
    """The group's row as a ``LockRecord`` (its holder only while ``live``; no row: free)."""
    if row is None:
        return LockRecord(holder=None, token=None)
    token = row["token"]
    holder = row["holder"] if row["live"] else None
    return LockRecord(
        holder=None if holder is None else Identity(holder),
        token=None if token is None else Token(token),
        version="" if token is None else str(token),
    )


async def close_connection(conn: Connection) -> None:
    """Close gracefully if that is quick, else abort (the server then frees the session's locks)."""
    try:
        await conn.close(timeout=1.0)
    except (*DB_ERRORS, TimeoutError) as exc:
        log.debug("closing a PostgreSQL connection failed, aborted it", extra={"error": exc})
        conn.terminate()
    except asyncio.CancelledError:
        conn.terminate()
        raise


ACQUIRE_GUARD_SLACK = 0.5
"""Seconds an acquisition's guard allows past its budget. An acquisition plans its waits to
end inside the budget and keeps a reserve for the statements after them, but on a loaded
machine those few round trips can overrun the reserve: a standby's answer a little late is
better than "unavailable". A server that does not answer is still reported, this much later."""


@asynccontextmanager
async def guarded(what: str, group: str, budget: float, *, schema_gone: Callable[[], None]) -> AsyncIterator[None]:
    """Bound a call by ``budget`` seconds; failures to reach the server become
    ``BackendUnavailable``; ``schema_gone`` is called when the table is missing (dropped)."""
    try:
        async with asyncio.timeout(budget):
            yield
    except TimeoutError as exc:
        raise BackendUnavailable(f"postgres {what} of group {group!r} timed out after {budget:g}s") from exc
    except DB_ERRORS as exc:
        if isinstance(exc, asyncpg.UndefinedTableError):
            schema_gone()
        raise BackendUnavailable(f"postgres {what} of group {group!r} failed: {exc!r}") from exc


@asynccontextmanager
async def short_lived(open_connection: Callable[[], Awaitable[Connection]]) -> AsyncIterator[Connection]:
    """A connection of its own for one look, closed after it."""
    conn = await open_connection()
    try:
        yield conn
    finally:
        await close_connection(conn)
