"""A sample poller for demos and end-to-end tests: while its replica leads, it processes
one "item" every few tens of milliseconds and records each item's start and end in a
ledger table, through fenced writes. SIGTERM: it finishes the item in flight and exits.

    LEDGER_DSN=postgresql://... singleton-sample-poller

The ledger (``ledger``: group, identity, token, item, phase, time) lets a checker prove
from the outside that no two replicas ever worked at once and that no item was lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import asyncpg

from singleton_sidecar.logs import setup_logging
from singleton_sidecar.sdk import LeaderClient, StaleToken, Term, ensure_fence_table, fenced

log = logging.getLogger("sample-poller")

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""
ITEM_SECONDS = float(os.environ.get("SAMPLE_ITEM_SECONDS", "0.02"))


async def record(conn: asyncpg.Connection, term: Term, item: int, phase: str) -> None:
    async with fenced(conn, term):
        await conn.execute("INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                           term.group, term.identity, term.token, item, phase)


async def main() -> int:
    setup_logging("json" if os.environ.get("SINGLETON_LOG_FORMAT") == "json" else "text")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # A poller whose pod vanished mid-write can leave its session "idle in transaction" on the
    # server (no FIN reached it), holding the fence row: every later leader's write then waits
    # behind it. Our transactions never idle, so the server may end such a session after 5 s.
    conn = await asyncpg.connect(os.environ["LEDGER_DSN"], timeout=10,
                                 server_settings={"idle_in_transaction_session_timeout": "5000"})
    await conn.execute("SELECT pg_advisory_lock(777)")  # DDL once, not from every replica at once
    try:
        await conn.execute(LEDGER_DDL)
        await ensure_fence_table(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(777)")
    log.info("ledger ready; working while this replica leads", extra={"backend_pid": conn.get_server_pid()})
    item = 0
    acting: int | None = None
    async with LeaderClient() as leadership:
        while not stop.is_set():
            term = await leadership.current_term()
            token = None if term is None else term.token
            if token != acting:
                if token is None:
                    log.info("not acting: the term ended", extra={"token": acting, "last_item": item})
                else:
                    log.info("acting", extra={"group": term.group if term else None, "token": token,
                                              "first_item": item + 1})
                acting = token
            if term is None:
                await asyncio.sleep(0.05)
                continue
            item += 1
            try:
                await record(conn, term, item, "start")
                await asyncio.sleep(ITEM_SECONDS)  # the work
                await record(conn, term, item, "done")
            except StaleToken as exc:
                log.warning("fenced out: %s", exc)
    await conn.close()
    log.info("stopped", extra={"items": item})
    return 0


def run() -> None:
    sys.exit(asyncio.run(main()))


if __name__ == "__main__":
    run()
