"""A test workload for the exec gate: while it runs (= while its sidecar leads), it
appends a row every few milliseconds to a ledger through the fenced-write helper.

Each item is "in flight" from its start row to its done row; on SIGTERM it finishes the
item in flight and exits, so a drain that waits for it loses nothing.
"""

import asyncio
import os
import signal
import sys

import asyncpg

from singleton_sidecar.fencing import StaleToken, ensure_fence_table, fence

DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""


async def main() -> int:
    dsn, group = os.environ["LEDGER_DSN"], os.environ["SINGLETON_GROUP"]
    token, identity = int(os.environ["SINGLETON_TOKEN"]), os.environ["SINGLETON_IDENTITY"]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn = await asyncpg.connect(dsn)
    await conn.execute("SELECT pg_advisory_lock(777)")
    try:
        await conn.execute(DDL)
        await ensure_fence_table(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(777)")
    item = 0
    while not stop.is_set():
        item += 1
        for phase in ("start", "done"):
            try:
                async with conn.transaction():
                    await fence(conn, group=group, token=token)
                    await conn.execute(
                        "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                        group, identity, token, item, phase)
            except StaleToken as exc:
                print(f"fenced out: {exc}", file=sys.stderr, flush=True)
                return 3
            if phase == "start":
                await asyncio.sleep(0.02)  # the work of one item
        await asyncio.sleep(0.005)
    await conn.close()
    return 0


sys.exit(asyncio.run(main()))
