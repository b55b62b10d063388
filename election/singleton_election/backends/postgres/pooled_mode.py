"""PostgreSQL lock backend, pooled mode: a term is the group's row, valid until an expiry
taken from the DATABASE clock, written in single short statements that work through a
connection pooler in transaction mode (PgBouncer ``pool_mode = transaction``, RDS Proxy).

Why a second mode: the session mode (``backends.postgres.session_mode``) holds an advisory lock on one
dedicated connection per sidecar, leader and standbys alike, which no transaction pooler can
carry and which fills a default server (``max_connections`` 100) at about 32 groups of 3.
Here nothing lives in a session, so a pooler can share a few server connections among
thousands of sidecars; the price is that a crashed holder is replaced only after its row
expires (the lease duration), not the instant its session ends.

- **A term** is the row of ``singleton_leases`` (the session mode's table and row, so a group
  switched between modes keeps its token floor): ``holder``, ``token``, ``expires_at``;
  ``holder_pid`` is NULL (no session holds anything), which is how the session mode tells a
  pooled holder apart.
- **Taking** is one ``UPDATE`` that succeeds only if the row is free (released), expired by
  the database's ``now()``, or held by this very identity (an earlier acquisition of ours
  whose answer was lost) or by this container's own earlier incarnation in the same pod
  (``predecessor_prefix``). Row locking serialises racing candidates: the loser re-checks the
  row the winner committed and matches nothing. The token is the rule of every backend,
  ``greatest(<row's token> + 1, <database clock in ms>)``, committed with ``synchronous_commit``
  on (``set_config(..., true)``: transaction-local, like ``SET LOCAL``).
- **Renewing** is one ``UPDATE ... WHERE holder AND token AND expires_at > now()``, committed
  with ``synchronous_commit`` on like the take (a renewal acknowledged, then lost in a crash,
  would leave the older expiry, at which a standby takes over while the holder acts on); no row
  means the term is gone (taken over, or expired: a renewal that reached the server after
  the expiry comes from a holder already past its own deadline). **Releasing** clears the
  holder and sets ``expires_at = now()``, so the next standby check takes over.
- **S1**: the leader's renew deadline counts from just before it sent its last successful
  renewal; that renewal set ``expires_at`` from the server's clock at a later instant, plus the
  lease duration. A standby takes the row only once ``expires_at <= now()``. So the leader
  stops ``lease_duration - renew_deadline`` (or more) before anyone may take over, measured on
  one clock's rate, the database's (a clock stepped forward on the database server shortens
  that margin; use a slewing NTP, as for any lease).
- **Connections**: what counts is server sessions (``max_connections``), and a standby holds
  none between its checks. Which connection that takes depends on what the DSN reaches, so
  the first connection is asked once whether it reaches the server itself
  (``connection.server_session``: the backend pid announced at connect is the one that
  answers, which no pooler's is). One that does is opened for each check and closed after
  it; one through a pooler is kept, since behind a transaction pooler an idle client
  connection holds no server connection, and reconnecting every check would cost each
  standby a TCP handshake and a password exchange (about 1.5 to 3 ms of CPU, which for 2,000
  standbys polling every 2 s is a CPU core) for nothing. (Telling a transaction pooler from
  a session pooler by what it does is not certain while other clients keep it busy; a
  session pooler is not what this mode is for, and there the kept connection holds one
  server connection per sidecar, as the session mode does.) The leader keeps its connection
  for its renewals either way (one every retry period) and, on a server session, closes it
  when its term ends. A lost
  connection is not a lost term: the next renewal reconnects, and only the renew deadline
  ends the term. So PgBouncer restarts and ``pg_terminate_backend`` cost nothing if they
  heal within the renew deadline.
- **Pooler rules** kept: no session state (no advisory locks, no session ``SET``: only
  ``set_config(..., true)`` inside the statement), no prepared statements kept across
  transactions (``statement_cache_size=0``: asyncpg then uses unnamed statements, which
  PgBouncer before 1.21 passes through in transaction mode). The frequent statements (the
  take of every check, the renewal, the release) go in one message each, with the simple
  query protocol and their values quoted here: asyncpg's extended protocol takes two round
  trips (Parse/Describe, then Bind/Execute/Sync), and a transaction pooler keeps the server
  connection assigned to the client in between, across any pause of the client, which for
  thousands of busy clients drains the pool. The command tag (``UPDATE 1``) is the row count.
- **Standbys poll**: every acquire call checks once (the take), then sleeps the rest of its
  budget (the elector passes the retry period), or only until the holder's expiry if that
  comes sooner, and checks again then. The row is read (holder, token, expiry: what the
  standby reports and when to check again) only when what was last read may be out of date:
  never read, or its expiry has passed; so a standby reports a new leader within a lease
  duration. ``LISTEN``/``NOTIFY`` would wake them on a release, but a
  listener is session state that a transaction pooler cannot carry, so a release is taken
  over at the next check (within a retry period).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeAlias

import asyncpg

from singleton_election.backends.postgres.connection import (
    ACQUIRE_GUARD_SLACK,
    close_connection,
    ensure_schema,
    guarded,
    lock_record,
    server_session,
    short_lived,
)
from singleton_election.backends.postgres.sql import NAMESPACE, Statements, application_name
from singleton_election.core.lock import (
    Identity,
    LockRecord,
    LossCallback,
    Term,
    Token,
)
from singleton_election.core.timings import Timings

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[asyncpg.Record]

log = logging.getLogger(__name__)

_EXPIRY_SLACK = 0.005  # seconds a standby sleeps past the holder's expiry before checking again
_RETURN_RESERVE = 0.01  # seconds of an acquire's budget left when a standby's call returns


@dataclass(frozen=True)
class PooledStatements:
    """The pooled mode's statements on the tables of ``Statements`` (same names, same rows)."""

    names: Statements

    def take(self, group: str, identity: str, lease_seconds: float, predecessor_prefix: str | None) -> str:
        """One row updated if the row is free, expired, ours, or our predecessor's (simple
        query protocol, like the renewal: see below)."""
        predecessor = ("" if predecessor_prefix is None else
                       f" OR left(r.holder, {len(predecessor_prefix)}) = {_text(predecessor_prefix)}")
        return (
            "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true) AS applied)"
            f" UPDATE {self.names.leases} r SET holder = {_text(identity)}, holder_pid = NULL,"
            " token = greatest(coalesce(r.token, 0) + 1, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint),"
            " transitions = r.transitions + 1, acquired_at = now(), renewed_at = now(),"
            f" expires_at = now() + make_interval(secs => {_seconds(lease_seconds)}), released_at = NULL,"
            " stop_bound = NULL FROM durable d"
            f" WHERE r.group_name = {_text(group)} AND d.applied = 'on' AND (r.holder IS NULL"
            f" OR r.expires_at IS NULL OR r.expires_at <= now() OR r.holder = {_text(identity)}{predecessor})"
            # Not while a session-mode sidecar holds the group's advisory lock (a group moving
            # between modes): transaction-level, so a transaction pooler carries it.
            f" AND pg_try_advisory_xact_lock({NAMESPACE}, r.lock_id::int4)"
        )

    @property
    def taken(self) -> str:
        """$1 group, $2 identity: the token of the term just taken."""
        return f"SELECT token FROM {self.names.leases} WHERE group_name = $1 AND holder = $2"

    # The renewal and the release are sent with the simple query protocol, their values quoted
    # into the text here: one message and one answer, where asyncpg's extended protocol takes two
    # round trips (Parse/Describe, then Bind/Execute/Sync) and a transaction pooler keeps the
    # server connection assigned between them, across any pause of the client. The command tag
    # ("UPDATE 1" or "UPDATE 0") is the row count that says whether the term is still ours.

    def renew(self, group: str, identity: str, token: int, lease_seconds: float) -> str:
        """One row updated only if the term is still ours and unexpired; committed with
        ``synchronous_commit`` on, as the take: a renewal acknowledged and then lost in a server
        crash would leave the older expiry, at which a standby takes over while the holder acts
        on until the lost renewal's deadline."""
        return (
            "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true) AS applied)"
            f" UPDATE {self.names.leases} r SET renewed_at = now(),"
            f" expires_at = now() + make_interval(secs => {_seconds(lease_seconds)}) FROM durable d"
            f" WHERE r.group_name = {_text(group)} AND r.holder = {_text(identity)} AND r.token = {int(token)}"
            " AND r.expires_at > now() AND d.applied = 'on'"
        )

    def release(self, group: str, identity: str, token: int) -> str:
        """Free now, for the next standby check."""
        return (
            f"UPDATE {self.names.leases} SET holder = NULL, holder_pid = NULL, released_at = now(),"
            f" expires_at = now() WHERE group_name = {_text(group)} AND holder = {_text(identity)}"
            f" AND token = {int(token)}"
        )

    @property
    def observe(self) -> str:
        """$1 group. The holder counts while its row is unexpired by the database clock."""
        return (
            "SELECT holder, token, coalesce(expires_at > now(), false) AS live,"
            " extract(epoch FROM expires_at - now())::float8 AS expiry_left"
            f" FROM {self.names.leases} WHERE group_name = $1"
        )


def _text(value: str) -> str:
    """A text literal that means ``value`` whatever ``standard_conforming_strings`` says."""
    if "\0" in value:
        raise ValueError("a PostgreSQL text value cannot hold a NUL character")
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _seconds(value: float) -> str:
    if not (isinstance(value, int | float) and math.isfinite(value)):
        raise ValueError(f"not a number of seconds: {value!r}")
    return repr(float(value))


class PooledPostgresBackend:
    """Lock backend for one group through a transaction pooler; see the module docstring."""

    def __init__(
        self,
        *,
        group: str,
        dsn: str,
        timings: Timings,
        connect_timeout: float = 5.0,
        schema: str = "public",
        table: str = "singleton_leases",
        clock: Callable[[], float] = time.monotonic,
        predecessor_prefix: str | None = None,
    ) -> None:
        """``predecessor_prefix``: this pod's identity prefix when the sidecar is its group's
        sole candidate in the pod: a row held by its own earlier incarnation (which the kubelet
        replaced, so it is dead) is taken over without waiting for its expiry."""
        if not group:
            raise ValueError("group must not be empty")
        if connect_timeout <= 0:
            raise ValueError("connect_timeout must be positive")
        self.group = group
        self.timings = timings  # checked by Timings itself (core.timings.check_timings)
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        self._clock = clock
        self._names = Statements.build(schema, table)
        self._sql = PooledStatements(self._names)
        self._predecessor_prefix = predecessor_prefix
        self._server_settings = {"application_name": application_name(group)}
        self._conn: Connection | None = None  # kept while a term is held, or always behind a transaction pooler
        self._through_pooler: bool | None = None  # a pooler's client connection (None: not asked yet)
        self._term: Term | None = None
        self._schema_ready = False
        self._seen: LockRecord | None = None  # the row as last read, for the standby's reports
        self._seen_until = 0.0  # local time at which that row's expiry passes
        self._busy = asyncio.Lock()  # one statement at a time on the kept connection
        self._on_loss: LossCallback | None = None

    @property
    def lease_duration(self) -> float:
        """Seconds a row stays valid without a renewal (``timings.lease_duration``)."""
        return self.timings.lease_duration

    @property
    def renew_deadline(self) -> float:
        """Seconds the holder tries to renew before stepping down (``timings.renew_deadline``)."""
        return self.timings.renew_deadline

    @property
    def name(self) -> str:
        return "postgres"

    @property
    def holds_connection(self) -> bool:
        """Whether a connection is kept open now (a term is held, or it is a pooler's client
        connection, which behind a transaction pooler holds no server connection while idle)."""
        return self._conn is not None and not self._conn.is_closed()

    @property
    def through_pooler(self) -> bool | None:
        """Whether the first connection went through a pooler (None: not connected yet)."""
        return self._through_pooler

    def set_loss_callback(self, callback: LossCallback) -> None:
        # Nothing tells this mode asynchronously that its term is gone (no session holds it):
        # a renewal that matches no row, or the renew deadline, ends it.
        self._on_loss = callback

    def _fields(self, **more: object) -> dict[str, object]:
        """The fields of this backend's log lines: its lock key, then ``more``."""
        return {"lock_key": self.group, **more}

    # -- the interface ---------------------------------------------------------------

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        deadline = self._clock() + timeout
        async with self._guard("acquire", timeout + ACQUIRE_GUARD_SLACK):
            while True:
                async with self._busy:
                    if self._term is not None:
                        # The elector campaigns only once a term has ended: this one was left
                        # unreleased (its app not confirmed stopped, after which the elector waits
                        # a lease duration). The row names us until it expires; the attempt retakes it.
                        log.info("campaigning again: forgetting an unreleased term",
                                 extra=self._fields(identity=identity, token=self._term.token))
                        self._term = None
                    result, expiry_left = await self._attempt(identity, deadline)
                if isinstance(result, Term):
                    return result
                remaining = deadline - self._clock()
                if expiry_left is None or expiry_left + _EXPIRY_SLACK >= remaining:
                    break
                # The holder's row expires within this call's budget: check again right then.
                await asyncio.sleep(max(expiry_left, 0.0) + _EXPIRY_SLACK)
        # The next check is the elector's next call, a retry period from this one; this call
        # returns just inside its budget. The wait is outside the guard: a loop woken late
        # would otherwise let the guard's timeout fire first and turn a standby's answer into
        # "unavailable".
        await asyncio.sleep(max(deadline - self._clock() - _RETURN_RESERVE, 0.0))
        return result

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        deadline = self._clock() + timeout
        async with self._guard("renew", timeout), self._busy:
            if term != self._term:
                log.info("cannot renew: not held here", extra=self._fields(identity=term.identity, token=term.token))
                return None
            conn = await self._connection(deadline)
            sent = self._clock()  # the deadline counts from before the write: early, never late
            try:
                status = await conn.execute(self._sql.renew(self.group, term.identity, term.token,
                                                            self.timings.lease_duration))
            except BaseException:
                self._drop_connection("renewal failed; the term stands until the renew deadline")
                raise
            if status != "UPDATE 1":
                log.warning("renewal matched no row: taken over or expired",
                            extra=self._fields(identity=term.identity, token=term.token))
                self._term = None
                await self._idle()
                return None
            renewed = replace(term, written_at=sent)
            self._term = renewed
            return renewed

    async def release(self, term: Term, *, timeout: float) -> None:
        deadline = self._clock() + timeout
        async with self._guard("release", timeout), self._busy:
            if term != self._term:
                log.debug("release: not held here", extra=self._fields(identity=term.identity, token=term.token))
                return
            try:
                conn = await self._connection(deadline)
                await conn.execute(self._sql.release(self.group, term.identity, term.token))
            except BaseException:
                self._term = None  # never renewed again: the row frees itself at its expiry
                self._drop_connection("release failed; the row frees itself at its expiry")
                raise
            self._term = None
            await self._idle()
            log.info("released the lock", extra=self._fields(identity=term.identity, token=term.token))

    async def observe(self, *, timeout: float) -> LockRecord:
        deadline = self._clock() + timeout
        async with self._guard("observe", timeout):
            if self.holds_connection and not self._busy.locked():
                async with self._busy:
                    conn = await self._connection(deadline)
                    try:
                        row = await conn.fetchrow(self._sql.observe, self.group)
                    except BaseException:
                        self._drop_connection("observe failed on the kept connection")
                        raise
            else:
                async with self._short_lived(deadline) as conn:
                    try:
                        row = await conn.fetchrow(self._sql.observe, self.group)
                    except asyncpg.UndefinedTableError:
                        row = None
        return lock_record(row)

    async def current_leader(self, *, timeout: float = 5.0) -> LockRecord:
        """Who leads the group now, with which token (an ``observe``)."""
        return await self.observe(timeout=timeout)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._term = None
        if conn is None:
            return
        if self._busy.locked():
            conn.terminate()
        else:
            await close_connection(conn)

    # -- steps -----------------------------------------------------------------------

    async def _attempt(self, identity: Identity, deadline: float) -> tuple[Term | LockRecord, float | None]:
        """One check: the new term, or the holder and the seconds until its row expires (None:
        no expiry to wait for). The check itself is one message (the take); the row is read
        (two round trips) only when what was last read of it may be out of date: never read,
        or its expiry has passed (the holder renewed since, crashed, or released)."""
        conn = await self._connection(deadline)
        try:
            if not self._schema_ready:
                await ensure_schema(conn, self._names, self.group)
                self._schema_ready = True
            for _ in range(2):
                sent = self._clock()
                status = await conn.execute(self._sql.take(self.group, identity, self.timings.lease_duration,
                                                           self._predecessor_prefix))
                token = None
                if status == "UPDATE 1":
                    token = await conn.fetchval(self._sql.taken, self.group, identity)
                elif self._seen is None or self._clock() >= self._seen_until:
                    row = await conn.fetchrow(self._sql.observe, self.group)
                    if row is None:  # the group's first use: create its row and take it
                        await conn.execute(self._names.insert_group, self.group, self._names.lock_id_seq,
                                           application_name(self.group), NAMESPACE)
                        continue
                    self._seen = lock_record(row)
                    self._seen_until = self._clock() + max(row["expiry_left"] or 0.0, 0.0)
                break
        except BaseException:
            self._drop_connection("a check failed")
            raise
        if token is None:
            await self._idle()
            record = self._seen or LockRecord(holder=None, token=None)
            left = self._seen_until - self._clock()
            return record, (left if record.holder is not None and left > 0 else None)
        self._seen = None
        term = Term(identity=identity, token=Token(token), version=str(token), written_at=sent,
                    acting_from=self._clock())
        self._term = term  # the connection stays for the renewals
        log.info("acquired the lock", extra=self._fields(identity=identity, token=token))
        return term, None

    # -- connections -----------------------------------------------------------------

    async def _connection(self, deadline: float) -> Connection:
        """The kept connection, or a new one (the first is asked whether it reaches the server
        itself: see the module docstring)."""
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        conn = await self._open(deadline)
        if self._through_pooler is None:
            try:
                self._through_pooler = not await server_session(conn)
            except BaseException:
                conn.terminate()
                raise
            log.info("a pooler's connection: kept between checks"
                     if self._through_pooler else "a server session: opened for each check", extra=self._fields())
        self._conn = conn
        return conn

    async def _idle(self) -> None:
        """No term held: give up a connection that is a server session of its own."""
        if self._through_pooler or self._conn is None:
            return
        conn, self._conn = self._conn, None
        await close_connection(conn)

    def _short_lived(self, deadline: float) -> AbstractAsyncContextManager[Connection]:
        """A connection of its own for one look, closed after it."""
        return short_lived(lambda: self._open(deadline))

    async def _open(self, deadline: float) -> Connection:
        budget = max(0.001, min(self._connect_timeout, deadline - self._clock()))
        # No statement cache: a named prepared statement lives in one server session, which a
        # transaction pooler hands to other clients between transactions.
        conn: Connection = await asyncpg.connect(
            self._dsn, timeout=budget, server_settings=self._server_settings, statement_cache_size=0)
        return conn

    def _drop_connection(self, reason: str) -> None:
        """Close the kept connection at once (its state is unknown, or it is no longer needed)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            log.debug("closed the kept connection", extra=self._fields(reason=reason))
            conn.terminate()

    def _guard(self, what: str, budget: float) -> AbstractAsyncContextManager[None]:
        """Bound a call by ``budget`` seconds; failures to reach the server become BackendUnavailable."""
        return guarded(what, self.group, budget, schema_gone=self._schema_gone)

    def _schema_gone(self) -> None:
        self._schema_ready, self._seen = False, None
