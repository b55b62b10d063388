"""The client-go peer's ledger worker: what an app beside a client-go elector typically
does. It polls the elector's ``GET /leader`` every 10 ms and, while the last answer said
``isLeader``, appends items to the same ledger as ``tests/data/ledger_worker.py`` (a
``start`` row, 20 ms of work, a ``done`` row), WITHOUT fencing: nothing in the database
refuses the writes of a leader that no longer leads.

The ``token`` column holds the start of the elector's term (``since``, in epoch ms), so
the ledger checker can tell terms apart; nothing checks it on write.

    LEDGER_DSN=... python unfenced_worker.py --url http://127.0.0.1:PORT --group G --identity I
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from typing import Any

import asyncpg

DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""
POLL_INTERVAL = 0.01


def fetch(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url + "/leader", timeout=0.5) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc
    except (urllib.error.URLError, OSError, ValueError):
        return None


def term_of(doc: dict[str, Any] | None) -> int | None:
    """The term this worker may act in: the elector's ``since`` in epoch ms, while it leads."""
    if doc is None or not doc.get("isLeader") or not doc.get("since"):
        return None
    since = dt.datetime.fromisoformat(str(doc["since"]).replace("Z", "+00:00"))
    return int(since.timestamp() * 1000)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--identity", required=True)
    args = parser.parse_args()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn = await asyncpg.connect(os.environ["LEDGER_DSN"])
    await conn.execute("SELECT pg_advisory_lock(777)")
    try:
        await conn.execute(DDL)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(777)")

    view: dict[str, int | None] = {"term": None}

    async def poll() -> None:
        while not stop.is_set():
            view["term"] = term_of(await asyncio.to_thread(fetch, args.url))
            await asyncio.sleep(POLL_INTERVAL)

    poller = asyncio.create_task(poll())
    item = 0
    try:
        while not stop.is_set():
            term = view["term"]
            if term is None:
                await asyncio.sleep(POLL_INTERVAL)
                continue
            item += 1
            for phase in ("start", "done"):
                await conn.execute(
                    "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                    args.group, args.identity, term, item, phase)
                if phase == "start":
                    await asyncio.sleep(0.02)  # the work of one item
            await asyncio.sleep(0.005)
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
