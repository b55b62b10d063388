"""A test workload for the exec gate: while it runs (= while its sidecar leads), it
appends a row every few milliseconds to a ledger through the fenced-write helper.

Each item is "in flight" from its start row to its done row; on SIGTERM it finishes the
item in flight and exits, so a drain that waits for it loses nothing.

Options (environment; the defaults are the safe behaviour the tests rely on):

- ``LEDGER_FENCE=off``: write without ``fence()``, as an app that ignores its token would
  (deliberately unsafe: the ledger checker must catch what follows).
- ``LEDGER_ITEM_SECONDS``: the work of one item, between its start and done rows (0.02).
- ``LEDGER_TX_SECONDS``: work done inside each fenced transaction, between ``fence()`` (which
  holds the group's fence row lock from then on) and the insert (0).
- ``LEDGER_IDLE_TX_TIMEOUT_MS``: the connection's ``idle_in_transaction_session_timeout``, as
  the README advises for fenced writers (1000; 0 turns it off): a worker cut off in the middle
  of a transaction then holds the fence row at most this long after its last statement.
- ``LEDGER_ESCAPE=S``: the writer escapes the gate (deliberately unsafe): the gated process
  starts a writer in a session of its own that ignores SIGTERM, so neither the gate's SIGTERM
  and SIGKILL nor a signal to the pod's process group reaches it; it writes for S seconds and
  exits. ``LEDGER_ESCAPE_PIDFILE`` receives its pid. The gated process itself waits for SIGTERM.
"""

import asyncio
import os
import signal
import subprocess
import sys

import asyncpg

from singleton_sidecar.fencing import StaleToken, ensure_fence_table, fence

DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""


async def wait_for_sigterm() -> int:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    return 0


def escape(seconds: str) -> None:
    """Start the real writer outside the gate's reach."""
    env = {**os.environ, "LEDGER_ESCAPED": seconds}
    env.pop("LEDGER_ESCAPE", None)
    child = subprocess.Popen([sys.executable, __file__], env=env, start_new_session=True,
                             stdin=subprocess.DEVNULL)
    if pidfile := os.environ.get("LEDGER_ESCAPE_PIDFILE"):
        with open(pidfile, "a") as out:
            out.write(f"{child.pid}\n")
    print(f"escaped writer pid={child.pid}", file=sys.stderr, flush=True)


async def main() -> int:
    if seconds := os.environ.get("LEDGER_ESCAPE"):
        escape(seconds)
        return await wait_for_sigterm()
    dsn, group = os.environ["LEDGER_DSN"], os.environ["SINGLETON_GROUP"]
    fence_key = os.environ.get("SINGLETON_FENCE_KEY", group)
    token, identity = int(os.environ["SINGLETON_TOKEN"]), os.environ["SINGLETON_IDENTITY"]
    fenced = os.environ.get("LEDGER_FENCE", "on") != "off"
    item_seconds = float(os.environ.get("LEDGER_ITEM_SECONDS", "0.02"))
    tx_seconds = float(os.environ.get("LEDGER_TX_SECONDS", "0"))
    stop = asyncio.Event()
    if escaped := os.environ.get("LEDGER_ESCAPED"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        asyncio.get_running_loop().call_later(float(escaped), stop.set)
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    idle_tx_timeout = os.environ.get("LEDGER_IDLE_TX_TIMEOUT_MS", "1000")
    conn = await asyncpg.connect(dsn, server_settings={"idle_in_transaction_session_timeout": idle_tx_timeout})
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
                    if fenced:
                        await fence(conn, key=fence_key, token=token)
                    if tx_seconds:
                        await asyncio.sleep(tx_seconds)
                    await conn.execute(
                        "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                        group, identity, token, item, phase)
            except StaleToken as exc:
                print(f"fenced out: {exc}", file=sys.stderr, flush=True)
                return 3
            if phase == "start":
                await asyncio.sleep(item_seconds)  # the work of one item
        await asyncio.sleep(0.005)
    await conn.close()
    return 0


sys.exit(asyncio.run(main()))
