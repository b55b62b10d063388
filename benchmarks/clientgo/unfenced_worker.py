"""The client-go peer's ledger worker: what an app beside a client-go elector typically
does. It polls the elector's ``GET /leader`` every 10 ms and, while the last answer said
``isLeader``, appends items to the same ledger as ``tests/data/ledger_worker.py`` (a
``start`` row, 20 ms of work, a ``done`` row). By default it writes WITHOUT fencing: nothing
in the database refuses the writes of a leader that no longer leads (``--fence``: see below).

Every phase write is an *act* logged by the act protocol of ``singleton_testbed.actlog``, the
one ``tests/data/ledger_worker.py`` follows (a row in ``acts`` committed before the act on a
connection of its own, no act if that fails, the end and outcome after it), so
``singleton_testbed.ledger.judge_acts`` judges both peers' apps by one rule. Like our worker,
which checks its term's deadline before every act, it checks the elector's latest answer
before every act.

Its term's token (the ``token`` column of the ledger and of the act log) is the start of the
elector's term (``since``, in epoch ms): client-go has no fencing token. With ``--fence`` the
writes go through ``singleton_sdk.asyncpg.fence`` with that token (fence key: the group),
as an app beside client-go could fence them: a newer term starts later on this machine's clock,
so a deposed leader's writes are refused once the new one has written. A refused write ends
the worker's acting in that term (``fenced out`` in its log), as our worker exits on one.

    LEDGER_DSN=... python unfenced_worker.py --url http://127.0.0.1:PORT --group G --identity I [--fence]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import asyncpg

from singleton_sdk.asyncpg import StaleToken, fence
from singleton_testbed.actlog import FAILED, REFUSED, WRITTEN, ActLog, create_tables

POLL_INTERVAL = 0.01
ITEM_SECONDS = 0.02
ACT_MAX_SECONDS = 0.05
"""Declared per act as ``max_seconds``: as ``tests/data/ledger_worker.py``'s default."""
IDLE_TX_TIMEOUT_MS = "1000"
"""``idle_in_transaction_session_timeout``, as ``tests/data/ledger_worker.py``'s default."""


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


async def work_item(conn: asyncpg.Connection, acts: ActLog, args: argparse.Namespace, view: dict[str, int | None],
                    *, term: int, item: int) -> bool:
    """One item of ``term`` (start row, work, done row), each write an act logged by the act
    protocol. False when the fence refused a write: the worker is fenced out of ``term``."""
    for phase in ("start", "done"):
        if view["term"] != term:
            return True  # the elector no longer says this term leads: no new act
        try:
            act = await acts.begin(item, phase, token=term)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            print(f"act log refused the act, not acting: {exc!r}", file=sys.stderr, flush=True)
            raise SystemExit(4) from exc
        outcome = FAILED
        try:
            async with conn.transaction():
                if args.fence:
                    await fence(conn, key=args.group, token=term)
                await conn.execute(
                    "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                    args.group, args.identity, term, item, phase)
            outcome = WRITTEN
        except StaleToken as exc:
            outcome = REFUSED
            print(f"fenced out: {exc}", file=sys.stderr, flush=True)
            return False
        finally:
            await acts.end_quietly(act, time.time(), outcome)
        if phase == "start":
            await asyncio.sleep(ITEM_SECONDS)  # the work of one item
    return True


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--identity", required=True)
    parser.add_argument("--fence", action="store_true", help="fence every write with the term's start (epoch ms)")
    args = parser.parse_args()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    dsn = os.environ["LEDGER_DSN"]
    conn = await asyncpg.connect(dsn, server_settings={"idle_in_transaction_session_timeout": IDLE_TX_TIMEOUT_MS})
    await create_tables(conn)
    acts = await ActLog.connect(dsn, args.group, args.identity, 0, ACT_MAX_SECONDS)

    view: dict[str, int | None] = {"term": None}

    async def poll() -> None:
        while not stop.is_set():
            view["term"] = term_of(await asyncio.to_thread(fetch, args.url))
            await asyncio.sleep(POLL_INTERVAL)

    poller = asyncio.create_task(poll())
    item = 0
    fenced_out: int | None = None
    try:
        while not stop.is_set():
            term = view["term"]
            if term is None or term == fenced_out:
                await asyncio.sleep(POLL_INTERVAL)
                continue
            item += 1
            if not await work_item(conn, acts, args, view, term=term, item=item):
                fenced_out = term
            await asyncio.sleep(0.005)
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await acts.close()
        await conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
