"""Fenced writes with psycopg 3, synchronous and asynchronous
(``pip install 'kube-singleton-sdk[psycopg]'``).

    with fenced(conn, term):                # psycopg.Connection
        conn.execute("INSERT INTO results ...")

    async with fenced_async(aconn, term):   # psycopg.AsyncConnection
        await aconn.execute("INSERT INTO results ...")

``fenced`` opens a transaction (``conn.transaction()``: a savepoint if one is already open)
whose first statement is the fence; ``fence`` is the statement alone, for a transaction you
manage yourself (a connection that is not in autocommit mode is always in one). Set
``idle_in_transaction_session_timeout`` on fenced connections (``options="-c
idle_in_transaction_session_timeout=5000"``), for the reason given in ``singleton_sdk.asyncpg``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
from psycopg import pq

from singleton_sdk.fence import FENCE_DDL, NOT_IN_TRANSACTION, StaleToken, fence_sql, seen_sql
from singleton_sdk.term import Term

__all__ = ["StaleToken", "ensure_fence_table", "ensure_fence_table_async", "fence", "fence_async", "fenced",
           "fenced_async"]

_FENCE = fence_sql(key="%(key)s", token="%(token)s")
_SEEN = seen_sql(key="%(key)s")


def _outside_a_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """An autocommit connection outside ``transaction()`` would commit the fence on its own."""
    return conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE


def ensure_fence_table(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute(FENCE_DDL)


def fence(conn: psycopg.Connection[Any], *, key: str, token: int) -> None:
    """In the transaction of the fenced writes: ``StaleToken`` unless ``token`` is the newest
    the group's fence ``key`` (``Term.key``) has seen."""
    if _outside_a_transaction(conn):
        raise RuntimeError(NOT_IN_TRANSACTION)
    params = {"key": key, "token": token}
    if conn.execute(_FENCE, params).fetchone() is None:
        seen = conn.execute(_SEEN, params).fetchone()
        raise StaleToken(key, token, None if seen is None else seen[0])


@contextlib.contextmanager
def fenced(conn: psycopg.Connection[Any], term: Term) -> Iterator[psycopg.Connection[Any]]:
    """A transaction whose writes commit only if no newer term has written (``StaleToken``)."""
    with conn.transaction():
        fence(conn, key=term.key, token=term.token)
        yield conn


async def ensure_fence_table_async(conn: psycopg.AsyncConnection[Any]) -> None:
    async with conn.transaction():
        await conn.execute(FENCE_DDL)


async def fence_async(conn: psycopg.AsyncConnection[Any], *, key: str, token: int) -> None:
    """``fence`` for an ``AsyncConnection``."""
    if _outside_a_transaction(conn):
        raise RuntimeError(NOT_IN_TRANSACTION)
    params = {"key": key, "token": token}
    if await (await conn.execute(_FENCE, params)).fetchone() is None:
        seen = await (await conn.execute(_SEEN, params)).fetchone()
        raise StaleToken(key, token, None if seen is None else seen[0])


@contextlib.asynccontextmanager
async def fenced_async(conn: psycopg.AsyncConnection[Any], term: Term) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """``fenced`` for an ``AsyncConnection``."""
    async with conn.transaction():
        await fence_async(conn, key=term.key, token=term.token)
        yield conn
