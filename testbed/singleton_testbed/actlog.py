"""The act log's writer: the one act protocol of every worker that logs its acts
(``tests/data/ledger_worker.py`` beside our sidecar, ``benchmarks/clientgo/unfenced_worker.py``
beside client-go), so ``singleton_testbed.ledger.judge_acts`` judges them all by one rule.

The protocol, per act (each write of a ledger phase stands for an act an app does outside the
database, an e-mail or an HTTP call, which no fence can refuse):

1. ``begin``: commit a row saying the worker is acting (``began_at``), on a connection of its
   own (autocommit), before the fence is asked. If that insert fails the worker does not act.
   A worker that checks its term's deadline before acting passes the moment that check passed
   (``decided_at``), which tells a deposed app that acted without looking from one that looked
   in its term and was then stalled (a whole-pod freeze) before it could act.
2. the act itself;
3. ``end``: fill in ``ended_at`` and the outcome (``written``, ``refused``, ``failed``), best
   effort: an end never logged (the worker was killed or lost its connection mid-act) is closed
   by the judge at ``began_at + max_seconds``.

Times are this process's ``time.time()``: the judge compares acts of different processes, so
every worker of a run must share one clock (one machine).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import UTC, datetime

import asyncpg

from singleton_sdk.asyncpg import ensure_fence_table
from singleton_testbed.ledger import ACTS_DDL

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""
"""The fenced ledger every worker appends to (``singleton_testbed.ledger.judge`` reads it)."""

SETUP_LOCK = 777
"""The advisory lock under which workers create the tables: concurrent ``CREATE TABLE IF NOT
EXISTS`` of one table can fail."""

WRITTEN, REFUSED, FAILED = "written", "refused", "failed"
"""An act's outcome: done; refused by the fence (still an act: an unfenced side effect would
have happened); failed otherwise (an error, or the worker was stopped mid-act)."""


def wall(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


async def create_tables(conn: asyncpg.Connection) -> None:
    """The ledger, the act log and the fence table, created once whoever starts first."""
    await conn.execute("SELECT pg_advisory_lock($1)", SETUP_LOCK)
    try:
        await conn.execute(LEDGER_DDL)
        await conn.execute(ACTS_DDL)
        await ensure_fence_table(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", SETUP_LOCK)


class ActLog:
    """The unfenced act log on a connection of its own (autocommit: each row is committed
    before the act it announces). ``token`` is the term acted for; a worker that outlives its
    terms (client-go's) passes each act's own."""

    def __init__(self, conn: asyncpg.Connection, group: str, identity: str, token: int, max_seconds: float) -> None:
        self.conn, self.group, self.identity, self.token = conn, group, identity, token
        self.max_seconds = max_seconds

    @classmethod
    async def connect(cls, dsn: str, group: str, identity: str, token: int, max_seconds: float) -> ActLog:
        return cls(await asyncpg.connect(dsn), group, identity, token, max_seconds)

    async def begin(self, item: int, phase: str, *, token: int | None = None, decided: float | None = None) -> int:
        """Log that an act begins (``decided``: when the deadline check before it passed, if the
        worker made one); raises if the row could not be committed (then do not act)."""
        began = time.time()  # before the insert: the logged interval covers the act whatever the insert takes
        act_id = await self.conn.fetchval(
            "INSERT INTO acts (group_name, identity, token, pid, item, phase, began_at, max_seconds, decided_at) "
            "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) RETURNING id",
            self.group, self.identity, self.token if token is None else token, os.getpid(), item, phase,
            wall(began), self.max_seconds, None if decided is None else wall(decided))
        return int(act_id)

    async def end(self, act_id: int, ended: float, outcome: str) -> None:
        """Log the act's end (raises on failure: see ``end_quietly``)."""
        await self.conn.execute("UPDATE acts SET ended_at = $2, outcome = $3 WHERE id = $1",
                                act_id, wall(ended), outcome)

    async def end_quietly(self, act_id: int, ended: float, outcome: str) -> None:
        """``end``, best effort: an end not logged is closed by the judge at began + max_seconds."""
        with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            await self.end(act_id, ended, outcome)

    async def close(self) -> None:
        await self.conn.close()
