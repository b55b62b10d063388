"""Fenced writes with asyncpg (``pip install 'kube-singleton-sdk[asyncpg]'``).

    async with fenced(conn, term):          # a transaction that refuses a stale token
        await conn.execute("INSERT INTO results ...")

Open fenced connections with ``server_settings={"idle_in_transaction_session_timeout":
"<lease duration in ms>"}``: a deposed leader that vanishes mid-transaction holds the fence
row's lock until the server ends its transaction, stalling the new leader's writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

from singleton_sdk.fence import FENCE_DDL, NOT_IN_TRANSACTION, StaleToken, fence_sql, seen_sql
from singleton_sdk.term import Term

__all__ = ["StaleToken", "claim_work", "ensure_fence_table", "fence", "fenced"]

_FENCE = fence_sql(key="$1", token="$2")
_SEEN = seen_sql(key="$1")


async def ensure_fence_table(conn: asyncpg.Connection) -> None:
    await conn.execute(FENCE_DDL)


async def fence(conn: asyncpg.Connection, *, key: str, token: int) -> None:
    """Inside a transaction: raise ``StaleToken`` unless ``token`` is the newest seen for the
    group's fence ``key`` (``Term.key``; ``$SINGLETON_FENCE_KEY`` under the exec gate)."""
    if not conn.is_in_transaction():
        raise RuntimeError(NOT_IN_TRANSACTION)
    if await conn.fetchval(_FENCE, key, token) is None:
        raise StaleToken(key, token, await conn.fetchval(_SEEN, key))


@contextlib.asynccontextmanager
async def fenced(conn: asyncpg.Connection, term: Term) -> AsyncIterator[asyncpg.Connection]:
    """A transaction whose writes commit only if no newer term has written (``StaleToken``)."""
    async with conn.transaction():
        await fence(conn, key=term.key, token=term.token)
        yield conn


_CLAIM = """
UPDATE {table} SET claimed_by = $1, claimed_token = $2, claimed_at = now()
WHERE id IN (SELECT id FROM {table} WHERE done_at IS NULL AND (claimed_token IS NULL OR claimed_token < $2)
             ORDER BY id FOR UPDATE SKIP LOCKED LIMIT $3)
RETURNING id, payload
"""


async def claim_work(conn: asyncpg.Connection, term: Term, *, table: str = "work_items",
                     limit: int = 10) -> list[asyncpg.Record]:
    """Claim up to ``limit`` unfinished items for this term, fenced and idempotent.

    Items claimed by an older term (an ex-leader that died mid-item) are claimed again;
    ``SKIP LOCKED`` keeps two claimers from blocking each other. The table needs columns
    ``id``, ``payload``, ``claimed_by``, ``claimed_token``, ``claimed_at``, ``done_at``.
    """
    if not table.replace("_", "").isalnum():
        raise ValueError(f"table must be a plain identifier, got {table!r}")
    async with fenced(conn, term):
        return list(await conn.fetch(_CLAIM.format(table=table), term.identity, term.token, limit))
