"""The acting detector: two apps acting at once is caught even where the fence keeps the
database clean.

- ``judge_acts`` on hand-made act logs, case by case (pure).
- The real worker (``tests/data/ledger_worker.py``) run by hand on the real PostgreSQL server,
  without a sidecar (its token and identity set directly): two workers with different tokens
  acting in overlapping time with fencing on leave a fenced ledger that judges clean while
  the act log shows the overlap; the same two run one after the other show none and an idle
  gap at least as long as the pause between them. Its options: children that act with its
  token, logged with their own pids and missed by a signal to it alone; a finishing time after
  SIGTERM; and no act when the act log refuses the row.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from singleton_testbed.ledger import ACTS_DDL, NO_TABLE, NOT_READ, LedgerReport, check_ledger, judge, judge_acts
from tests.support.paths import DATA

WORKER = str(DATA / "ledger_worker.py")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


# --- judge_acts on hand-made act logs ------------------------------------------------------------


@dataclass(frozen=True)
class A:
    """One act for a table below: token, identity, begin and end in ms after T0 (end None:
    never logged), its declared max, the pid that acted."""

    token: int
    began: int
    ended: int | None
    identity: str = ""
    max_ms: int = 50
    pid: int = 100
    decided: int | None = None
    """When the worker's deadline check before the act passed (ms after T0; None: no check)."""


def rows(acts: list[A]) -> list[dict[str, object]]:
    return [{"id": index, "token": a.token, "identity": a.identity or f"id-{a.token}", "pid": a.pid,
             "began_at": T0 + timedelta(milliseconds=a.began),
             "ended_at": None if a.ended is None else T0 + timedelta(milliseconds=a.ended),
             "max_seconds": a.max_ms / 1000,
             "decided_at": None if a.decided is None else T0 + timedelta(milliseconds=a.decided)}
            for index, a in enumerate(acts, start=1)]


@dataclass(frozen=True)
class Case:
    acts: list[A]
    overlaps: list[tuple[int, int, float, float, int]]
    """(earlier token, later token, seconds, simultaneous seconds, late acts of the earlier)."""
    handovers: list[float]
    """Signed seconds between consecutive actors."""


CASES = {
    "one term after another": Case(
        [A(5, 0, 2), A(5, 25, 27), A(7, 500, 502), A(7, 525, 527)], [], [0.473]),
    "a deposed leader acts once between two acts of its successor": Case(
        [A(5, 0, 2), A(7, 100, 102), A(5, 120, 122), A(7, 150, 152)], [(5, 7, 0.022, 0.0, 1)], [-0.022]),
    "two acts at the same moment": Case(
        [A(5, 0, 50), A(7, 40, 60)], [(5, 7, 0.010, 0.010, 0)], [-0.010]),
    "a stale token begins acting inside a newer token's term": Case(
        [A(7, 0, 2), A(7, 100, 102), A(5, 50, 53)], [(7, 5, 0.003, 0.0, 1)], [-0.052]),
    "one token, two identities at once (two leaders in one term)": Case(
        [A(5, 0, 10, "a"), A(5, 5, 15, "b")], [(5, 5, 0.005, 0.005, 0)], [-0.005]),
    "an act never ended counts until began + max_seconds, into the successor's term": Case(
        [A(5, 0, 2), A(5, 10, None, max_ms=200), A(7, 100, 102), A(7, 300, 302)],
        [(5, 7, 0.110, 0.002, 0)], [-0.110]),
    "a worker killed mid-act is over by began + max_seconds: no overlap": Case(
        [A(5, 0, 2), A(5, 10, None), A(7, 100, 102)], [], [0.040]),
    "intervals that only touch do not overlap": Case(
        [A(5, 0, 10), A(7, 10, 20)], [], [0.0]),
    "a long act spans two later terms, which do not overlap each other": Case(
        [A(5, 0, 1000), A(7, 100, 200), A(9, 300, 400)],
        [(5, 7, 0.100, 0.100, 0), (5, 9, 0.100, 0.100, 0)], [-0.900, -0.700]),
    "a worker's children (same token and identity, own pids) are one actor": Case(
        [A(5, 0, 10, pid=1), A(5, 5, 15, pid=2), A(5, 12, 20, pid=3), A(7, 30, 31)], [], [0.010]),
}


@pytest.mark.parametrize("name", CASES)
def test_judge_acts(name: str) -> None:
    case = CASES[name]
    report = judge_acts(rows(case.acts))
    assert report.checked and report.acts == len(case.acts)
    found = [(o.earlier, o.later, o.seconds, o.simultaneous, o.late_acts) for o in report.overlaps]
    assert len(found) == len(case.overlaps), found
    for got, want in zip(found, case.overlaps, strict=True):
        assert got == pytest.approx(want)
    assert [h.seconds for h in report.handovers] == [pytest.approx(s) for s in case.handovers]
    assert [g.seconds for g in report.idle_gaps] == [pytest.approx(s) for s in case.handovers if s > 0]
    assert report.safe == (not case.overlaps)
    assert len(report.open_acts) == sum(a.ended is None for a in case.acts)


def test_late_acts_decided_before_the_successor_are_told_apart() -> None:
    """A late act whose deadline check passed before the successor began (a stall between check
    and act) counts in ``late_decided``; one checked after it, or never checked, does not."""
    cases = {
        "checked in its term, stalled, acted late": ([A(5, 0, 2, decided=0), A(5, 150, 152, decided=20)], 1),
        "checked after the successor began": ([A(5, 0, 2, decided=0), A(5, 150, 152, decided=120)], 0),
        "never checked": ([A(5, 0, 2), A(5, 150, 152)], 0),
    }
    for name, (earlier, decided) in cases.items():
        report = judge_acts(rows([*earlier, A(7, 100, 102, decided=99), A(7, 200, 202, decided=199)]))
        assert [(o.earlier, o.later, o.late_acts, o.late_decided) for o in report.overlaps] == [
            (5, 7, 1, decided)], name
        assert not report.safe, name
        assert ("(1 decided before it)" in str(report.overlaps[0])) == bool(decided), name


def test_children_are_one_actor_with_their_pids() -> None:
    report = judge_acts(rows(CASES["a worker's children (same token and identity, own pids) are one actor"].acts))
    assert [(a.token, a.pids, a.acts) for a in report.actors] == [(5, (1, 2, 3), 3), (7, (100,), 1)]


def test_idle_gap_statistics_and_overruns() -> None:
    acts = [A(5, 0, 10), A(7, 110, 120), A(9, 420, 430), A(11, 630, 700, max_ms=50)]
    report = judge_acts(rows(acts))
    assert [g.seconds for g in report.idle_gaps] == [pytest.approx(0.1), pytest.approx(0.3), pytest.approx(0.2)]
    assert report.max_idle_gap == pytest.approx(0.3)
    assert report.idle_gap_p50 == pytest.approx(0.2) and report.idle_gap_p99 == pytest.approx(0.3)
    # The 70 ms act declared 50 ms: reported, since the same bound closes acts never ended.
    assert [a.token for a in report.overruns] == [11] and report.safe
    assert "1 acts longer than their max_seconds" in report.summary()


def test_no_acts_is_not_checked_and_says_so() -> None:
    report = judge_acts([])
    assert not report.checked and report.safe and "no acts logged" in report.note
    assert report.summary().startswith("acts NOT checked")


def test_an_acting_overlap_makes_a_clean_ledger_unsafe() -> None:
    def row(i: int, token: int, item: int, phase: str, ms: int) -> dict[str, object]:
        return {"id": i, "identity": f"id-{token}", "token": token, "item": item, "phase": phase,
                "at": T0 + timedelta(milliseconds=ms)}

    ledger = [row(1, 5, 1, "start", 0), row(2, 5, 1, "done", 20), row(3, 7, 1, "start", 100),
              row(4, 7, 1, "done", 120)]
    report = judge(ledger)  # type: ignore[arg-type]
    # The fenced ledger alone: safe, and the report says acting was not judged.
    assert report.safe and report.ledger_safe and not report.acts_checked
    assert report.acting.note == NOT_READ and "acts NOT checked" in report.summary()
    # Token 5's refused act at 110 ms left no row, only an act.
    report.acting = judge_acts(rows([A(5, 0, 1), A(5, 20, 21), A(7, 100, 101), A(5, 110, 112),
                                     A(7, 120, 121)]))
    assert report.acts_checked and report.ledger_safe and not report.safe
    assert [(o.earlier, o.later) for o in report.acting_overlaps] == [(5, 7)]
    assert "1 acting overlaps" in report.summary()


# --- the real worker on the real PostgreSQL server -----------------------------------------------


@dataclass
class Worker:
    popen: subprocess.Popen[bytes]
    log_path: Path
    token: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 10.0) -> int:
        return self.popen.wait(timeout)


Start = Callable[..., Worker]


@pytest.fixture
def group() -> str:
    return "acts-" + uuid.uuid4().hex[:10]


@pytest.fixture
def start(pg_dsn: str, group: str, tmp_path: Path) -> Iterator[Start]:
    """Ledger workers run by hand, each in a process group of its own (its children too)."""
    started: list[Worker] = []

    def run(token: int, identity: str | None = None, **options: str) -> Worker:
        log_path = tmp_path / f"worker-{token}-{len(started)}.log"
        env = {**os.environ, "LEDGER_DSN": pg_dsn, "SINGLETON_GROUP": group, "SINGLETON_TOKEN": str(token),
               "SINGLETON_IDENTITY": identity or f"w{token}", "LEDGER_FENCE": "on", **options}
        with log_path.open("ab") as out:
            popen = subprocess.Popen([sys.executable, WORKER], env=env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        started.append(Worker(popen, log_path, token))
        return started[-1]

    yield run
    for worker in started:
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(worker.popen.pid, signum)
            except ProcessLookupError:
                break
            time.sleep(0.3)
        worker.popen.wait(5)


async def fetch(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql, *args)
    except asyncpg.UndefinedTableError:
        return []
    finally:
        await conn.close()


async def wait_acts(dsn: str, group: str, what: str, enough: Callable[[list[asyncpg.Record]], bool],
                    timeout: float = 15.0) -> list[asyncpg.Record]:
    """Poll the group's ended acts until ``enough`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        acts = await fetch(dsn, "SELECT token, pid, began_at, ended_at, outcome FROM acts "
                                "WHERE group_name = $1 AND ended_at IS NOT NULL ORDER BY id", group)
        if enough(acts):
            return acts
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {len(acts)} acts"
        await asyncio.sleep(0.02)


def acted(token: int, count: int = 3) -> Callable[[list[asyncpg.Record]], bool]:
    return lambda acts: sum(a["token"] == token for a in acts) >= count


async def wait_path(path: Path, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(path.exists):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def wait_exit(worker: Worker, timeout: float = 15.0) -> int:
    return await asyncio.to_thread(worker.wait, timeout)


@pytest.mark.postgres
@pytest.mark.parametrize("first", [5, 7], ids=["older-token-first", "newer-token-first"])
async def test_two_fenced_workers_at_once_leave_a_clean_ledger_and_an_acting_overlap(
    start: Start, pg_dsn: str, group: str, first: int
) -> None:
    """The older token is fenced out at its first write after the newer one's (or at once),
    so the fenced ledger judges clean, yet it acted while the newer one was acting."""
    second = 12 - first
    earlier = start(first)
    await wait_acts(pg_dsn, group, f"token {first} to act", acted(first))
    later = start(second)
    await wait_acts(pg_dsn, group, f"token {second} to act", acted(second, 1))
    older = earlier if first < second else later
    newer = later if older is earlier else earlier
    assert await wait_exit(older) == 3, older.log()
    assert "fenced out" in older.log()
    await wait_acts(pg_dsn, group, "token 7 to act on", acted(7, 10))
    os.kill(newer.popen.pid, signal.SIGTERM)
    assert await wait_exit(newer) == 0, newer.log()

    report = await check_ledger(pg_dsn, group)
    assert report.ledger_safe, report.summary()
    assert not (report.overlaps or report.regressions or report.stale_accepted), report.summary()
    assert report.acts_checked, report.summary()
    assert [{o.earlier, o.later} for o in report.acting_overlaps] == [{5, 7}], report.summary()
    assert not report.safe and "1 acting overlaps" in report.summary()
    refused = await fetch(pg_dsn, "SELECT token FROM acts WHERE group_name = $1 AND outcome = 'refused'", group)
    assert [r["token"] for r in refused] == [5], "the older token's last act was refused, and logged"


@pytest.mark.postgres
@pytest.mark.parametrize("check", ["on", "off"])
async def test_an_act_stalled_after_its_deadline_check_is_logged_as_decided_in_its_term(
    start: Start, pg_dsn: str, group: str, tmp_path: Path, check: str
) -> None:
    """The worker checks its term's deadline (``SINGLETON_DEADLINE_FILE``), then stalls before
    its third act (``LEDGER_PAUSE_UNTIL``) until the test lets it go; meanwhile its term ends and a newer token acts.
    It acts once, late (the fence refuses it): the act log says that act was decided before the
    newer token began. Without the check the same late act is not decided: the campaign counts
    it as a failure."""
    deadline = tmp_path / "deadline"
    deadline.write_text(f"{time.monotonic() + 600:.6f}\n")
    release = tmp_path / "release"
    old = start(5, SINGLETON_DEADLINE_FILE=str(deadline), LEDGER_PAUSE_UNTIL=str(release), LEDGER_DEADLINE_CHECK=check)
    await wait_acts(pg_dsn, group, "token 5's first item", acted(5, 2))
    # Its check before the third act has passed only once it stalls: ending the term before
    # then would stop it at that check instead (a race the first version of this test lost).
    await wait_path(tmp_path / "release.stalled", "token 5 to stall after its deadline check")
    deadline.write_text("0\n")  # the term is over: no act may begin from now on
    new = start(7)
    await wait_acts(pg_dsn, group, "token 7 to act", acted(7, 1))
    release.touch()  # the stalled act goes ahead now, after token 7's first
    assert await wait_exit(old) == 3, old.log()
    assert "fenced out" in old.log()
    os.kill(new.popen.pid, signal.SIGTERM)
    assert await wait_exit(new) == 0, new.log()

    report = await check_ledger(pg_dsn, group)
    assert report.ledger_safe, report.summary()
    assert [(o.earlier, o.later, o.late_acts, o.late_decided) for o in report.acting_overlaps] == [
        (5, 7, 1, 1 if check == "on" else 0)], report.summary()
    decided = await fetch(pg_dsn, "SELECT token, decided_at IS NOT NULL AS decided FROM acts "
                                  "WHERE group_name = $1 ORDER BY id", group)
    assert {(r["token"], r["decided"]) for r in decided} == {(5, check == "on"), (7, False)}


@pytest.mark.postgres
async def test_one_after_the_other_no_acting_overlap_and_the_idle_gap(start: Start, pg_dsn: str, group: str) -> None:
    pause = 0.3
    for token in (5, 7):
        worker = start(token)
        await wait_acts(pg_dsn, group, f"token {token} to act", acted(token))
        os.kill(worker.popen.pid, signal.SIGTERM)
        assert await wait_exit(worker) == 0, worker.log()
        await asyncio.sleep(pause)
    report = await check_ledger(pg_dsn, group)
    assert report.safe and report.acts_checked, report.summary()
    assert not report.acting_overlaps
    assert [(a.token, a.identity) for a in report.acting.actors] == [(5, "w5"), (7, "w7")]
    # Token 5 ended its last act before it exited; token 7 began its first after it started.
    assert [(g.before, g.after) for g in report.idle_gaps] == [(5, 7)]
    assert pause <= report.acting.max_idle_gap < pause + 5, report.summary()
    assert not report.acting.open_acts


def process(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of a live process, None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), int(fields[2]), fields[0])


@pytest.mark.postgres
async def test_children_act_with_their_pids_and_outlive_a_signal_to_their_parent(
    start: Start, pg_dsn: str, group: str
) -> None:
    worker = start(5, LEDGER_CHILDREN="2")
    parent = worker.popen.pid
    acts = await wait_acts(pg_dsn, group, "the worker and its 2 children to act",
                           lambda acts: len({a["pid"] for a in acts}) == 3)
    children = sorted({a["pid"] for a in acts} - {parent})
    for child in children:
        info = process(child)
        assert info is not None and info[:2] == (parent, parent), f"child {child}: {info}"  # its child, its group
    # A gate that signals only its direct child: the parent goes, its children act on.
    os.kill(parent, signal.SIGTERM)
    assert await wait_exit(worker) == 0, worker.log()
    gone = datetime.now(UTC)
    await wait_acts(pg_dsn, group, "both children to act after their parent exited",
                    lambda acts: {a["pid"] for a in acts if a["began_at"] > gone} == set(children))
    os.killpg(parent, signal.SIGTERM)  # the group: the children finish their items and exit
    deadline = time.monotonic() + 10
    while any(process(child) for child in children):
        assert time.monotonic() < deadline, "the children outlived SIGTERM"
        await asyncio.sleep(0.05)

    report = await check_ledger(pg_dsn, group)
    assert report.safe and report.acts_checked, report.summary()
    assert [(a.token, a.pids) for a in report.acting.actors] == [(5, tuple(sorted([parent, *children])))]
    assert not report.lost_items, "each process numbers its own items, and every one finished"


@pytest.mark.postgres
async def test_finish_seconds_keeps_acting_after_sigterm(start: Start, pg_dsn: str, group: str) -> None:
    finish = 0.6
    worker = start(5, LEDGER_FINISH_SECONDS=str(finish))
    await wait_acts(pg_dsn, group, "token 5 to act", acted(5))
    termed = time.time()
    os.kill(worker.popen.pid, signal.SIGTERM)
    assert await wait_exit(worker) == 0, worker.log()
    exited = time.time()
    assert exited - termed >= finish
    acts = await fetch(pg_dsn, "SELECT began_at FROM acts WHERE group_name = $1", group)
    last = max(a["began_at"].timestamp() for a in acts)
    assert termed + finish - 0.2 < last < exited, "it acted until about S seconds after SIGTERM, then stopped"


@pytest.mark.postgres
async def test_no_act_when_the_act_log_refuses_it(start: Start, pg_dsn: str, group: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    constraint = f"refuse_{group.replace('-', '_')}"
    try:
        await conn.execute("SELECT pg_advisory_lock(777)")
        await conn.execute(ACTS_DDL)
        await conn.execute("SELECT pg_advisory_unlock(777)")
        await conn.execute(f"ALTER TABLE acts ADD CONSTRAINT {constraint} CHECK (group_name <> '{group}') NOT VALID")
        worker = start(5)
        assert await wait_exit(worker) == 4, worker.log()
        assert "act log refused the act, not acting" in worker.log()
    finally:
        await conn.execute(f"ALTER TABLE acts DROP CONSTRAINT IF EXISTS {constraint}")
        await conn.close()
    assert not await fetch(pg_dsn, "SELECT id FROM ledger WHERE group_name = $1", group), "it acted unlogged"


@pytest.mark.postgres
async def test_without_an_acts_table_the_report_says_acting_was_not_checked(pg_dsn: str, group: str) -> None:
    """A database whose writers do not log acts (here: a schema of its own holding only a
    ledger): the report passes the ledger and says the acting went unjudged."""
    schema = group.replace("-", "_")
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        await conn.execute(f"CREATE TABLE {schema}.ledger (id bigserial PRIMARY KEY, group_name text, identity text, "
                           "token bigint, item bigint, phase text, at timestamptz DEFAULT clock_timestamp())")
        await conn.execute(f"INSERT INTO {schema}.ledger (group_name, identity, token, item, phase) "
                           "VALUES ($1, 'w5', 5, 1, 'start'), ($1, 'w5', 5, 1, 'done')", group)
        report: LedgerReport = await check_ledger(f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}search_path={schema}",
                                                  group)
    finally:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await conn.close()
    assert report.rows == 2 and report.safe and not report.acts_checked
    assert report.acting.note == NO_TABLE and "acts NOT checked (no acts table" in report.summary()
