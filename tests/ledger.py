"""The ledger checker: judges safety from the outside, from what acting leaders wrote."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import asyncpg


@dataclass
class LedgerReport:
    terms: list[tuple[int, str, datetime, datetime]] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    lost_items: list[str] = field(default_factory=list)


async def check_ledger(dsn: str, group: str) -> LedgerReport:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT identity, token, item, phase, at FROM ledger WHERE group_name = $1 ORDER BY id", group)
    finally:
        await conn.close()
    report = LedgerReport()
    spans: dict[int, list[object]] = {}
    open_items: dict[tuple[int, int], bool] = {}
    last_token = 0
    for row in rows:
        token = row["token"]
        if token < last_token:
            report.regressions.append(f"token {token} written after {last_token}")
        last_token = max(last_token, token)
        span = spans.setdefault(token, [row["identity"], row["at"], row["at"]])
        span[2] = row["at"]
        key = (token, row["item"])
        if row["phase"] == "start":
            open_items[key] = True
        else:
            open_items.pop(key, None)
    report.terms = sorted(((t, str(s[0]), s[1], s[2]) for t, s in spans.items()), key=lambda x: x[2])  # type: ignore[misc]
    for earlier, later in zip(report.terms, report.terms[1:], strict=False):
        if later[2] <= earlier[3]:
            report.overlaps.append(f"token {earlier[0]} wrote until {earlier[3]}, token {later[0]} from {later[2]}")
    report.lost_items = [f"token {t} item {i}" for (t, i) in open_items]
    return report
