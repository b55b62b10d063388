"""A test workload for the exec gate: while it runs (= while its sidecar leads), it
appends a row every few milliseconds to a ledger through the fenced-write helper.

Each item is "in flight" from its start row to its done row; on SIGTERM it finishes the
item in flight and exits, so a drain that waits for it loses nothing.

Every phase write is also an *act*, the stand-in for what an app does outside the database
(an e-mail, an HTTP call) that no fence can refuse. It follows the act protocol of
``singleton_testbed.actlog`` (shared with client-go's worker in ``benchmarks/clientgo``): before
each act it commits a row to the unfenced act log (``acts``, ``singleton_testbed.ledger.ACTS_DDL``)
on a connection of its own, so neither a refused or failed fenced transaction nor a wait for the fence row lock
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
- ``LEDGER_GATE_DIR``: the file gate's folder (``gate.sh``'s flags): under the file gate the
  deadline lives in its ``leader`` flag (``<token> <deadline> <grace>``, the deadline on the
  boot-time clock in centiseconds, as ``/proc/uptime`` shows it). With the deadline check on,
  the worker then begins an act only while that flag exists, names its token, and its deadline
  has not passed: the file-gated twin of ``SINGLETON_DEADLINE_FILE``.
- ``LEDGER_PAUSE_UNTIL=PATH``: stall between the deadline check before the third act (item 2's
  start) and that act until PATH exists, as a whole-pod freeze landing there would: the act then
  comes late, decided in its term (``decided_at`` in the act log says when the check passed).
  The worker creates ``PATH.stalled`` once it stalls there, so that a test ends the term only
  after the check it means to outlive has passed.
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
import time

import asyncpg

from singleton_sdk.asyncpg import StaleToken, fence
from singleton_testbed.actlog import FAILED, REFUSED, WRITTEN, ActLog, create_tables

PAUSED_ACT = 3
"""``LEDGER_PAUSE_UNTIL`` stalls this act (item 2's start): the worker has acted before it."""
CHILD_ITEMS = 1_000_000_000
"""Child ``n`` numbers its items from ``n * CHILD_ITEMS``: the ledger keys items by (token, item)."""


def wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def stall_until(path: str) -> None:
    """Say so in ``path.stalled``, then wait for ``path``."""
    with open(f"{path}.stalled", "w"):
        pass
    wait_for_file(path)


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


def past_gate_flag(directory: str, token: int) -> bool:
    """The file gate's flag says this term may not act now: no flag (the term ended or was never
    this replica's), another term's token, or its deadline passed on the boot-time clock."""
    try:
        with open(os.path.join(directory, "leader")) as source:
            fields = source.read().split()
        flag_token, deadline = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return True
    return flag_token != token or time.clock_gettime(time.CLOCK_BOOTTIME) * 100 >= deadline


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
    await create_tables(conn)
    acts = await ActLog.connect(dsn, group, identity, token, act_max_seconds)
    if children:
        start_children(children)
    item = first_item
    check = os.environ.get("LEDGER_DEADLINE_CHECK", "on") != "off"
    deadline_file = os.environ.get("SINGLETON_DEADLINE_FILE") if check else None
    gate_dir = os.environ.get("LEDGER_GATE_DIR") if check else None
    pause_until = os.environ.get("LEDGER_PAUSE_UNTIL")
    acts_done = 0
    while not stop.is_set():
        item += 1
        for phase in ("start", "done"):
            if ((deadline_file is not None and past_deadline(deadline_file))
                    or (gate_dir is not None and past_gate_flag(gate_dir, token))):
                print("the term's deadline has passed: no new act", file=sys.stderr, flush=True)
                await acts.close()
                await conn.close()
                return 0
            decided = time.time() if deadline_file is not None or gate_dir is not None else None
            acts_done += 1
            if acts_done == PAUSED_ACT and pause_until:
                await asyncio.to_thread(stall_until, pause_until)  # a stall between the check and the act
            try:
                act = await acts.begin(item, phase, decided=decided)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                print(f"act log refused the act, not acting: {exc!r}", file=sys.stderr, flush=True)
                return 4
            outcome = FAILED
            try:
                async with conn.transaction():
                    if fenced:
                        await fence(conn, key=fence_key, token=token)
                    if tx_seconds:
                        await asyncio.sleep(tx_seconds)
                    await conn.execute(
                        "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1,$2,$3,$4,$5)",
                        group, identity, token, item, phase)
                outcome = WRITTEN
            except StaleToken as exc:
                outcome = REFUSED
                print(f"fenced out: {exc}", file=sys.stderr, flush=True)
                return 3
            finally:
                await acts.end_quietly(act, time.time(), outcome)
            if phase == "start":
                await asyncio.sleep(item_seconds)  # the work of one item
        await asyncio.sleep(0.005)
    await acts.close()
    await conn.close()
    return 0


sys.exit(asyncio.run(main()))
