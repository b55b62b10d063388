"""A sample poller for demos and end-to-end tests, and an app of the SDK (``singleton_sdk``):
while its replica leads, it processes one "item" every few tens of milliseconds and records
each item's start and end in a ledger table, through fenced writes. When the term ends or
starts ending, or on SIGTERM, it finishes the item in hand (``uninterrupted``) and stops;
the sidecar releases the lock only after that.

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

from singleton_election.logs import setup_logging

try:
    from singleton_sdk import LeaderClient, StaleToken, Term, uninterrupted
    from singleton_sdk.asyncpg import ensure_fence_table, fenced
except ModuleNotFoundError as exc:
    # The SDK is the extra [sample] of kube-singleton, not a dependency (the image has it).
    if exc.name != "singleton_sdk":
        raise
    raise SystemExit("singleton-sample-poller: error: it is an app of the SDK, which is missing; install it with: "
                     "pip install 'kube-singleton[sample]' (from a checkout: pip install ./sdk)") from exc

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
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
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

    async def work_one(term: Term, number: int) -> None:
        await record(conn, term, number, "start")
        await asyncio.sleep(ITEM_SECONDS)  # the work
        await record(conn, term, number, "done")

    async def act(term: Term) -> None:
        nonlocal item
        log.info("acting", extra={"group": term.group, "token": term.token, "first_item": item + 1})
        try:
            while True:
                item += 1
                await uninterrupted(work_one(term, item))
        except StaleToken as exc:
            log.warning("fenced out: %s", exc)
        finally:
            log.info("not acting: the term ended", extra={"token": term.token, "last_item": item})

    try:
        async with LeaderClient() as leadership:
            await leadership.run_while_leading(act)
    except asyncio.CancelledError:
        log.info("SIGTERM: the item in hand is finished")
    finally:
        await conn.close()
    log.info("stopped", extra={"items": item})
    return 0


def run() -> None:
    sys.exit(asyncio.run(main()))


if __name__ == "__main__":
    run()
