"""A test workload for the exec gate: while it runs (= while its sidecar leads), it
appends a row every few milliseconds to a ledger through the fenced-write helper.

Each item is "in flight" from its start row to its done row; on SIGTERM it finishes the
item in flight and exits, so a drain that waits for it loses nothing.

Every phase write is also an *act*, the stand-in for what an app does outside the database
(an e-mail, an HTTP call) that no fence can refuse. Before each one the worker commits a row
to the unfenced act log (``acts``, ``singleton_testbed.ledger.ACTS_DDL``) on a connection of
its own, so neither a refused or failed fenced transaction nor a wait for the fence row lock
can hide the act; if that insert fails it does not act (it exits 4). After the act it logs
the end and the outcome (written, refused, failed). ``began_at`` and ``ended_at`` come from
this process's clock (``time.time()``), so the checker may compare acts of several workers
only when they share one clock: every worker of a test or campaign runs on one machine.
Each row declares ``max_seconds``, the longest this worker lets an act count for when its end
is never logged (it was killed or lost its connection mid-act): see ``LEDGER_ACT_MAX_SECONDS``.

Options (environment; the defaults are the safe behaviour the tests rely on):

- ``LEDGER_FENCE=off``: write without ``fence()``, as an app that ignores its token would
  (deliberately unsafe: the ledger checker must catch what follows).
- ``LEDGER_ITEM_SECONDS``: the work of one item, between its start and done rows (0.02).
- ``LEDGER_TX_SECONDS``: work done inside each fenced transaction, between ``fence()`` (which
  holds the group's fence row lock from then on) and the insert (0).
- ``LEDGER_IDLE_TX_TIMEOUT_MS``: the connection's ``idle_in_transaction_session_timeout``, as
  the README advises for fenced writers (1000; 0 turns it off): a worker cut off in the middle
  of a transaction then holds the fence row at most this long after its last statement.
- ``LEDGER_ACT_MAX_SECONDS``: the ``max_seconds`` declared for each act (0.05 +
  ``LEDGER_TX_SECONDS``). The checker closes an act never ended at ``began + max_seconds``; too
  long a bound makes a worker killed mid-act look as if it acted on into its successor's term
  (failover after a crash can take ~100 ms), too short a one is reported as overruns.
- ``LEDGER_FINISH_SECONDS=S``: after SIGTERM, go on acting (working items) for S more seconds,
  then finish the item in flight and exit: an app that needs S seconds to wind down (0).
- ``LEDGER_CHILDREN=N``: start N child processes that act too (their own items, with the same
  token and identity, each act logged with the child's pid). They are plain children, in this
  process's process group, that nothing here signals: a gate that signals only its direct child
  misses them (so does ``PR_SET_PDEATHSIG``, which a child does not inherit); signalled
  themselves, they behave as this worker does (SIGTERM, then ``LEDGER_FINISH_SECONDS``). A
  test starts the worker in a process group of its own to be able to end them (0).
- ``LEDGER_DEADLINE_CHECK=off``: do not check ``SINGLETON_DEADLINE_FILE`` (the exec gate's
  term deadline) before each act. On (the default), a worker never begins an act past its
  term's deadline, as a deadline-aware app would; off, it acts like an app that cannot check.
- ``LEDGER_ESCAPE=S``: the writer escapes the gate (deliberately unsafe): the gated process
  starts a writer in a session of its own that ignores SIGTERM, so neither the gate's SIGTERM
  and SIGKILL nor a signal to the pod's process group reaches it; it writes for S seconds and
  exits. ``LEDGER_ESCAPE_PIDFILE`` receives its pid. The gated process itself waits for SIGTERM.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import asyncpg

from singleton_sidecar.fencing import StaleToken, ensure_fence_table, fence
from singleton_testbed.ledger import ACTS_DDL

DDL = """
CREATE TABLE IF NOT EXISTS ledger (
    id bigserial PRIMARY KEY, group_name text, identity text, token bigint, item bigint,
    phase text, at timestamptz DEFAULT clock_timestamp()
)
"""
CHILD_ITEMS = 1_000_000_000
"""Child ``n`` numbers its items from ``n * CHILD_ITEMS``: the ledger keys items by (token, item)."""


def wall(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class ActLog:
    """The unfenced act log, on a connection of its own (autocommit: each row is committed
    before the act it announces)."""

    def __init__(self, conn: asyncpg.Connection, group: str, identity: str, token: int, max_seconds: float) -> None:
        self.conn, self.group, self.identity, self.token = conn, group, identity, token
        self.max_seconds = max_seconds

    async def begin(self, item: int, phase: str) -> int:
        began = time.time()  # before the insert: the logged interval covers the act whatever the insert takes
        act_id = await self.conn.fetchval(
            "INSERT INTO acts (group_name, identity, token, pid, item, phase, began_at, max_seconds) "
            "VALUES ($1,$2,$3,$4,$5,$6,$7,$8) RETURNING id",
            self.group, self.identity, self.token, os.getpid(), item, phase, wall(began), self.max_seconds)
        return int(act_id)

    async def end(self, act_id: int, ended: float, outcome: str) -> None:
        await self.conn.execute("UPDATE acts SET ended_at = $2, outcome = $3 WHERE id = $1",
                                act_id, wall(ended), outcome)


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


def start_children(count: int) -> list[subprocess.Popen[bytes]]:
    """Plain children: same process group, no signal forwarded, not waited for."""
    children = []
    for number in range(1, count + 1):
        env = {**os.environ, "LEDGER_CHILDREN": "0", "LEDGER_CHILD": str(number)}
        children.append(subprocess.Popen([sys.executable, __file__], env=env, stdin=subprocess.DEVNULL))
    print(f"children pids={[c.pid for c in children]}", file=sys.stderr, flush=True)
    return children


def stop_event(finish_seconds: float) -> asyncio.Event:
    """Set when the worker is to finish its item in flight and exit: ``finish_seconds`` after
    the first SIGTERM, or after ``LEDGER_ESCAPED`` seconds for an escaped writer (deaf to SIGTERM)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if escaped := os.environ.get("LEDGER_ESCAPED"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        loop.call_later(float(escaped), stop.set)
        return stop
    heard: list[bool] = []

    def on_sigterm() -> None:
        if heard:
            return  # the first SIGTERM starts the one finishing time; later ones do not extend it
        heard.append(True)
        if finish_seconds > 0:
            print(f"SIGTERM: acting {finish_seconds:g}s more", file=sys.stderr, flush=True)
            loop.call_later(finish_seconds, stop.set)
        else:
            stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    return stop


def past_deadline(path: str) -> bool:
    """The exec gate's deadline file (monotonic seconds; 0 once the term ended): checked before
    every act, so a worker woken from a freeze of its whole pod never begins an act after its
    term. A missing or unreadable file is not a deadline (the keeper may not have written it yet)."""
    try:
        with open(path) as source:
            deadline = float(source.read().strip() or "inf")
    except (OSError, ValueError):
        return False
    return time.monotonic() >= deadline


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
    act_max_seconds = float(os.environ.get("LEDGER_ACT_MAX_SECONDS", str(0.05 + tx_seconds)))
    finish_seconds = float(os.environ.get("LEDGER_FINISH_SECONDS", "0"))
    children = int(os.environ.get("LEDGER_CHILDREN", "0"))
    first_item = int(os.environ.get("LEDGER_CHILD", "0")) * CHILD_ITEMS
    stop = stop_event(finish_seconds)
    idle_tx_timeout = os.environ.get("LEDGER_IDLE_TX_TIMEOUT_MS", "1000")
    conn = await asyncpg.connect(dsn, server_settings={"idle_in_transaction_session_timeout": idle_tx_timeout})
    await conn.execute("SELECT pg_advisory_lock(777)")
    try:
        await conn.execute(DDL)
        await conn.execute(ACTS_DDL)
        await ensure_fence_table(conn)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(777)")
    acts = ActLog(await asyncpg.connect(dsn), group, identity, token, act_max_seconds)
    if children:
        start_children(children)
    item = first_item
    deadline_file = os.environ.get("SINGLETON_DEADLINE_FILE") if os.environ.get("LEDGER_DEADLINE_CHECK",
                                                                                  "on") != "off" else None
    while not stop.is_set():
        item += 1
        for phase in ("start", "done"):
            if deadline_file is not None and past_deadline(deadline_file):
                print("the term's deadline has passed: no new act", file=sys.stderr, flush=True)
                await acts.conn.close()
                await conn.close()
                return 0
            try:
                act = await acts.begin(item, phase)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                print(f"act log refused the act, not acting: {exc!r}", file=sys.stderr, flush=True)
                return 4
            outcome = "failed"
            try:
                async with conn.transaction():
                    if fenced:
                        await fence(conn, key=fence_key, token=token)
                    if tx_seconds:
                        await asyncio.sleep(tx_seconds)
                    await conn.execute(
                        "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                        group, identity, token, item, phase)
                outcome = "written"
            except StaleToken as exc:
                outcome = "refused"
                print(f"fenced out: {exc}", file=sys.stderr, flush=True)
                return 3
            finally:
                ended = time.time()
                # Best effort: an end not logged is closed by the checker at began + max_seconds.
                with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await acts.end(act, ended, outcome)
            if phase == "start":
                await asyncio.sleep(item_seconds)  # the work of one item
        await asyncio.sleep(0.005)
    await acts.conn.close()
    await conn.close()
    return 0


sys.exit(asyncio.run(main()))
