"""The ledger checker: judges safety from the outside, from what acting leaders wrote.

One set of rules for the test suite, the benchmarks (``judge``, ``check_ledger``) and the demo,
which feeds a ``LedgerJudge`` the rows of each poll as it reads them (``demo/ledger.py``).

The ledger (``tests/data/ledger_worker.py``, ``singleton-sample-poller``) holds one row per
phase of each item an acting leader works on: ``start`` then ``done``, with the group, the
writer's identity and term token, and ``at`` (the database's ``clock_timestamp()`` at the
insert). Rows are read in ``id`` order, which is commit order for fenced writes: ``fence``
takes the group's fence row lock before the insert draws its id and holds it until commit,
so a group's fenced transactions commit one at a time in id order. (Unfenced writes are read
in insert order, which is what the deliberately unsafe configurations need to be caught.)

What it reports (every list is empty when the group behaved):

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

Term = tuple[int, str, datetime, datetime]
"""(token, identity, first row, last row)."""


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

    @property
    def max_gap(self) -> float:
        return max((gap.seconds for gap in self.gaps), default=0.0)

    @property
    def safe(self) -> bool:
        """No overlap, no regression, no stale write accepted, no token shared."""
        return not (self.overlaps or self.regressions or self.stale_accepted or self.shared_tokens)

    def summary(self) -> str:
        return (f"{self.rows} rows, {len(self.terms)} terms: {len(self.overlaps)} overlaps, "
                f"{len(self.regressions)} regressions, {len(self.stale_accepted)} stale writes accepted, "
                f"{len(self.shared_tokens)} shared tokens, max gap {self.max_gap:.3f}s"
                + (f" ({len(self.long_gaps)} above {self.gap_bound:g}s)" if self.gap_bound is not None else "")
                + f", {len(self.lost_at_handover)} items lost at handovers")


async def read_ledger(dsn: str, group: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(
            "SELECT id, identity, token, item, phase, at FROM ledger WHERE group_name = $1 ORDER BY id", group)
    finally:
        await conn.close()


async def check_ledger(dsn: str, group: str, *, gap_bound: float | None = None) -> LedgerReport:
    return judge(await read_ledger(dsn, group), gap_bound=gap_bound)


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
