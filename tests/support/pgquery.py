"""One-off queries against the test bed's PostgreSQL, for fault injection and checks."""

from __future__ import annotations

import asyncpg


async def fetchval(dsn: str, sql: str, *args: object) -> object:
    """The first value of ``sql`` on a fresh connection (closed again at once)."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()
