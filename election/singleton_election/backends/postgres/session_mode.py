"""PostgreSQL lock backend: a session advisory lock for exclusion, a table for the record.

Design (the server is the authority; its clock decides expiry):

- **Exclusion** is a session-level advisory lock, two-int form
  ``pg_advisory_lock(NAMESPACE, lock_id)``, held on ONE dedicated connection per backend
  (never a pool: a session lock belongs to the session). Two-int keys never collide with an
  application's bigint-form locks, and ``lock_id`` is unique per group (assigned once from a
  sequence), so groups never block each other. A row deleted while its lock is held comes
  back under that lock id, not a new one on which a second holder could lead
  (``Statements.insert_group``). The server frees the lock the instant the
  holder's session ends (crash, SIGKILL, ``pg_terminate_backend``, server restart).
- **Standbys** wait with a *blocking* ``pg_advisory_lock`` under ``lock_timeout`` bounded by
  the call's timeout (set back to 0 right after the wait): no polling, they wake as soon as
  the lock frees. On 55P03 the standby
  reads the row; if the lease has expired by ``now()`` while the recorded holder's session
  still holds the lock (``pg_locks``), that holder is stalled (SIGSTOP keeps its TCP alive)
  and the standby ends its session with ``pg_terminate_backend`` (allowed for the same role).
  By then the stalled holder has passed its renew deadline (< lease duration) and stepped down.
  A wait ends early, at the live holder's expiry as last read, when that comes first; and a
  standby that ended a session waits for the lock again in the same call: it takes over at the
  expiry, not a call later.
- **The record** (table ``<schema>.<table>``, one row per group) says who holds the lock,
  since when, until when (``expires_at``), and with which **token**. Tokens are a hybrid
  logical clock, the rule of every backend: a new term's token is the greatest of the
  group's previous token + 1 and the store's clock in milliseconds since the epoch (here
  also the next value of the table's token sequence, which the same statement advances past
  the token when it lags). So tokens of a group strictly increase whatever the clocks do,
  and a group switched from the Lease backend (wall-clock-ms tokens, same fence key) starts
  above the Lease's tokens. The acquiring statement commits with ``synchronous_commit`` on,
  so a crash never reissues a token. The sequence is shared by groups and only a floor:
  tokens are unique per group, two groups may get the same one. Renewals and releases are
  conditional on holder and token (and, for renewals, on the holder's session) and check
  the row count: 0 rows means "not ours".
- **Stop before release**: a renewal that matches no row (the row was deleted, cleared or
  rewritten by someone) reports the term lost, and keeps the lock: the app acts until the
  elector has stopped it, and only the ``release`` that follows gives the lock back. An app
  never confirmed stopped is never released; then the next ``acquire`` (the elector's
  campaign, a lease duration later) gives the lock up once the term's lease has run out
  since its last renewal, as a standby would end an expired holder's session.
- **Session settings**: the sidecar sets what it depends on itself, right after connecting,
  whatever the role or database says: ``statement_timeout``, ``lock_timeout``,
  ``idle_in_transaction_session_timeout`` and (PostgreSQL >= 14) ``idle_session_timeout`` are
  0 (asyncio bounds every call on the client; a server-side one would cancel a standby's
  wait or end an idle holder's session), ``synchronous_commit`` is on (a renewal lost in a
  crash after its acknowledgement would leave an older expiry for the takeover wait), and
  the keepalives below. Only ``application_name`` travels in the startup packet, which
  poolers and old servers accept.
- **Poolers**: a pooler in transaction or statement mode hands a session (and its advisory
  lock) to other clients, so two sidecars could hold one lock. Before its first lock, a new
  connection must prove it is a session of its own: a direct TCP connection by the server
  seeing our socket's two ends, anything else by a probe (a session setting with a nonce
  that must stay on this connection and must not show on a second one; see
  ``connection.check_session``). Failing that raises ``BackendMisconfigured``, which is
  not wrapped in ``BackendUnavailable``: the sidecar exits rather than retry.
- **A holder that did not release** (its session ended under it) may still have an app
  stopping, so a standby that gets its lock acts only after that term's stop bound or expiry.
  When the sidecar is its group's sole candidate in its pod (``predecessor_prefix``), that
  holder may be a sidecar the kubelet is restarting in its own pod, which may take its own
  term at once (``core.identity.is_predecessor``). So such a standby does not sit on the lock
  for that wait: it gives the lock back and checks again once the old term's app is surely
  stopped, and the restarted holder, if it comes, takes its term meanwhile (about 1 s after a
  SIGKILL on a real node, instead of the old lease). It acts no earlier than before.
- **Schema**: created on first use under a transaction-level advisory lock (several sidecars
  may start at once), with ``<table>_schema_version`` recording the layout version. A role
  that only owns its database (no superuser) suffices.
- **Loss**: an asyncpg termination listener reports a dropped connection while a term is
  held through the loss callback at once; the next ``acquire`` reconnects. Every failure to
  reach the server is raised as ``BackendUnavailable``; a connection whose state is unknown
  after an error or cancellation is closed (the server frees its lock) and reopened later.
  Every such close while a term is held (a failed renewal, release or observe) reports the
  term lost through the callback too, since the server freed the lock at that moment.

Server-side TCP keepalives (``tcp_keepalives_*``, set after connecting by
``connection``) make the server drop a *partitioned* holder's session, freeing its
lock, only after that holder has stepped down.
The holder steps down ``renew_deadline`` after its last successful renewal; the server last
heard from it at that renewal and drops it ``idle + interval * count`` seconds later, with
``idle = ceil(renew_deadline + KEEPALIVE_MARGIN)``, ``interval = 1``, ``count = 3``:
total >= renew_deadline + 1 s + 3 s > renew_deadline + margin (e.g. renew_deadline 10 s:
idle 11 s, dropped after 14-15 s). Longer is always safe; the expiry check above bounds
failover for a holder that is slow rather than gone. Through a session-mode pooler the
keepalives watch the pooler's connection, not the sidecar's: the expiry check replaces a
partitioned holder there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, TypeAlias

import asyncpg

from singleton_election.backends.postgres.connection import (
    ACQUIRE_GUARD_SLACK,
    check_session,
    close_connection,
    ensure_schema,
    guarded,
    lock_record,
    session_settings,
    short_lived,
)
from singleton_election.backends.postgres.sql import NAMESPACE, Statements, application_name
from singleton_election.core.identity import is_predecessor
from singleton_election.core.lock import (
    BackendUnavailable,
    ForceReleaseFailed,
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

_LOCK_RESERVE_MAX = 0.5  # seconds of an acquire's budget kept for the work after the lock wait
_RETRY_MIN = 0.02  # seconds an acquire needs left to wait for the lock once more
_CHECK_SLACK = 0.005  # seconds past a live holder's expiry, or an unreleased one's stop, before checking again
_HOLD_OFF_MIN = 0.1  # a shorter wait for an unreleased holder's app is waited holding the lock


class PostgresBackend:
    """Lock backend for one group on a PostgreSQL server; see the module docstring."""

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
        stop_bound: float | None = None,
        predecessor_prefix: str | None = None,
    ) -> None:
        """``stop_bound``: seconds this holder's app may still act after its session ends
        (the exec gate's: its keeper kills the app's group at once when the sidecar dies or
        hears the lock is gone); None when only the lease's expiry bounds it (file gate,
        cooperative). ``predecessor_prefix``: this pod's identity prefix when the sidecar is
        its group's sole candidate in the pod: a term left by its own earlier incarnation is
        taken over without waiting (``core.identity.is_predecessor``)."""
        if not group:
            raise ValueError("group must not be empty")
        if connect_timeout <= 0:
            raise ValueError("connect_timeout must be positive")
        self.group = group
        self.timings = timings  # checked by Timings itself (core.timings.check_timings)
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        self._clock = clock
        self._sql = Statements.build(schema, table)
        self.stop_bound = stop_bound
        self._predecessor_prefix = predecessor_prefix
        # Only application_name goes in the startup packet: poolers refuse other startup
        # parameters, and older servers any they do not know. The rest is set after connecting.
        self._server_settings = {"application_name": application_name(group)}
        self._conn: Connection | None = None
        self._term: Term | None = None  # the term held on self._conn, if any
        # A term whose renewal matched no row: over, but its app may act until the elector
        # stops it, so its lock stays held until its release (or its lease has run out).
        self._ended: Term | None = None
        # When the live holder's lease runs out (local clock, from the row last read): a lock
        # wait ends then, to end that holder's session if it still holds the lock (stalled or
        # cut off) rather than at the end of the acquire's budget.
        self._holder_expiry_check = -math.inf
        self._held_off: tuple[int, float] | None = None  # (token, when its app is surely stopped) held off for
        self._held_lock_id = 0  # the advisory lock key of self._term
        self._lock_id: int | None = None
        self._reported_lock_pid: int | None = None  # a session reported holding the lock without a term
        self._schema_ready = False
        self._busy = asyncio.Lock()  # one operation at a time on the dedicated connection
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

    def set_loss_callback(self, callback: LossCallback) -> None:
        self._on_loss = callback

    def _fields(self, **more: object) -> dict[str, object]:
        """The fields of this backend's log lines: its lock key, then ``more``."""
        return {"lock_key": self.group, **more}

    # -- the interface ---------------------------------------------------------------

    async def acquire(self, identity: Identity, *, timeout: float) -> Term | LockRecord:
        deadline = self._clock() + timeout
        async with self._guard("acquire", timeout + ACQUIRE_GUARD_SLACK), self._busy:
            result, wait_out = await self._acquire_within(identity, deadline)
        if wait_out:
            # Waited out, as a lock wait would be. Outside the guard: a loop woken late would
            # otherwise let the guard's timeout fire first and turn the answer into "unavailable".
            await self._sleep_out(deadline)
        return result

    async def _acquire_within(self, identity: Identity, deadline: float) -> tuple[Term | LockRecord, bool]:
        """The acquisition's work: its answer, and whether the caller waits out the budget
        before returning it (one check per call, as a lock wait that timed out)."""
        conn = await self._connection(deadline)
        with self._closed_on_failure(conn):
            if self._term is not None:
                log.warning("asked to acquire while a term is held here",
                            extra=self._fields(identity=identity, holder=self._term.identity,
                                               token=self._term.token))
                return await self._read(conn), False
            if self._ended is not None and not await self._give_up_ended(conn):
                return await self._read(conn), True
            lock_id = await self._group_lock_id(conn)
        while True:
            with self._closed_on_failure(conn):
                if not await self._wait_for_lock(conn, lock_id, deadline):
                    record = await self._busy_record(conn, identity)
                    if self._may_wait_again(deadline):
                        continue
                    return record, False
            try:
                row = await conn.fetchrow(self._sql.under_lock, self.group, lock_id)
            except BaseException:
                self._discard(conn, "reading the row under the lock failed; closed the connection")  # frees the lock
                raise
            if (pooled := await self._pooled_holder(conn, lock_id, row)) is not None:
                return pooled, True
            held_off = await self._hold_off(conn, identity, lock_id, row)
            if held_off is None:
                return await self._take(conn, identity, lock_id), False
            record, wait = held_off
            remaining = deadline - self._clock()
            if wait + _CHECK_SLACK >= remaining - min(_LOCK_RESERVE_MAX, remaining * 0.2):
                return record, True
            await asyncio.sleep(wait + _CHECK_SLACK)
            conn = await self._connection(deadline)

    def _may_wait_again(self, deadline: float) -> bool:
        """After a lock wait that timed out: wait again within this call if the live holder's
        lease runs out before its end (to end that session then), or its session was just ended
        (the lock frees in a moment). A standby takes over then, not a retry period later."""
        check = self._holder_expiry_check
        return check > -math.inf and check + _RETRY_MIN < deadline and self._clock() + _RETRY_MIN < deadline

    @contextmanager
    def _closed_on_failure(self, conn: Connection) -> Iterator[None]:
        """A failure that leaves the connection's state unknown closes it (the server then frees
        any lock it held); a PostgreSQL error on a live connection leaves it open."""
        try:
            yield
        except BaseException as exc:
            if not (isinstance(exc, asyncpg.PostgresError) and not conn.is_closed()):
                self._discard(conn, "acquire failed; closed the lock's connection")
            raise

    async def _sleep_out(self, deadline: float) -> None:
        """Sleep until just inside an acquire's budget, as a lock wait that timed out would."""
        remaining = deadline - self._clock()
        await asyncio.sleep(max(remaining - min(_LOCK_RESERVE_MAX, remaining * 0.2), 0.0))

    async def _hold_off(self, conn: Connection, identity: Identity, lock_id: int,
                        row: asyncpg.Record | None) -> tuple[LockRecord, float] | None:
        """We hold the lock and read the ``row`` under it. If its last holder did not release
        and its app may act a while yet (``takeover_wait``), and that holder may be restarted
        in its pod (we are our pod's sole candidate, so every pod of the group runs so), give
        the lock back: (the old holder, the seconds until its app is surely stopped). None:
        take the term now."""
        if self._predecessor_prefix is None or row is None or not row["same_lock"]:
            return None
        holder = row["holder"]
        if holder is None or holder == identity or is_predecessor(holder, identity, self._predecessor_prefix):
            return None
        try:
            token = row["token"]
            first_seen = self._held_off is None or self._held_off[0] != token
            if first_seen:
                # The stop bound counts from the session's end, which was no later than now.
                wait = takeover_wait(unreleased=True, expiry_left=row["expiry_left"], stop_bound=row["stop_bound"])
                self._held_off = (token, self._clock() + wait)
            wait = self._stopped_at(token) - self._clock()
            if wait < _HOLD_OFF_MIN:
                return None
            await conn.execute(self._sql.unlock, NAMESPACE, lock_id)
        except BaseException:
            self._discard(conn, "checking the previous term failed; closed the connection")  # frees the lock
            raise
        if first_seen:
            log.info("the holder did not release: giving its lock back until its app is surely stopped,"
                     " for its restarted incarnation to take over meanwhile",
                     extra=self._fields(identity=identity, holder=holder, token=token, wait_seconds=round(wait, 3)))
        return LockRecord(holder=Identity(holder), token=Token(token), version=str(token)), wait

    def _stopped_at(self, token: int) -> float:
        """When the app of the unreleased term ``token`` is surely stopped, if we held off for it."""
        if self._held_off is None or self._held_off[0] != token:
            return -math.inf
        return self._held_off[1]

    async def renew(self, term: Term, *, timeout: float) -> Term | None:
        async with self._guard("renew", timeout), self._busy:
            conn = self._conn
            if term != self._term or conn is None or conn.is_closed():
                log.info("cannot renew: not held on a live connection",
                         extra=self._fields(identity=term.identity, token=term.token))
                return None
            try:
                sent = self._clock()  # the deadline counts from before the write: early, never late
                token = await conn.fetchval(
                    self._sql.renew, self.group, term.identity, term.token, self.timings.lease_duration)
                if token is not None:
                    renewed = replace(term, written_at=sent)
                    self._term = renewed
                    return renewed
                # Not unlocked here: the app acts until the elector stops it, then releases.
                log.warning("renewal matched no row: the term is lost; keeping the lock until the app has stopped",
                            extra=self._fields(identity=term.identity, token=term.token))
                self._term, self._ended = None, term
                return None
            except BaseException:
                # The server frees the lock with the session: the term ends now, not at the
                # elector's renew deadline.
                self._discard(conn, "renewal failed; closed the lock's connection, which frees the lock")
                raise

    async def release(self, term: Term, *, timeout: float) -> None:
        async with self._guard("release", timeout), self._busy:
            conn = self._conn
            if term not in (self._term, self._ended):
                log.debug("release: not held here", extra=self._fields(identity=term.identity, token=term.token))
                return
            if conn is None or conn.is_closed():
                self._term = self._ended = None
                return
            try:
                await conn.execute(self._sql.release, self.group, term.identity, term.token)
                await self._unlock_every_level(conn, term)
            except BaseException:
                # The term stays ours until here, so closing the session reports its loss.
                self._discard(conn, "release failed; closed the lock's connection, which frees the lock")
                raise
            self._term = self._ended = None
            log.info("released the lock", extra=self._fields(identity=term.identity, token=term.token))

    async def _give_up_ended(self, conn: Connection) -> bool:
        """Give up the lock of a term whose renewal matched no row and that was not released
        (its app not confirmed stopped), once its lease has run out since its last renewal:
        by then its app's own deadline stopped it. False while it has not."""
        ended = self._ended
        assert ended is not None
        if self._clock() < ended.written_at + self.timings.lease_duration:
            return False
        log.warning("giving up the lock of a lost term that was not released: its lease has run out",
                    extra=self._fields(identity=ended.identity, token=ended.token))
        await self._unlock_every_level(conn, ended)
        self._ended = None
        return True

    async def _unlock_every_level(self, conn: Connection, term: Term) -> None:
        """Give the lock back. Session advisory locks stack: a session that took it twice and
        gave it back once would keep every standby out while its row says "free", so the
        release checks and says so."""
        if not await conn.fetchval(self._sql.unlock, NAMESPACE, self._held_lock_id):
            log.warning("released the row, but this session did not hold the group's lock",
                        extra=self._fields(identity=term.identity, token=term.token, lock_id=self._held_lock_id))
        elif await conn.fetchval(self._sql.still_locked, NAMESPACE, self._held_lock_id):
            log.warning("this session held the group's lock more than once; gave back every level",
                        extra=self._fields(identity=term.identity, token=term.token, lock_id=self._held_lock_id))
            await conn.execute(self._sql.unlock_all)

    async def observe(self, *, timeout: float) -> LockRecord:
        deadline = self._clock() + timeout
        async with self._guard("observe", timeout):
            conn = self._conn
            if conn is not None and not conn.is_closed() and not self._busy.locked():
                async with self._busy:
                    try:
                        return await self._read(conn)
                    except BaseException as exc:
                        if not (isinstance(exc, asyncpg.PostgresError) and not conn.is_closed()):
                            self._discard(conn, "observe failed on the lock's connection")
                        raise
            async with self._short_lived(deadline) as conn:
                try:
                    return await self._read(conn)
                except asyncpg.UndefinedTableError:
                    return LockRecord(holder=None, token=None)

    async def current_leader(self, *, timeout: float = 5.0) -> LockRecord:
        """Who leads the group now, with which token (an ``observe``)."""
        return await self.observe(timeout=timeout)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._term = self._ended = None
        if conn is None:
            return
        if self._busy.locked():
            conn.terminate()
        else:
            await close_connection(conn)

    # -- steps -----------------------------------------------------------------------

    async def _wait_for_lock(self, conn: Connection, lock_id: int, deadline: float) -> bool:
        """Block on the advisory lock until granted (True) or ``lock_timeout`` (False): the end
        of the budget, or the live holder's expiry if that comes first (``_holder_expiry_check``)."""
        now = self._clock()
        remaining = deadline - now
        reserve = min(_LOCK_RESERVE_MAX, max(0.02, remaining * 0.2))
        until = self._holder_expiry_check if self._holder_expiry_check > now else math.inf
        wait_ms = max(1, int((min(remaining - reserve, until - now)) * 1000))
        await conn.execute(self._sql.set_lock_timeout, str(wait_ms))
        try:
            await conn.execute(self._sql.lock, NAMESPACE, lock_id)
        except asyncpg.LockNotAvailableError:
            # A lock granted in the instant the timeout fired is kept by PostgreSQL, which
            # still reports the timeout (proc.c, LockErrorCleanup). Taken for not granted, the
            # session would hold it unknowingly: the next wait is granted at once (session
            # locks stack) and the release gives back one level of two, keeping every standby
            # out while the row says "free". Seen when a holder's session ended just then.
            try:
                granted = bool(await conn.fetchval(self._sql.still_locked, NAMESPACE, lock_id))
            except BaseException:
                self._discard(conn, "checking the lock after its wait timed out failed")  # frees it, if held
                raise
            if granted:
                log.info("the lock was granted as its wait timed out", extra=self._fields(lock_id=lock_id))
        else:
            granted = True
        # Left on the session, the wait's timeout would also bound later statements' lock
        # waits (the take's and the renewals' row locks) and fail them.
        try:
            await conn.execute(self._sql.set_lock_timeout, "0")
        except BaseException:
            if granted:  # a lock we hold on a session we cannot vouch for: give it up with the session
                self._discard(conn, "resetting lock_timeout after the lock wait failed")
            raise
        return granted

    async def _pooled_holder(self, conn: Connection, lock_id: int, row: asyncpg.Record | None) -> LockRecord | None:
        """Under the advisory lock: the ``row``'s holder if it is a live term of the pooled mode
        (``backends.postgres.pooled_mode``, a group moving between modes), which holds no advisory
        lock; the lock is then given back. The pooled mode takes a row only while no session
        holds this lock, so nothing can slip in between this check and the take."""
        if row is None or not row["pooled"]:
            return None
        try:
            await conn.execute(self._sql.unlock, NAMESPACE, lock_id)
        except BaseException:
            self._discard(conn, "checking for a pooled-mode holder failed; closed the connection")  # frees the lock
            raise
        log.warning("the group is held in the pooled mode: this session-mode sidecar waits",
                    extra=self._fields(holder=row["holder"], token=row["token"]))
        return LockRecord(holder=Identity(row["holder"]), token=Token(row["token"]), version=str(row["token"]))

    async def _take(self, conn: Connection, identity: Identity, lock_id: int) -> Term | LockRecord:
        """We hold the advisory lock: record the new term with a fresh token."""
        sent = self._clock()
        try:
            # One statement, its own transaction: one round trip where the new leader waits. It
            # commits with synchronous_commit on, which the session set (session_settings).
            row = await conn.fetchrow(self._sql.take, self.group, identity, self.timings.lease_duration, lock_id,
                                      self._sql.token_seq, self.stop_bound)
            taken = self._clock()
            token = None if row is None else row["token"]
            if row is None or token is None:
                log.warning("the group's row vanished while acquiring; retrying later",
                            extra=self._fields(identity=identity, lock_id=lock_id))
                self._lock_id = None
                await conn.execute(self._sql.unlock, NAMESPACE, lock_id)
                return LockRecord(holder=None, token=None)
        except BaseException:
            self._discard(conn, "taking the lock failed; closed the connection")  # frees the lock
            raise
        # This container's own earlier incarnation: dead (the kubelet restarted it), and the only
        # app that may still act for its term is this pod's own, which this term now gates.
        own = is_predecessor(row["previous_holder"], identity, self._predecessor_prefix)
        wait = 0.0 if own else takeover_wait(unreleased=row["unreleased"], expiry_left=row["previous_expiry_left"],
                                             stop_bound=row["previous_stop_bound"])
        if row["unreleased"] and (stopped_at := self._stopped_at(row["previous_token"])) > -math.inf:
            wait = min(wait, max(stopped_at - taken, 0.0))  # held off for it: its stop bound ran from then
        if own:
            log.info("taking over from this pod's own earlier incarnation",
                     extra=self._fields(identity=identity, previous_holder=row["previous_holder"]))
        term = Term(identity=identity, token=Token(token), version=str(token), written_at=sent,
                    acting_from=taken + wait)
        self._term, self._held_lock_id = term, lock_id
        if wait > 0:
            log.warning("took over from a holder that did not release; acting after a wait",
                        extra=self._fields(identity=identity, token=token, wait_seconds=round(wait, 3)))
        log.info("acquired the lock", extra=self._fields(identity=identity, token=token))
        return term

    async def _busy_record(self, conn: Connection, identity: Identity) -> LockRecord:
        """The lock was not free in time: report the holder, ending its session if stalled
        (``_holder_expiry_check`` is then now: the lock frees in a moment)."""
        row = await self._fetch_observed(conn)
        if row is None:
            return LockRecord(holder=None, token=None)
        if row["holder"] is None:
            await self._report_lock_without_term(conn, row["lock_id"])
        if row["expired"] and row["live"]:
            log.warning("the holder let its lease expire but still holds the lock; terminating its session",
                        extra=self._fields(identity=identity, holder=row["holder"], token=row["token"],
                                           holder_pid=row["holder_pid"]))
            self._holder_expiry_check = -math.inf  # unless ended below: no use waiting for it again
            try:
                done = await conn.fetchval(self._sql.terminate, row["holder_pid"])
            except asyncpg.InsufficientPrivilegeError as exc:
                log.error("may not terminate the stalled holder's session",
                          extra=self._fields(identity=identity, holder=row["holder"], token=row["token"], error=exc))
            else:
                if done:
                    self._holder_expiry_check = self._clock()
                else:
                    log.warning("terminating the stalled holder's session failed",
                                extra=self._fields(holder=row["holder"], token=row["token"]))
        return lock_record(row)

    async def _fetch_observed(self, conn: Connection) -> asyncpg.Record | None:
        """The row as ``observe`` reads it; notes when a live holder's lease runs out."""
        row: asyncpg.Record | None = await conn.fetchrow(self._sql.observe, self.group, NAMESPACE)
        live_until = None if row is None or not row["live"] else row["expiry_left"]
        self._holder_expiry_check = -math.inf if live_until is None else \
            self._clock() + max(live_until, 0.0) + _CHECK_SLACK
        return row

    async def _report_lock_without_term(self, conn: Connection, lock_id: int) -> None:
        """The lock was not granted in time, yet the row names no holder: a session holds the
        lock without a term (one taking it this instant, or a lock left behind). Say which,
        once per session: it keeps every standby out."""
        sessions = await conn.fetch(self._sql.lock_sessions, NAMESPACE, lock_id)
        for session in sessions:
            if session["pid"] == self._reported_lock_pid:
                continue
            self._reported_lock_pid = session["pid"]
            log.warning("the group's row names no holder, yet a session holds its lock",
                        extra=self._fields(holder_pid=session["pid"], application_name=session["application_name"],
                                           state=session["state"], backend_start=str(session["backend_start"]),
                                           state_change=str(session["state_change"])))

    async def _read(self, conn: Connection) -> LockRecord:
        row = await self._fetch_observed(conn)
        return LockRecord(holder=None, token=None) if row is None else lock_record(row)

    # -- connection ------------------------------------------------------------------

    async def _connection(self, deadline: float) -> Connection:
        """The dedicated connection, (re)opened with the schema ready."""
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        if conn is not None:
            self._lost(conn, "connection to PostgreSQL closed")
        conn = await self._open(deadline)
        try:
            await check_session(conn, group=self.group, second=lambda: self._short_lived(deadline))
            settings = session_settings(self.timings.renew_deadline, conn.get_server_version().major)
            await conn.fetchval(self._sql.set_session, list(settings), list(settings.values()))
            if not self._schema_ready:
                await self._ensure_schema(conn)
        except BaseException:
            conn.terminate()
            raise
        self._conn = conn
        conn.add_termination_listener(
            lambda _: self._lost(conn, "connection to PostgreSQL closed (server restart, "
                                       "pg_terminate_backend or network failure)"))
        log.debug("connected to PostgreSQL", extra=self._fields(backend_pid=conn.get_server_pid()))
        return conn

    def _short_lived(self, deadline: float) -> AbstractAsyncContextManager[Connection]:
        """A connection of its own for one look, closed after it."""
        return short_lived(lambda: self._open(deadline))

    async def _open(self, deadline: float) -> Connection:
        budget = max(0.001, min(self._connect_timeout, deadline - self._clock()))
        conn: Connection = await asyncpg.connect(
            self._dsn, timeout=budget, server_settings=self._server_settings)
        return conn

    async def _ensure_schema(self, conn: Connection) -> None:
        await ensure_schema(conn, self._sql, self.group)
        self._schema_ready = True

    async def _group_lock_id(self, conn: Connection) -> int:
        if self._lock_id is None:
            await conn.execute(self._sql.insert_group, self.group, self._sql.lock_id_seq,
                               application_name(self.group), NAMESPACE)
            lock_id = await conn.fetchval(self._sql.lock_id, self.group)
            if lock_id is None:  # deleted again at once, or not created (see insert_group)
                raise BackendUnavailable(
                    f"the row of group {self.group!r} is missing and was not created: deleted again, or deleted"
                    f" while more than one held lock of sessions named {application_name(self.group)!r} could"
                    " be its own (created once they are given back)")
            self._lock_id = int(lock_id)
        return self._lock_id

    def _lost(self, conn: Connection, reason: str) -> None:
        """``conn`` is gone: forget it, and report a held term as lost."""
        if self._conn is not conn:
            return  # closed on purpose, or replaced already
        self._conn, self._ended = None, None  # an ended term's loss was reported by its renewal
        term, self._term = self._term, None
        if term is None:
            log.info("connection lost", extra=self._fields(reason=reason))
            return
        log.warning("lost the lock", extra=self._fields(identity=term.identity, token=term.token, reason=reason))
        if self._on_loss is not None:
            try:
                self._on_loss(reason)
            except Exception:
                log.exception("loss callback failed", extra=self._fields())

    def _discard(self, conn: Connection, reason: str) -> None:
        """Close ``conn`` at once (the server frees its locks); a term held on it is reported lost."""
        self._lost(conn, reason)
        conn.terminate()

    def _guard(self, what: str, budget: float) -> AbstractAsyncContextManager[None]:
        """Bound a call by ``budget`` seconds; failures to reach the server become BackendUnavailable."""
        return guarded(what, self.group, budget, schema_gone=self._schema_gone)

    def _schema_gone(self) -> None:
        self._schema_ready, self._lock_id = False, None


def takeover_wait(*, unreleased: bool, expiry_left: float | None, stop_bound: float | None) -> float:
    """Seconds a new holder waits before acting: none after a release; after a holder that did
    not release (crash, session ended under it), until its app is surely stopped: its declared
    stop bound, and never past its lease's expiry (by then its own deadline stopped it)."""
    if not unreleased:
        return 0.0
    left = max(expiry_left or 0.0, 0.0)
    return left if stop_bound is None else min(left, max(stop_bound, 0.0))


_TERMINATION_POLL = 0.01
"""Seconds between looks, after ``pg_terminate_backend``, for the holder's session to be gone."""


async def force_release(conn: Connection, group_key: str, *, sql: Statements, timeout: float) -> str:
    """End the group's holder on an operator's say-so (``kubectl singleton release``); returns
    what was done, in words. Either mode's rule, judged from the row:

    - session mode (the row names the holder's session): end that session, which frees its
      advisory lock, and wait until it has ended (``timeout`` bounds the whole call; a session
      still there then is a ``ForceReleaseFailed``): PostgreSQL only signals it, and "ended"
      must be true when we say it; a standby takes over after ``takeover_wait``
      for an unreleased holder, as after any session end, so the old app has stopped first;
    - pooled mode (a live row without a session): nothing to end. Expiring the row now would
      let a standby act while a live holder still acts until its next renewal; it frees by
      itself within the lease, as a crashed holder's does.
    """
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    try:
        row = await conn.fetchrow(sql.holder, group_key, timeout=left())
        if row is not None and row["holder"] is not None and row["holder_pid"] is None \
                and (row["expires_in"] or 0) > 0:
            return (f"PostgreSQL holder {row['holder']} (pooled mode: no session to end) keeps its row until it "
                    f"expires, in {row['expires_in']:.1f}s; a standby takes over then")
        if row is None or row["holder_pid"] is None:
            return "no PostgreSQL holder"
        ended = await conn.fetchval(sql.terminate, row["holder_pid"], timeout=left())
    except asyncpg.UndefinedTableError:
        # Not "no holder": a DSN naming another database than the group's would then look released.
        raise ForceReleaseFailed(f"PostgreSQL: no lock table {sql.leases} in this database: no sidecar of the "
                                 "group has run against it (is the Secret's DSN the group's?)") from None
    except (asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise ForceReleaseFailed(f"PostgreSQL: {type(exc).__name__}: {exc}") from None
    if ended and not await _session_ended(conn, row["holder_pid"], sql, deadline):
        raise ForceReleaseFailed(f"PostgreSQL was asked to end the session of holder {row['holder']}, but it had not "
                                 f"ended within {timeout:g}s: it keeps its lock until it does")
    if not ended:
        return f"the session of PostgreSQL holder {row['holder']} had ended already"
    return f"ended the PostgreSQL session of holder {row['holder']}"


async def _session_ended(conn: Connection, pid: int, sql: Statements, deadline: float) -> bool:
    """Whether the session ``pid`` (signalled by ``pg_terminate_backend``) is gone by ``deadline``;
    a look that cannot be answered in time counts as not gone."""
    while True:
        try:
            alive = await conn.fetchval(sql.session_alive, pid, timeout=max(0.001, deadline - time.monotonic()))
        except (asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            return False
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_TERMINATION_POLL)
