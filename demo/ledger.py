"""The demo's view of the ledger the sample pollers write: the rows written since the last
poll, the last few writes for the live view, and the verdict, which the shipped checker
(``singleton_testbed.ledger``, the test suite's) gives on every row read so far.

Every acting leader writes one row when it starts an item and one when it is done, inside a
fenced transaction, with its identity and term token; ``at`` is the database's
``clock_timestamp()``. Rows are read in ``id`` order, which is commit order for fenced writes.
A **term** is the span of rows of one token; a **handover** goes from one term to the next,
and its gap (the time without a writer) is negative when the two terms overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from singleton_election.core.identity import pod_of
from singleton_testbed.ledger import LedgerJudge, LedgerReport

LEDGER_QUERY = """
SELECT id, identity, token, item, phase, at FROM ledger
WHERE group_name = $1 AND id > $2 ORDER BY id LIMIT 5000
"""
RECENT_WRITES = 10


@dataclass(frozen=True)
class TermSpan:
    token: int
    identity: str
    first: datetime
    last: datetime

    @property
    def pod(self) -> str:
        return pod_of(self.identity)


@dataclass(frozen=True)
class Write:
    """One ledger row, for the live view."""

    row_id: int
    pod: str
    token: int
    item: int
    phase: str
    at: datetime


@dataclass(frozen=True)
class Handover:
    """From one term to the next, in order of their first rows."""

    before: TermSpan
    after: TermSpan

    @property
    def gap(self) -> float:
        """Seconds without a writer (negative: the terms overlapped)."""
        return (self.after.first - self.before.last).total_seconds()


@dataclass
class Ledger:
    group: str
    last_id: int = 0
    recent: list[Write] = field(default_factory=list)
    report: LedgerReport = field(default_factory=LedgerReport)
    """The checker's verdict on every row read so far."""
    spans: dict[int, TermSpan] = field(default_factory=dict)
    """The terms of ``report``, by token, in order of their first rows."""
    _judge: LedgerJudge = field(default_factory=LedgerJudge)

    async def poll(self, conn: asyncpg.Connection) -> list[TermSpan]:
        """Read the rows written since the last call; returns the terms that started."""
        try:
            rows = await conn.fetch(LEDGER_QUERY, self.group, self.last_id)
        except asyncpg.UndefinedTableError:
            return []  # the pollers have not created it yet
        if not rows:
            return []
        begun = [int(row["token"]) for row in rows if self._judge.add(row)]
        self.last_id = max(self.last_id, *(int(row["id"]) for row in rows))
        writes = [Write(int(row["id"]), pod_of(str(row["identity"])), int(row["token"]), int(row["item"]),
                        str(row["phase"]), row["at"]) for row in rows]
        self.recent = [*self.recent, *writes][-RECENT_WRITES:]
        self.report = self._judge.report()
        self.spans = {token: TermSpan(token, identity, first, last)
                      for token, identity, first, last in self.report.terms}
        return [self.spans[token] for token in begun]

    def handovers(self) -> list[Handover]:
        """Each term against the term that, of those started before it, wrote last."""
        return [Handover(self.spans[h.before], self.spans[h.after]) for h in self.report.handovers]
