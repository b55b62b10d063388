"""The demo's judge: reads the ledger the sample pollers write and says whether two terms
ever overlapped (the same rules as the test suite's checker, ``tests/ledger.py``, which is
not shipped).

Every acting leader writes one row when it starts an item and one when it is done, inside a
fenced transaction, with its identity and term token; ``at`` is the database's
``clock_timestamp()``. Rows are read in ``id`` order, which is commit order for fenced writes.

- a **term** is the span of rows of one token (first row, last row);
- an **overlap**: a term's first row is no later than the last row of a term that started
  before it (two leaders working at once);
- a **gap**: the time without a writer between consecutive terms; the handover's cost;
- a **regression**: a token lower than the row committed just before it; a **stale write**:
  a row whose token is lower than one already seen (fencing should make both impossible);
- a **shared token**: one token written by two identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from singleton_sidecar.core.identity import pod_of

LEDGER_QUERY = """
SELECT id, identity, token, item, phase, at FROM ledger
WHERE group_name = $1 AND id > $2 ORDER BY id LIMIT 5000
"""


@dataclass
class TermSpan:
    token: int
    identity: str
    first: datetime
    last: datetime
    rows: int = 0

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
    rows: int = 0
    last_id: int = 0
    spans: dict[int, TermSpan] = field(default_factory=dict)
    identities: dict[int, set[str]] = field(default_factory=dict)
    regressions: int = 0
    stale_writes: int = 0
    open_items: dict[tuple[int, int], datetime] = field(default_factory=dict)
    recent: list[Write] = field(default_factory=list)
    _previous: int = 0
    _newest: int = 0

    def add(self, row: Any) -> TermSpan | None:
        """Take one row (in id order); returns the new term when this row starts one."""
        token, identity, at = int(row["token"]), str(row["identity"]), row["at"]
        self.rows += 1
        self.last_id = max(self.last_id, int(row["id"]))
        if token < self._previous:
            self.regressions += 1
        if token < self._newest:
            self.stale_writes += 1
        self._previous, self._newest = token, max(self._newest, token)
        self.identities.setdefault(token, set()).add(identity)
        span = self.spans.get(token)
        started = None
        if span is None:
            span = started = self.spans[token] = TermSpan(token, identity, at, at)
        span.first, span.last = min(span.first, at), max(span.last, at)
        span.rows += 1
        key = (token, int(row["item"]))
        if row["phase"] == "start":
            self.open_items[key] = at
        else:
            self.open_items.pop(key, None)
        self.recent = [*self.recent[-9:], Write(int(row["id"]), pod_of(identity), token, int(row["item"]),
                                                str(row["phase"]), at)]
        return started

    async def poll(self, conn: asyncpg.Connection) -> list[TermSpan]:
        """Read the rows written since the last call; returns the terms that started."""
        try:
            rows = await conn.fetch(LEDGER_QUERY, self.group, self.last_id)
        except asyncpg.UndefinedTableError:
            return []  # the pollers have not created it yet
        return [span for row in rows if (span := self.add(row)) is not None]

    # --- the verdict -----------------------------------------------------------------------

    def terms(self) -> list[TermSpan]:
        return sorted(self.spans.values(), key=lambda span: span.first)

    def handovers(self) -> list[Handover]:
        """Consecutive terms: each against the term that, of those started before it, wrote last."""
        result: list[Handover] = []
        reach: TermSpan | None = None
        for span in self.terms():
            if reach is not None:
                result.append(Handover(reach, span))
            if reach is None or span.last > reach.last:
                reach = span
        return result

    def overlaps(self) -> list[Handover]:
        return [handover for handover in self.handovers() if handover.gap <= 0]

    def max_gap(self) -> float:
        return max((handover.gap for handover in self.handovers()), default=0.0)

    def shared_tokens(self) -> list[int]:
        return sorted(token for token, names in self.identities.items() if len(names) > 1)

    def unfinished_at_handover(self) -> int:
        """Items started and never finished by a term that a later term followed (a leader
        killed mid-item); the last term's item in flight is not counted."""
        last = self.terms()[-1].token if self.spans else None
        return sum(1 for token, _item in self.open_items if token != last)

    @property
    def safe(self) -> bool:
        return not (self.overlaps() or self.regressions or self.stale_writes or self.shared_tokens())
