"""The Python SDK for applications beside the sidecar (cooperative mode).

    from singleton_sidecar.sdk import LeaderClient, fenced

    leadership = LeaderClient()                       # SINGLETON_LEADER_URL, or the default port
    term = await leadership.wait_until_leading()      # blocks while this replica stands by
    async with leadership.watch_loss(term) as lost:   # lost.is_set() once the term ends
        while not lost.is_set():
            async with fenced(conn, term):            # a transaction that refuses stale tokens
                await conn.execute("INSERT INTO results ...")

A term ends when the sidecar stops leading, the token changes, or the sidecar cannot be
asked within ``timeout`` (then the app must assume it lost: it cannot prove it leads).
Writes inside ``fenced`` carry the term's token; a newer leader's write has raised the
fence, so a stale writer's transaction raises ``StaleToken`` and commits nothing.

Open fenced connections with ``server_settings={"idle_in_transaction_session_timeout":
"<lease duration in ms>"}``: a deposed leader that vanishes mid-transaction holds the
fence row's lock until the server ends its transaction, stalling the new leader's writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import asyncpg

from singleton_sidecar.fencing import Leadership, StaleToken, ensure_fence_table, fence

__all__ = ["LeaderClient", "StaleToken", "Term", "claim_work", "ensure_fence_table", "fenced"]

DEFAULT_URL = "http://127.0.0.1:8080/leader"  # the sidecar's default listen address
DEFAULT_CONTROL_URL = "http://127.0.0.1:8081"  # the sidecar's default control address (loopback)


@dataclass(frozen=True)
class Term:
    """One term of this replica: the group, its identity and the fencing token."""

    group: str
    identity: str
    token: int
    fence_key: str = ""
    """The group's key for fenced writes (``<namespace>/<group>`` in a cluster); empty: the group."""


class LeaderClient:
    def __init__(self, url: str | None = None, *, timeout: float = 1.0, poll: float = 0.1,
                 control_url: str | None = None) -> None:
        self.url = url or os.environ.get("SINGLETON_LEADER_URL", DEFAULT_URL)
        self.control_url = (control_url or os.environ.get("SINGLETON_CONTROL_URL", DEFAULT_CONTROL_URL)).rstrip("/")
        self.timeout = timeout
        self.poll = poll
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> LeaderClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def status(self) -> Leadership:
        """What the sidecar says now; raises ``OSError``/``aiohttp.ClientError`` if it cannot be asked."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        async with self._session.get(self.url) as response:
            response.raise_for_status()
            return Leadership.from_document(await response.json())

    async def current_term(self) -> Term | None:
        """This replica's term if it leads now, else None (also when the sidecar is unreachable)."""
        try:
            now = await self.status()
        except (OSError, aiohttp.ClientError, TimeoutError):
            return None
        if not now.is_leader or now.token is None or now.role != "leader":
            return None  # standing by, or the term is ending (draining): stop taking work
        return Term(group=now.group, identity=now.identity, token=now.token, fence_key=now.fence_key)

    async def wait_until_leading(self) -> Term:
        while True:
            term = await self.current_term()
            if term is not None:
                return term
            await asyncio.sleep(self.poll)

    @contextlib.asynccontextmanager
    async def watch_loss(self, term: Term) -> AsyncIterator[asyncio.Event]:
        """An Event set as soon as ``term`` is over or ending (polled every ``poll`` seconds).

        While the block runs, the sidecar knows the app acts for the term (``POST /acting``):
        a step-down, handover or drain waits until the block has exited (``POST /stopped``)
        before the lock can pass to another replica, up to the sidecar's drain timeout."""
        lost = asyncio.Event()

        async def watch() -> None:
            while await self.current_term() == term:  # noqa: ASYNC110 - polling the sidecar over HTTP
                await asyncio.sleep(self.poll)
            lost.set()

        registered = await self._control("acting", term.token)
        task = asyncio.create_task(watch(), name=f"watch-term-{term.token}")
        try:
            yield lost
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if registered:
                await self._control("stopped", term.token)

    async def _control(self, action: str, token: int) -> bool:
        """POST to the sidecar's control endpoint; False if it could not be told (it then does
        not wait for this app, and only fencing protects its late writes)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            async with self._session.post(f"{self.control_url}/{action}", params={"token": str(token)}) as response:
                return response.status == 200
        except (OSError, aiohttp.ClientError, TimeoutError):
            return False


@contextlib.asynccontextmanager
async def fenced(conn: asyncpg.Connection, term: Term) -> AsyncIterator[asyncpg.Connection]:
    """A transaction whose writes commit only if no newer term has written (``StaleToken``)."""
    async with conn.transaction():
        await fence(conn, key=term.fence_key or term.group, token=term.token)
        yield conn


CLAIM_SQL = """
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
        return list(await conn.fetch(CLAIM_SQL.format(table=table), term.identity, term.token, limit))
