"""The application SDK against real sidecar processes and the real PostgreSQL server."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from singleton_sidecar.sdk import LeaderClient, StaleToken, Term, claim_work, ensure_fence_table, fenced
from tests.sidecars import FAST_TIMINGS, SidecarProcess, one_leader, wait_for, wait_serving

WORK_DDL = """
CREATE TABLE IF NOT EXISTS work_items (
    id bigserial PRIMARY KEY, payload text, claimed_by text, claimed_token bigint, claimed_at timestamptz,
    done_at timestamptz)
"""


@pytest.fixture
def pair(pg_dsn: str, tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    group = "sdk-" + uuid.uuid4().hex[:8]
    members = [SidecarProcess(f"s{i}", {"SINGLETON_GROUP": group, "SINGLETON_POSTGRES_DSN": pg_dsn,
                                        **FAST_TIMINGS}, tmp_path / f"s{i}.log").start() for i in range(2)]
    wait_serving(members)
    yield members
    for member in members:
        member.stop()


async def test_wait_until_leading_and_the_loss_of_the_term(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    standby = next(s for s in pair if s is not leader)
    async with LeaderClient(leader.url + "/leader") as on_leader, LeaderClient(standby.url + "/leader") as on_standby:
        term = await asyncio.wait_for(on_leader.wait_until_leading(), 5)
        assert term.token > 0 and term.group == leader.env["SINGLETON_GROUP"]
        assert await on_standby.current_term() is None
        async with on_leader.watch_loss(term) as lost:
            assert not lost.is_set()
            leader.signal(signal.SIGTERM)
            await asyncio.wait_for(lost.wait(), 3)
        new_term = await asyncio.wait_for(on_standby.wait_until_leading(), 5)
        assert new_term.token > term.token


async def test_an_unreachable_sidecar_means_not_leading() -> None:
    async with LeaderClient("http://127.0.0.1:9/leader", timeout=0.2) as client:
        assert await client.current_term() is None


async def test_fenced_writes_refuse_a_stale_term_and_claims_are_idempotent(pg_dsn: str) -> None:
    group = "sdk-" + uuid.uuid4().hex[:8]
    table = "work_items"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await ensure_fence_table(conn)
        await conn.execute(WORK_DDL)
        await conn.execute(f"TRUNCATE {table}")
        await conn.executemany(f"INSERT INTO {table} (payload) VALUES ($1)", [(f"item-{i}",) for i in range(5)])
        old, new = Term(group, "old", 10), Term(group, "new", 11)
        first = await claim_work(conn, old, table=table, limit=3)
        assert len(first) == 3
        # The old leader died mid-work: the new term reclaims its unfinished items, and all others.
        second = await claim_work(conn, new, table=table, limit=10)
        assert {r["id"] for r in second} >= {r["id"] for r in first} and len(second) == 5
        # The ex-leader wakes up: every write of its term is refused, nothing commits.
        with pytest.raises(StaleToken):
            async with fenced(conn, old):
                await conn.execute(f"UPDATE {table} SET done_at = now()")
        assert await conn.fetchval(f"SELECT count(*) FROM {table} WHERE done_at IS NOT NULL") == 0
        with pytest.raises(StaleToken):
            await claim_work(conn, old, table=table)
        async with fenced(conn, new):
            await conn.execute(f"UPDATE {table} SET done_at = now() WHERE claimed_token = $1", new.token)
        assert await conn.fetchval(f"SELECT count(*) FROM {table} WHERE done_at IS NULL") == 0
        with pytest.raises(ValueError, match="plain identifier"):
            await claim_work(conn, new, table="work_items; DROP TABLE x")
    finally:
        await conn.close()


async def test_a_step_down_waits_until_the_sdk_app_has_stopped(pair: list[SidecarProcess]) -> None:
    """Cooperative mode: the term's end waits for the app's word (``watch_loss`` tells the
    sidecar it acts, and that it stopped), so the next leader starts only once it has."""
    leader = await asyncio.to_thread(one_leader, pair)
    standby = next(s for s in pair if s is not leader)
    control = f"http://127.0.0.1:{leader.control_port}"
    async with LeaderClient(leader.url + "/leader", control_url=control) as app:
        term = await asyncio.wait_for(app.wait_until_leading(), 5)
        async with app.watch_loss(term) as lost:
            status, _ = await asyncio.to_thread(leader.control, "POST", "/step-down")
            assert status == 202
            await asyncio.wait_for(lost.wait(), 3)  # draining: the SDK says the term is ending
            await asyncio.sleep(1.0)  # the app finishes the item in hand
            assert not standby.ready(), "another replica led while the app was still acting"
            left_at = time.monotonic()
        await asyncio.to_thread(wait_for, standby.ready, 5, "the standby to lead")
        assert time.monotonic() - left_at < 2.0
        doc = leader.leader_doc()
        assert doc is not None and doc["role"] == "standby"


async def test_acting_and_stopped_refuse_a_token_that_is_not_the_term(pair: list[SidecarProcess]) -> None:
    leader = await asyncio.to_thread(one_leader, pair)
    doc = leader.leader_doc()
    assert doc is not None
    assert leader.control("POST", f"/acting?token={doc['token'] - 1}")[0] == 409
    assert leader.control("POST", "/acting?token=abc")[0] == 400
    assert leader.control("POST", f"/stopped?token={doc['token']}")[0] == 409  # never registered
    assert leader.control("POST", f"/acting?token={doc['token']}")[0] == 200
    assert leader.control("POST", f"/stopped?token={doc['token']}")[0] == 200
