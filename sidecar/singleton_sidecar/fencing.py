"""Cooperative mode for applications: ask the local sidecar who leads, and make fenced
writes in PostgreSQL that refuse a token older than one already seen.

    leader = await current_leader("http://127.0.0.1:8080")
    if leader.is_leader:
        async with conn.transaction():
            await fence(conn, key=leader.fence_key, token=leader.token)  # raises StaleToken
            await conn.execute("INSERT INTO results ...")

``fence`` takes a row lock on the group's fence row inside the caller's transaction,
so a stale writer that races a newer one waits for the newer commit and is then
refused: the check and the write commit together or not at all.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any

import asyncpg

FENCE_DDL = """
CREATE TABLE IF NOT EXISTS singleton_fence (
    group_name text PRIMARY KEY,
    token bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""

_FENCE = """
INSERT INTO singleton_fence AS f (group_name, token) VALUES ($1, $2)
ON CONFLICT (group_name) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
    WHERE f.token <= EXCLUDED.token
RETURNING token
"""


class StaleToken(Exception):
    """A write carried a token older than one the fence has already seen."""

    def __init__(self, key: str, token: int, seen: int | None) -> None:
        super().__init__(f"group {key}: token {token} is stale (the fence has seen {seen})")
        self.key = key
        self.token = token
        self.seen = seen


@dataclass(frozen=True)
class Leadership:
    """The local sidecar's answer to ``GET /leader``."""

    group: str
    identity: str
    role: str
    is_leader: bool
    token: int | None
    leader: str | None
    fence_key: str
    """The group's key for ``fence`` (``<namespace>/<group>`` in a cluster)."""

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Leadership:
        return cls(group=doc["group"], identity=doc["identity"], role=doc["role"], is_leader=bool(doc["isLeader"]),
                   token=doc.get("token"), leader=doc.get("leader"), fence_key=doc.get("fenceKey") or doc["group"])


def current_leader(sidecar_url: str = "http://127.0.0.1:8080", *, timeout: float = 2.0) -> Leadership:
    """Blocking call for simple apps: what the local sidecar says right now."""
    with urllib.request.urlopen(f"{sidecar_url.rstrip('/')}/leader", timeout=timeout) as response:
        return Leadership.from_document(json.loads(response.read()))


async def ensure_fence_table(conn: asyncpg.Connection) -> None:
    await conn.execute(FENCE_DDL)


async def fence(conn: asyncpg.Connection, *, key: str, token: int) -> None:
    """Inside a transaction: raise ``StaleToken`` unless ``token`` is the newest seen for the
    group's fence ``key`` (``/leader``'s ``fenceKey``, ``$SINGLETON_FENCE_KEY`` under the exec gate)."""
    if not conn.is_in_transaction():
        raise RuntimeError("fence() must run inside the transaction that makes the fenced write")
    accepted = await conn.fetchval(_FENCE, key, token)
    if accepted is None:
        seen = await conn.fetchval("SELECT token FROM singleton_fence WHERE group_name = $1", key)
        raise StaleToken(key, token, seen)
