"""The ledger checker: judges safety from the outside, from what acting leaders wrote and did.

One set of rules for the test suite, the benchmarks (``judge``, ``check_ledger``) and the demo,
which feeds a ``LedgerJudge`` the rows of each poll as it reads them (``demo/ledger.py``).

Two records, judged together by ``check_ledger`` (one ``LedgerReport``; ``safe`` needs both):

**The fenced ledger** (``ledger``; ``tests/data/ledger_worker.py``, ``singleton-sample-poller``)
holds one row per phase of each item an acting leader works on: ``start`` then ``done``, with the
group, the writer's identity and term token, and ``at`` (the database's ``clock_timestamp()`` at
the insert). Rows are read in ``id`` order, which is commit order for fenced writes: ``fence``
takes the group's fence row lock before the insert draws its id and holds it until commit,
so a group's fenced transactions commit one at a time in id order. (Unfenced writes are read
in insert order, which is what the deliberately unsafe configurations need to be caught.)
It shows only what reached the database: the fence refuses a deposed leader's late writes, so
a deposed app that goes on *acting* (sending an e-mail, calling an HTTP API) leaves no trace.

What it reports (every list is empty when the group behaved; ``ledger_safe``):

- ``overlaps``: two terms writing in interleaved time: a term's first row is no later than
  the last row of a term that started before it.
- ``regressions``: the token going backwards in commit order: a row whose token is lower
  than the row committed just before it (one entry per backwards step).
- ``stale_accepted``: writes accepted from a stale token: every row whose token is lower than
  a token already seen in an earlier row. A regression is where a stale run begins; each row of
  the run is a stale write that committed.
- ``shared_tokens``: one token written by two identities (two leaders in one term).
- ``gaps``: the time without a writing leader between consecutive terms (last row of one term
  to the first row of the next, by start time); ``max_gap`` the largest, ``long_gaps`` those
  above ``gap_bound`` (the promised bound) when one is given. ``handovers`` holds every pair of
  consecutive terms, overlapping ones included (``seconds`` <= 0).
- ``lost_items`` / ``in_flight``: items started and never done. ``lost_at_handover`` keeps
  those of terms that a later term followed (the last term's open item may still be running).

**The act log** (``acts``, ``ACTS_DDL``; written through ``singleton_testbed.actlog`` by
``tests/data/ledger_worker.py`` and by client-go's worker in ``benchmarks/clientgo``) is
unfenced: before every act (each phase write) the worker commits a row saying it is acting
(``began_at``), on a connection of its own and before the fence is asked, and does not act if
that insert fails; after the act it fills in ``ended_at`` (and ``outcome``: written, refused,
failed). A refused act is still an act: an app with an unfenced side effect would have done
it. Times come from the worker's own clock (``time.time()``), not the database's: the judge
compares acts of different processes, so every worker of a run must share one clock (the test
suite and the campaign run them all on one machine). An act whose end was never logged (its
worker was killed, or lost its connection, mid-act) is closed at ``began_at + max_seconds``,
the longest the worker declared its act may take; ``overruns`` lists acts that took longer,
which says that declaration is too short for a killed act's end to be trusted.

``judge_acts`` (pure) and ``check_acts`` report, in an ``ActingReport`` (``LedgerReport.acting``):

- ``actors``: one per (token, identity), acting from its first act's begin to its last act's
  end (a worker's child processes share its token and identity: one actor).
- ``overlaps`` (``LedgerReport.acting_overlaps``): two actors (different tokens, or one token
  and two identities) whose acting intervals intersect: the later one began acting before the
  earlier one's last act ended. ``seconds`` is the length of the intersection; ``simultaneous``
  the part of it during which both were inside an act; ``late_acts`` how many acts the earlier
  one began once the later one was acting, and ``late_decided`` how many of those it had
  decided on before the later one began (``decided_at``: the moment its worker's check of its
  term's deadline passed, logged with the act; a stall between that check and the act, such as
  a whole-pod freeze, delays the act past its term, which no check can prevent: only a fence
  refuses it). Any overlap makes the report unsafe.
- ``handovers`` / ``idle_gaps``: the time without an actor between consecutive terms (last act
  end of one to first act begin of the next; ``idle_gaps`` keeps the positive ones), with
  ``max_idle_gap``, ``idle_gap_p50`` and ``idle_gap_p99``.
- ``checked`` (``LedgerReport.acts_checked``) is False, with ``note`` saying why, when there is
  no acts table or no act of the group: writers that do not log acts (the sample poller) leave
  the acting unjudged, and the report says so rather than passing it. ``judge`` and
  ``LedgerJudge`` judge the fenced ledger only (``acts_checked`` False).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import asyncpg

Term = tuple[int, str, datetime, datetime]
"""(token, identity, first row, last row)."""

ACTS_DDL = """
CREATE TABLE IF NOT EXISTS acts (
    id bigserial PRIMARY KEY, group_name text NOT NULL, identity text NOT NULL, token bigint NOT NULL,
    pid integer NOT NULL, item bigint, phase text, began_at timestamptz NOT NULL, ended_at timestamptz,
    max_seconds double precision NOT NULL, outcome text, decided_at timestamptz
);
ALTER TABLE acts ADD COLUMN IF NOT EXISTS decided_at timestamptz
"""
"""The act log, unfenced: here beside its judge so the worker that writes it and the tests that
tamper with it create the same table."""

NOT_READ = "acts not read: judge() and LedgerJudge judge the fenced ledger only (check_ledger reads both)"
NO_TABLE = ("no acts table in this database: its writers do not log their acts (only those of "
            "singleton_testbed.actlog do), so two apps acting at once would go unseen")


class Row(Protocol):
    """A row by column name: an ``asyncpg.Record`` or, in the unit tests, a dict."""

    def __getitem__(self, key: str, /) -> Any: ...

    def get(self, key: str, /) -> Any: ...


@dataclass(frozen=True)
class Gap:
    """Time without a writing leader, between the last row of one term and the first of the next
    (in ``LedgerReport.handovers``, zero or negative when the two terms overlapped)."""

    before: int
    after: int
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    def __str__(self) -> str:
        return f"{self.seconds:.3f}s without a writer between token {self.before} and token {self.after}"


@dataclass(frozen=True)
class Overlap:
    earlier: int
    later: int
    earlier_last: datetime
    later_first: datetime

    def __str__(self) -> str:
        return (f"token {self.earlier} wrote until {self.earlier_last}, token {self.later} from "
                f"{self.later_first}")


@dataclass(frozen=True)
class StaleWrite:
    row_id: int
    token: int
    newest_seen: int
    identity: str
    at: datetime

    def __str__(self) -> str:
        return (f"row {self.row_id}: token {self.token} ({self.identity}) committed after token "
                f"{self.newest_seen} at {self.at}")


@dataclass(frozen=True)
class OpenItem:
    token: int
    item: int
    started: datetime


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (0.0 for no values): always one of the values measured, so a
    p99 of few handovers is the worst of them rather than an interpolated guess."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


@dataclass(frozen=True)
class Act:
    """One logged act: ``ended`` is None when its end was never logged (see ``end``)."""

    id: int
    token: int
    identity: str
    pid: int
    began: datetime
    ended: datetime | None
    max_seconds: float
    decided: datetime | None = None
    """When the worker's check of its term's deadline passed before this act (None: it checked
    nothing)."""

    @classmethod
    def of(cls, row: Row) -> Act:
        return cls(int(row["id"]), int(row["token"]), str(row["identity"]), int(row["pid"]), row["began_at"],
                   row["ended_at"], float(row["max_seconds"]), row.get("decided_at"))

    @property
    def open(self) -> bool:
        return self.ended is None

    @property
    def end(self) -> datetime:
        """The logged end; for an open act the latest it can have ended, ``began + max_seconds``
        (its worker died or lost its connection mid-act, and the checker cannot see when)."""
        if self.ended is None:
            return self.began + timedelta(seconds=self.max_seconds)
        return max(self.ended, self.began)

    @property
    def overran(self) -> bool:
        return self.ended is not None and (self.ended - self.began).total_seconds() > self.max_seconds


@dataclass(frozen=True)
class Actor:
    """One (token, identity) acting: from its first act's begin to its last act's end."""

    token: int
    identity: str
    first: datetime
    last: datetime
    acts: int
    pids: tuple[int, ...]
    intervals: tuple[tuple[datetime, datetime], ...] = field(repr=False)
    """Its acts as disjoint intervals, in time order (overlapping acts of its processes merged)."""

    @classmethod
    def of(cls, acts: Sequence[Act]) -> Actor:
        merged: list[tuple[datetime, datetime]] = []
        for began, end in sorted((a.began, a.end) for a in acts):
            if merged and began <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((began, end))
        return cls(acts[0].token, acts[0].identity, merged[0][0], max(end for _, end in merged), len(acts),
                   tuple(sorted({a.pid for a in acts})), tuple(merged))

    def __str__(self) -> str:
        return f"token {self.token} ({self.identity})"


def _inside_both(a: Sequence[tuple[datetime, datetime]], b: Sequence[tuple[datetime, datetime]]) -> float:
    """Seconds during which both sets of disjoint, ordered intervals are inside an interval."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += (end - start).total_seconds()
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class ActingOverlap:
    """Two actors acting in intersecting intervals; ``earlier`` began acting first."""

    earlier: int
    earlier_identity: str
    later: int
    later_identity: str
    start: datetime
    """The later actor's first act."""
    end: datetime
    """Where the intersection ends: the first of the two actors' last act ends."""
    simultaneous: float
    """Seconds of it during which both were inside an act at the same moment."""
    late_acts: int
    """Acts the earlier actor began once the later one was acting."""
    late_decided: int = 0
    """Of ``late_acts``, those it had decided on (its deadline check passed) before the later
    one began acting: delayed between check and act, not begun by a deposed app that looked."""

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    def __str__(self) -> str:
        return (f"token {self.earlier} ({self.earlier_identity}) and token {self.later} ({self.later_identity}) "
                f"acted at once for {self.seconds:.3f}s from {self.start}: token {self.earlier} began "
                f"{self.late_acts} act{'' if self.late_acts == 1 else 's'} after token {self.later} began acting"
                + (f" ({self.late_decided} decided before it)" if self.late_decided else "") + ", "
                f"{self.simultaneous:.3f}s inside acts at the same moment")


@dataclass(frozen=True)
class IdleGap(Gap):
    """Time without an acting leader between consecutive actors (zero or negative in
    ``ActingReport.handovers`` when the two overlapped)."""

    def __str__(self) -> str:
        return f"{self.seconds:.3f}s without an actor between token {self.before} and token {self.after}"


@dataclass
class ActingReport:
    """What ``judge_acts`` found; ``checked`` False (with ``note``) when there was nothing to judge."""

    checked: bool = False
    note: str = ""
    acts: int = 0
    actors: list[Actor] = field(default_factory=list)
    overlaps: list[ActingOverlap] = field(default_factory=list)
    handovers: list[IdleGap] = field(default_factory=list)
    idle_gaps: list[IdleGap] = field(default_factory=list)
    open_acts: list[Act] = field(default_factory=list)
    """Acts whose end was never logged, closed at ``began + max_seconds``."""
    overruns: list[Act] = field(default_factory=list)
    """Acts that took longer than their ``max_seconds``: the bound assumed for open acts is short."""

    @property
    def safe(self) -> bool:
        """No two actors acting at once (vacuously true when nothing was checked: see ``checked``)."""
        return not self.overlaps

    @property
    def max_idle_gap(self) -> float:
        return max((gap.seconds for gap in self.idle_gaps), default=0.0)

    def idle_gap_percentile(self, fraction: float) -> float:
        """Over ``idle_gaps`` (the handovers where no one acted for a while); 0.0 without any."""
        return percentile([gap.seconds for gap in self.idle_gaps], fraction)

    @property
    def idle_gap_p50(self) -> float:
        return self.idle_gap_percentile(0.5)

    @property
    def idle_gap_p99(self) -> float:
        return self.idle_gap_percentile(0.99)

    def summary(self) -> str:
        if not self.checked:
            return f"acts NOT checked ({self.note})"
        longest = max((o.seconds for o in self.overlaps), default=0.0)
        return (f"{self.acts} acts by {len(self.actors)} actors ({len(self.open_acts)} never ended): "
                f"{len(self.overlaps)} acting overlaps" + (f" (longest {longest:.3f}s)" if self.overlaps else "")
                + f", idle gap max {self.max_idle_gap:.3f}s p50 {self.idle_gap_p50:.3f}s "
                  f"p99 {self.idle_gap_p99:.3f}s"
                + (f", {len(self.overruns)} acts longer than their max_seconds" if self.overruns else ""))


def judge_acts(rows: Iterable[Row]) -> ActingReport:
    """The acting verdict on one group's act rows (any order).

    Actors, not single acts, are intersected: a deposed app that wakes and acts once between
    two acts of its successor has not overlapped any one act of it, yet two apps were acting
    in the same stretch of time, which is what the gate promises against. The single-act
    intersections are kept as ``simultaneous`` for the size of the damage."""
    acts = [Act.of(row) for row in rows]
    if not acts:
        return ActingReport(note="no acts logged for this group: its writers do not log acts, or never acted")
    by_actor: dict[tuple[int, str], list[Act]] = {}
    for act in acts:
        by_actor.setdefault((act.token, act.identity), []).append(act)
    actors = sorted((Actor.of(group) for group in by_actor.values()),
                    key=lambda a: (a.first, a.last, a.token, a.identity))
    report = ActingReport(checked=True, acts=len(acts), actors=actors,
                          open_acts=sorted((a for a in acts if a.open), key=lambda a: a.began),
                          overruns=sorted((a for a in acts if a.overran), key=lambda a: a.began))
    for index, earlier in enumerate(actors):
        for later in actors[index + 1:]:
            if later.first < earlier.last or later.first == earlier.first:
                late = [a for a in by_actor[(earlier.token, earlier.identity)] if a.began >= later.first]
                decided = sum(1 for a in late if a.decided is not None and a.decided < later.first)
                report.overlaps.append(ActingOverlap(
                    earlier.token, earlier.identity, later.token, later.identity, later.first,
                    min(earlier.last, later.last), _inside_both(earlier.intervals, later.intervals), len(late),
                    decided))
    reach: Actor | None = None  # the actor that has acted until the latest so far
    for actor in actors:
        if reach is not None:
            report.handovers.append(IdleGap(reach.token, actor.token, reach.last, actor.first))
        if reach is None or actor.last > reach.last:
            reach = actor
    report.idle_gaps = [gap for gap in report.handovers if gap.seconds > 0]
    return report


@dataclass
class LedgerReport:
    terms: list[Term] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    lost_items: list[str] = field(default_factory=list)
    rows: int = 0
    overlap_details: list[Overlap] = field(default_factory=list)
    regression_details: list[StaleWrite] = field(default_factory=list)
    stale_accepted: list[StaleWrite] = field(default_factory=list)
    shared_tokens: list[str] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    handovers: list[Gap] = field(default_factory=list)
    gap_bound: float | None = None
    long_gaps: list[Gap] = field(default_factory=list)
    in_flight: list[OpenItem] = field(default_factory=list)
    lost_at_handover: list[OpenItem] = field(default_factory=list)
    acting: ActingReport = field(default_factory=lambda: ActingReport(note=NOT_READ))
    """The act log's verdict (``check_ledger`` fills it in)."""

    @property
    def max_gap(self) -> float:
        return max((gap.seconds for gap in self.gaps), default=0.0)

    @property
    def acts_checked(self) -> bool:
        """Whether acting was judged at all: False says ``safe`` speaks for the fenced ledger only."""
        return self.acting.checked

    @property
    def acting_overlaps(self) -> list[ActingOverlap]:
        return self.acting.overlaps

    @property
    def idle_gaps(self) -> list[IdleGap]:
        return self.acting.idle_gaps

    @property
    def ledger_safe(self) -> bool:
        """The fenced ledger alone: no overlap, no regression, no stale write accepted, no token shared."""
        return not (self.overlaps or self.regressions or self.stale_accepted or self.shared_tokens)

    @property
    def safe(self) -> bool:
        """The fenced ledger is safe and no two apps acted at once (as far as acts were logged:
        see ``acts_checked``)."""
        return self.ledger_safe and self.acting.safe

    def summary(self) -> str:
        return (f"{self.rows} rows, {len(self.terms)} terms: {len(self.overlaps)} overlaps, "
                f"{len(self.regressions)} regressions, {len(self.stale_accepted)} stale writes accepted, "
                f"{len(self.shared_tokens)} shared tokens, max gap {self.max_gap:.3f}s"
                + (f" ({len(self.long_gaps)} above {self.gap_bound:g}s)" if self.gap_bound is not None else "")
                + f", {len(self.lost_at_handover)} items lost at handovers; {self.acting.summary()}")


async def _fetch_ledger(conn: asyncpg.Connection, group: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT id, identity, token, item, phase, at FROM ledger WHERE group_name = $1 ORDER BY id", group)


async def _fetch_acts(conn: asyncpg.Connection, group: str) -> list[asyncpg.Record] | None:
    """The group's acts, or None when the database has no acts table."""
    try:
        return await conn.fetch(
            "SELECT id, identity, token, pid, began_at, ended_at, max_seconds, decided_at FROM acts "
            "WHERE group_name = $1 "
            "ORDER BY id", group)
    except asyncpg.UndefinedTableError:
        return None


async def read_ledger(dsn: str, group: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await _fetch_ledger(conn, group)
    finally:
        await conn.close()


async def read_acts(dsn: str, group: str) -> list[asyncpg.Record] | None:
    """The group's act rows; None when there is no acts table (not the same as no acts)."""
    conn = await asyncpg.connect(dsn)
    try:
        return await _fetch_acts(conn, group)
    finally:
        await conn.close()


def _acting(rows: list[asyncpg.Record] | None) -> ActingReport:
    return ActingReport(note=NO_TABLE) if rows is None else judge_acts(rows)


async def check_acts(dsn: str, group: str) -> ActingReport:
    """The acting verdict alone (``check_ledger`` includes it)."""
    return _acting(await read_acts(dsn, group))


async def check_ledger(dsn: str, group: str, *, gap_bound: float | None = None) -> LedgerReport:
    """Both verdicts, read on one connection: the fenced ledger and the act log (see
    ``LedgerReport.acts_checked`` for whether there was an act log to read)."""
    conn = await asyncpg.connect(dsn)
    try:
        report = judge(await _fetch_ledger(conn, group), gap_bound=gap_bound)
        report.acting = _acting(await _fetch_acts(conn, group))
    finally:
        await conn.close()
    return report


def judge(rows: list[asyncpg.Record], *, gap_bound: float | None = None) -> LedgerReport:
    """The report for one group's rows, given in id (commit) order."""
    ledger = LedgerJudge(gap_bound=gap_bound)
    for row in rows:
        ledger.add(row)
    return ledger.report()


class LedgerJudge:
    """The rules, fed one row at a time in id (commit) order; ``report`` judges the rows fed so
    far. Per row it keeps only running state, so a live reader (the demo) need not re-read the
    ledger to judge it again."""

    def __init__(self, *, gap_bound: float | None = None) -> None:
        self.gap_bound = gap_bound
        self.rows = 0
        self._regressions: list[str] = []
        self._regression_details: list[StaleWrite] = []
        self._stale_accepted: list[StaleWrite] = []
        self._spans: dict[int, tuple[str, datetime, datetime]] = {}
        """token -> (its first writer, first row, last row)."""
        self._identities: dict[int, set[str]] = {}
        self._open_items: dict[tuple[int, int], datetime] = {}
        self._previous = 0
        self._newest = 0

    def add(self, row: asyncpg.Record) -> bool:
        """Take the next row; True when it is the first row of its token (a term begins)."""
        token, identity, at = int(row["token"]), str(row["identity"]), row["at"]
        self.rows += 1
        if token < self._previous:
            self._regressions.append(f"token {token} written after {self._previous} (row {row['id']})")
            self._regression_details.append(StaleWrite(int(row["id"]), token, self._previous, identity, at))
        if token < self._newest:
            self._stale_accepted.append(StaleWrite(int(row["id"]), token, self._newest, identity, at))
        self._previous, self._newest = token, max(self._newest, token)
        span = self._spans.get(token)
        if span is not None:
            writer, first, last = span
            self._spans[token] = (writer, min(first, at), max(last, at))
        else:
            self._spans[token] = (identity, at, at)
        self._identities.setdefault(token, set()).add(identity)
        key = (token, int(row["item"]))
        if row["phase"] == "start":
            self._open_items[key] = at
        else:
            self._open_items.pop(key, None)
        return span is None

    def report(self) -> LedgerReport:
        """The verdict on the rows so far (a new report each call: later rows do not change it)."""
        report = LedgerReport(rows=self.rows, gap_bound=self.gap_bound, regressions=list(self._regressions),
                              regression_details=list(self._regression_details),
                              stale_accepted=list(self._stale_accepted))
        report.terms = sorted(((t, s[0], s[1], s[2]) for t, s in self._spans.items()), key=lambda term: term[2])
        report.shared_tokens = [f"token {t} written by {sorted(ids)}" for t, ids in sorted(self._identities.items())
                                if len(ids) > 1]
        reach: Term | None = None  # the started term that writes until the latest
        for term in report.terms:
            if reach is not None and term[2] <= reach[3]:
                report.overlap_details.append(Overlap(reach[0], term[0], reach[3], term[2]))
            if reach is not None:
                report.handovers.append(Gap(reach[0], term[0], reach[3], term[2]))
            if reach is None or term[3] > reach[3]:
                reach = term
        report.gaps = [gap for gap in report.handovers if gap.seconds > 0]
        report.overlaps = [str(overlap) for overlap in report.overlap_details]
        if self.gap_bound is not None:
            report.long_gaps = [gap for gap in report.gaps if gap.seconds > self.gap_bound]
        report.in_flight = sorted((OpenItem(t, i, began) for (t, i), began in self._open_items.items()),
                                  key=lambda o: o.started)
        report.lost_items = [f"token {o.token} item {o.item}" for o in report.in_flight]
        final = report.terms[-1][0] if report.terms else None
        report.lost_at_handover = [o for o in report.in_flight if o.token != final]
        return report
