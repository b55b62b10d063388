"""The campaign's figures: the ledger's findings attributed to the faults, per fault type, and
the tables and verdict it prints.

Attribution: a gap or an item lost in flight belongs to the fault that ended its term (the fault
whose leader held that token); an overlap, a regression or a stale write to the fault during
which it was written (the last fault started before it); an acting overlap (two workers acting
at once, from the unfenced act log) to the fault during which the later of the two began
acting. Anything before the first fault is ``warm-up``.

The promised bound on a gap without a writing leader, per fault: ``outage + lease + retry +
1.5 s``: the server's own restart time (0 for the other faults), the lease a crashed or paused
leader holds, a retry period to notice, and the worker's own start (a Python process, its
connection and its first write).
"""

from __future__ import annotations

import bisect
import os
import platform
import statistics
from dataclasses import dataclass, field

from benchmarks.campaign_bed import LEASE, RETRY
from benchmarks.campaign_faults import ALL_KINDS, FaultRecord
from singleton_testbed.ledger import LedgerReport

WORKER_SLACK = 1.5
WARM_UP = "warm-up"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def gap_bound(record: FaultRecord | None) -> float:
    return (record.outage if record is not None else 0.0) + LEASE + RETRY + WORKER_SLACK


@dataclass
class KindStats:
    kind: str
    count: int = 0
    overlaps: int = 0
    regressions: int = 0
    stale: int = 0
    acting: int = 0
    """Acting overlaps: two workers acting at once, whether or not the fence refused the writes."""
    failovers: list[float] = field(default_factory=list)
    changed: int = 0
    unrecovered: int = 0
    max_gap: float = 0.0
    long_gaps: int = 0
    lost: int = 0
    outages: list[float] = field(default_factory=list)
    write_stall: float = 0.0
    """The longest wait from a new leader's first ready answer to its worker's first row."""


@dataclass
class BackendResult:
    backend: str
    group: str
    fence: bool
    faults: list[FaultRecord] = field(default_factory=list)
    report: LedgerReport | None = None
    seconds: float = 0.0
    aborted: str | None = None
    stats: dict[str, KindStats] = field(default_factory=dict)

    @property
    def unrecovered(self) -> list[FaultRecord]:
        return [f for f in self.faults if f.failover is None]

    def attribute(self) -> None:
        """Fill ``stats`` from the faults and the ledger report."""
        stats = {kind: KindStats(kind) for kind in (*ALL_KINDS, WARM_UP)}
        for fault in self.faults:
            entry = stats[fault.kind]
            entry.count += 1
            if fault.failover is None:
                entry.unrecovered += 1
            else:
                entry.failovers.append(fault.failover)
            entry.changed += fault.changed
            if fault.outage:
                entry.outages.append(fault.outage)
        if self.report is not None:
            self._attribute_ledger(self.report, stats)
        self.stats = {k: v for k, v in stats.items() if v.count or v.overlaps or v.regressions or v.stale
                      or v.acting or v.lost or v.max_gap}

    def _attribute_ledger(self, report: LedgerReport, stats: dict[str, KindStats]) -> None:
        starts = [f.t0 for f in self.faults]
        ended_by: dict[int, FaultRecord] = {}
        for fault in self.faults:
            ended_by.setdefault(fault.old_token, fault)

        def during(moment: float) -> FaultRecord | None:
            index = bisect.bisect_right(starts, moment) - 1
            return self.faults[index] if index >= 0 else None

        def kind(fault: FaultRecord | None) -> KindStats:
            return stats[fault.kind if fault is not None else WARM_UP]

        first_row = {term[0]: term[2].timestamp() for term in report.terms}
        for fault in self.faults:
            if fault.changed and fault.recovered is not None and fault.new_token in first_row:
                entry = stats[fault.kind]
                entry.write_stall = max(entry.write_stall, first_row[fault.new_token] - fault.recovered)
        for overlap in report.overlap_details:
            kind(during(overlap.later_first.timestamp())).overlaps += 1
        for row in report.regression_details:
            kind(during(row.at.timestamp())).regressions += 1
        for row in report.stale_accepted:
            kind(during(row.at.timestamp())).stale += 1
        for acting in report.acting_overlaps:
            kind(during(acting.start.timestamp())).acting += 1
        for gap in report.gaps:
            ender = ended_by.get(gap.before) or during(gap.end.timestamp())
            entry = kind(ender)
            entry.max_gap = max(entry.max_gap, gap.seconds)
            entry.long_gaps += gap.seconds > gap_bound(ender)
        for item in report.lost_at_handover:
            kind(ended_by.get(item.token) or during(item.started.timestamp())).lost += 1

    def lost_at_graceful_deletion(self) -> int:
        entry = self.stats.get("delete-pod")
        return entry.lost if entry is not None else 0


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def table(result: BackendResult) -> str:
    lines = ["| fault | n | overlaps | regressions | stale accepted | acting overlaps | failover p50 | p99 | max |"
             " of which restart | new term | max gap | gaps > bound | first write after ready, max | lost in flight |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [*result.stats.values()]
    total = KindStats("all", sum(r.count for r in rows), sum(r.overlaps for r in rows),
                      sum(r.regressions for r in rows), sum(r.stale for r in rows), sum(r.acting for r in rows),
                      [x for r in rows for x in r.failovers], sum(r.changed for r in rows),
                      sum(r.unrecovered for r in rows), max((r.max_gap for r in rows), default=0.0),
                      sum(r.long_gaps for r in rows), sum(r.lost for r in rows), [x for r in rows for x in r.outages],
                      max((r.write_stall for r in rows), default=0.0))
    for entry in [*rows, total]:
        times = entry.failovers
        failover = [_duration(statistics.median(times)), _duration(percentile(times, 0.99)),
                    _duration(max(times))] if times else ["-", "-", "-"]
        unrecovered = f" (+{entry.unrecovered} unrecovered)" if entry.unrecovered else ""
        name = f"**{entry.kind}**" if entry.kind == "all" else entry.kind
        restart = _duration(statistics.median(entry.outages)) if entry.outages and entry.kind != "all" else "-"
        lines.append(f"| {name} | {entry.count}{unrecovered} | {entry.overlaps} | {entry.regressions} | "
                     f"{entry.stale} | {entry.acting} | {' | '.join(failover)} | {restart} | "
                     f"{entry.changed}/{entry.count} | "
                     f"{_duration(entry.max_gap) if entry.max_gap else '-'} | {entry.long_gaps} | "
                     f"{_duration(entry.write_stall) if entry.write_stall else '-'} | {entry.lost} |")
    return "\n".join(lines)


@dataclass
class CampaignResult:
    seed: int
    quick: bool
    backends: list[BackendResult] = field(default_factory=list)
    seconds: float = 0.0
    command: str = ""

    @property
    def total_faults(self) -> int:
        return sum(len(b.faults) for b in self.backends)

    def _sum(self, attribute: str) -> int:
        return sum(len(getattr(b.report, attribute)) for b in self.backends if b.report is not None)

    @property
    def total_overlaps(self) -> int:
        return self._sum("overlaps")

    @property
    def total_regressions(self) -> int:
        return self._sum("regressions")

    @property
    def total_stale(self) -> int:
        return self._sum("stale_accepted") + self._sum("shared_tokens")

    @property
    def total_acting_overlaps(self) -> int:
        return sum(len(b.report.acting_overlaps) for b in self.backends if b.report is not None)

    @property
    def unrecovered(self) -> list[FaultRecord]:
        return [f for b in self.backends for f in b.unrecovered]

    def problems(self) -> list[str]:
        found = []
        for b in self.backends:
            if b.aborted:
                found.append(f"{b.backend}: aborted: {b.aborted}")
            if b.report is None:
                found.append(f"{b.backend}: no ledger report")
            elif not b.report.safe:
                found.append(f"{b.backend}: {b.report.summary()}")
            if b.report is not None and not b.report.acts_checked:
                # Its worker logs every act: no act log means acting went unjudged, not that it was safe.
                found.append(f"{b.backend}: {b.report.acting.summary()}")
            if b.unrecovered:
                found.append(f"{b.backend}: {len(b.unrecovered)} faults without a new ready leader")
            if b.lost_at_graceful_deletion():
                found.append(f"{b.backend}: {b.lost_at_graceful_deletion()} items lost at graceful deletion")
        return found

    def goals(self) -> str:
        """Liveness against the promises (reported, not part of the verdict): partition failover
        within lease + retry, gaps within their bound."""
        bound = LEASE + RETRY
        parts = []
        for b in self.backends:
            times = [x for k in ("partition-pg", "partition-api") if k in b.stats for x in b.stats[k].failovers]
            if times:
                worst = max(times)
                parts.append(f"{b.backend} partition failover max {_duration(worst)} "
                             f"{'<=' if worst <= bound else 'ABOVE'} lease + retry ({bound:g} s)")
            long_gaps = sum(s.long_gaps for s in b.stats.values())
            parts.append(f"{b.backend} gaps above their bound: {long_gaps}")
        return "Goals: " + "; ".join(parts)

    @property
    def verdict_ok(self) -> bool:
        return not self.problems()

    def verdict(self) -> str:
        per = ", ".join(f"{b.backend} {len(b.faults)}" for b in self.backends)
        figures = (f"{self.total_faults} faults ({per}) in {self.seconds:.0f} s, seed {self.seed}: "
                   f"{self.total_overlaps} overlaps, {self.total_regressions} regressions, "
                   f"{self.total_stale} stale writes accepted, {self.total_acting_overlaps} acting overlaps, "
                   f"{len(self.unrecovered)} unrecovered")
        if self.verdict_ok:
            return f"VERDICT: PASS: {figures}"
        return f"VERDICT: FAIL: {figures}; " + "; ".join(self.problems())

    def render(self) -> str:
        parts = [f"Fault campaign, seed {self.seed}{' (quick)' if self.quick else ''}, "
                 f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}"]
        if self.command:
            parts.append(f"command: {self.command}")
        for b in self.backends:
            fence = "" if b.fence else ", FENCING OFF (deliberately unsafe)"
            head = f"\n{b.backend} backend: group {b.group}, {len(b.faults)} faults in {b.seconds:.0f} s{fence}"
            if b.report is not None:
                head += f"; ledger: {b.report.summary()}"
            if b.aborted:
                head += f"\n  ABORTED: {b.aborted}"
            parts += [head, "", table(b)]
        parts += ["", self.goals(), self.verdict()]
        return "\n".join(parts)
