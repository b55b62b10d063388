"""The campaign's figures: what the act log and the fenced ledger show, attributed to the faults,
per fault kind and per path (how the old term ended), and the verdict.

Attribution, within one segment (one group): an idle gap (no app acting), a ledger gap or an item
lost in flight belongs to the fault that ended its term (the fault after which that token no longer
led); an overlap, a regression or a stale write to the fault during which it was written (the last
fault started before it); an acting overlap to the fault during which the later actor began
acting. Anything before the segment's first fault is ``warm-up``.

The verdict rule (``classify``): an acting overlap is **in flight through a freeze**, reported apart
and not a failure, only when all of these hold: it began during a whole-pod ``sigstop``, its earlier
actor is the term that fault froze, and every act that actor began after its successor began acting
had been decided in its term (``late_acts == late_decided``: its worker's deadline check passed
before the successor's first act, and the freeze landed between that check and the act). The
frozen app finished, on waking, an act it had begun, or had decided on, in its term, which no gate
and no check can stop: only a fence refuses it. Every other acting overlap is a failure: any in
another fault, any with a late act that was not so decided (an app that woke and acted without
looking, or looked after its term had ended).
What such an overlap cost is counted in acts (``caught_mid_act``): the frozen term's acts that
ended after its successor's first act (begun before the freeze, or decided before it and begun on
waking), how many, how long after the successor's first act the latest ended, and how each ended
(refused by the fence, written, failed). The excuse is only that no gate can help: an act already
begun (or decided on) when the whole pod froze is finished on waking whatever anyone does, and
only a fence refuses it; in an unfenced group it is done. The render says so in a line of its own
(``CampaignResult.caught_line``).
The fenced ledger must show no overlap, regression or stale write in the fenced segments (in the
unfenced ones an act finished late is written too: their ledger is reported, and judged by the act
log alone). Terms must begin acting in token order (a term that begins acting after a newer one is
a regression, in every segment).

The promised bound on a ledger gap without a writing leader, per fault: ``outage + lease + retry +
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
from typing import Any

from benchmarks.campaign_bed import CHILD_ITEMS, DETACHED_CHILD, LEASE, RETRY, PodProfile, Variant
from benchmarks.campaign_faults import ALL_KINDS, ALL_PATHS, FROZEN, NODE_KINDS, FaultRecord
from singleton_testbed.actlog import REFUSED, WRITTEN
from singleton_testbed.ledger import Act, ActingOverlap, LedgerReport, percentile

WORKER_SLACK = 1.5
WARM_UP = "warm-up"


def gap_bound(record: FaultRecord | None) -> float:
    return (record.outage if record is not None else 0.0) + LEASE + RETRY + WORKER_SLACK


def classify(overlap: ActingOverlap, fault: FaultRecord | None) -> bool:
    """True when the overlap is an act in flight through a freeze (not a gate failure): see the
    module docstring."""
    return (fault is not None and fault.kind == FROZEN and overlap.earlier == fault.old_token
            and overlap.late_acts == overlap.late_decided)


@dataclass(frozen=True)
class LoggedAct:
    """One act of the act log, as the campaign keeps it: of the terms that are the earlier one in
    an acting overlap (``Segment.acts``)."""

    token: int
    identity: str
    pid: int
    item: int | None
    began: float
    end: float
    """The logged end, or for an act never ended ``began + max_seconds`` (``Act.end``)."""
    outcome: str | None
    """``written``, ``refused`` (by the fence), ``failed``; None when its end was never logged."""

    @classmethod
    def of(cls, row: Any) -> LoggedAct:
        """From an ``acts`` row (with ``item`` and ``outcome``)."""
        act = Act.of(row)
        item = row["item"]
        return cls(act.token, act.identity, act.pid, None if item is None else int(item), act.began.timestamp(),
                   act.end.timestamp(), row["outcome"])

    @property
    def detached(self) -> bool:
        """Acted by a pod's detached worker (``campaign_bed.DETACH_IDIOMS``)."""
        return self.item is not None and DETACHED_CHILD * CHILD_ITEMS <= self.item < (DETACHED_CHILD + 1) * CHILD_ITEMS


def caught_mid_act(overlap: ActingOverlap, acts: list[LoggedAct]) -> list[LoggedAct]:
    """The earlier actor's acts that ended after the later one's first act: for an overlap in
    flight through a freeze, the acts the freeze caught begun (or decided on) and that were
    finished on waking. Without the acts (not read) the overlap stands for one act, ending where
    it ends."""
    start = overlap.start.timestamp()
    found = [a for a in acts if a.token == overlap.earlier and a.identity == overlap.earlier_identity
             and a.end > start]
    return found or [LoggedAct(overlap.earlier, overlap.earlier_identity, 0, None, start,
                               overlap.end.timestamp(), None)]


@dataclass
class Stats:
    """The figures of one fault kind or one path."""

    name: str
    count: int = 0
    overlaps: int = 0
    """Fenced ledger: two terms writing in interleaved time (fenced segments)."""
    regressions: int = 0
    """Fenced ledger: the token going backwards in commit order; act log: a term that began acting
    after a newer one (every segment)."""
    stale: int = 0
    acting: int = 0
    """Acting overlaps that are gate failures."""
    inflight: int = 0
    """Acting overlaps in flight through a freeze (not counted as failures)."""
    inflight_longest: float = 0.0
    inflight_decided: int = 0
    """Of ``inflight``, those with acts begun after the successor's first but decided before it."""
    caught: int = 0
    """Acts of those overlaps that ended after the successor's first act (``caught_mid_act``)."""
    caught_longest: float = 0.0
    """How long after the successor's first act the latest of them ended."""
    caught_refused: int = 0
    """Of ``caught``, refused by the fence."""
    caught_written: int = 0
    """Of ``caught``, written (unfenced groups; the rest failed or never logged an end)."""
    unfenced_ledger: int = 0
    """Unfenced segments: ledger overlaps and stale writes (judged by the act log, not counted)."""
    idle: list[float] = field(default_factory=list)
    """Seconds without an acting app, per handover (act log)."""
    failovers: list[float] = field(default_factory=list)
    changed: int = 0
    unrecovered: int = 0
    max_gap: float = 0.0
    long_gaps: int = 0
    lost: int = 0
    outages: list[float] = field(default_factory=list)
    write_stall: float = 0.0
    """The longest wait from a new leader's first ready answer to its worker's first row."""

    def add_fault(self, fault: FaultRecord) -> None:
        self.count += 1
        if fault.failover is None:
            self.unrecovered += 1
        else:
            self.failovers.append(fault.failover)
        self.changed += fault.changed
        if fault.outage:
            self.outages.append(fault.outage)

    def merge(self, other: Stats) -> None:
        for name in ("count", "overlaps", "regressions", "stale", "acting", "inflight", "inflight_decided",
                     "caught", "caught_refused", "caught_written", "unfenced_ledger", "changed",
                     "unrecovered", "long_gaps", "lost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("idle", "failovers", "outages"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("inflight_longest", "caught_longest", "max_gap", "write_stall"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))

    @property
    def empty(self) -> bool:
        return not (self.count or self.overlaps or self.regressions or self.stale or self.acting or self.inflight
                    or self.lost or self.max_gap or self.idle)


@dataclass
class Segment:
    """One group of one backend, of one variant, and the faults injected into it."""

    index: int
    group: str
    variant: Variant
    profiles: dict[str, PodProfile] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    report: LedgerReport | None = None
    seconds: float = 0.0
    aborted: str | None = None
    acts: list[LoggedAct] = field(default_factory=list)
    """The acts of every term that is the earlier one of an acting overlap (``caught_mid_act``)."""
    detached_acts: int = 0
    """Acts logged by the pods' detached workers."""
    detached_processes: int = 0
    """How many detached workers (pids) logged them."""
    findings: list[str] = field(default_factory=list)
    """Each acting overlap, judged, with its fault and the acts that made it (filled by the attribution)."""

    def describe(self) -> str:
        pods = "; ".join(f"{pod.rsplit('-', 1)[-1]}: {profile}" for pod, profile in self.profiles.items())
        head = (f"segment {self.index + 1}: group {self.group}, {self.variant}, {len(self.faults)} faults in "
                f"{self.seconds:.0f} s; pods {pods}")
        if self.report is not None:
            ledger = "" if self.variant.fence else " (unfenced: not judged)"
            head += f"\n  ledger{ledger}: {self.report.summary()}"
            if self.report.acts_checked:
                head += (f"\n  act log: {self.report.acting.acts} acts, {self.detached_acts} of them by "
                         f"{self.detached_processes} detached workers")
        head += "".join(f"\n  {finding}" for finding in self.findings)
        if self.aborted:
            head += f"\n  ABORTED: {self.aborted}"
        return head


class _Attribution:
    """One segment's findings, added to the per-kind and per-path figures."""

    def __init__(self, segment: Segment, kinds: dict[str, Stats], paths: dict[str, Stats]) -> None:
        self.segment, self.kinds, self.paths = segment, kinds, paths
        self.lost_at_graceful_deletion = 0
        """Items lost when a quick pod's leader was deleted (``BackendResult.lost_at_graceful_deletion``)."""
        self.faults = sorted(segment.faults, key=lambda f: f.t0)
        self.starts = [f.t0 for f in self.faults]
        self.ended_by: dict[int, FaultRecord] = {f.old_token: f for f in self.faults if f.changed}
        for fault in self.faults:
            self.ended_by.setdefault(fault.old_token, fault)

    def during(self, moment: float) -> FaultRecord | None:
        index = bisect.bisect_right(self.starts, moment) - 1
        return self.faults[index] if index >= 0 else None

    def ender(self, token: int, moment: float) -> FaultRecord | None:
        """The fault that ended ``token``'s term, else the one under way at ``moment``."""
        return self.ended_by.get(token) or self.during(moment)

    def entries(self, fault: FaultRecord | None) -> tuple[Stats, Stats]:
        if fault is None:
            return self.kinds[WARM_UP], self.paths[WARM_UP]
        return self.kinds[fault.kind], self.paths[fault.path]

    def run(self) -> None:
        self.segment.findings = []
        for fault in self.faults:
            self.kinds[fault.kind].add_fault(fault)
            self.paths[fault.path].add_fault(fault)
        report = self.segment.report
        if report is not None:
            self.ledger(report)
            self.acting(report)

    def ledger(self, report: LedgerReport) -> None:
        """The fenced ledger's findings: judged in fenced segments, only reported in the others."""
        fenced = self.segment.variant.fence
        for overlap in report.overlap_details:
            for entry in self.entries(self.during(overlap.later_first.timestamp())):
                if fenced:
                    entry.overlaps += 1
                else:
                    entry.unfenced_ledger += 1
        for row in report.stale_accepted:
            for entry in self.entries(self.during(row.at.timestamp())):
                if fenced:
                    entry.stale += 1
                else:
                    entry.unfenced_ledger += 1
        for row in report.regression_details if fenced else []:
            for entry in self.entries(self.during(row.at.timestamp())):
                entry.regressions += 1
        self.ledger_liveness(report)

    def ledger_liveness(self, report: LedgerReport) -> None:
        first_row = {term[0]: term[2].timestamp() for term in report.terms}
        for fault in self.faults:
            if fault.changed and fault.recovered is not None and fault.new_token in first_row:
                for entry in self.entries(fault):
                    entry.write_stall = max(entry.write_stall, first_row[fault.new_token] - fault.recovered)
        for gap in report.gaps:
            ender = self.ender(gap.before, gap.end.timestamp())
            for entry in self.entries(ender):
                entry.max_gap = max(entry.max_gap, gap.seconds)
                entry.long_gaps += gap.seconds > gap_bound(ender)
        for item in report.lost_at_handover:
            ender = self.ender(item.token, item.started.timestamp())
            for entry in self.entries(ender):
                entry.lost += 1
            if ender is not None and ender.kind == "delete-pod" and not ender.slow:
                self.lost_at_graceful_deletion += 1

    def acting(self, report: LedgerReport) -> None:
        for overlap in report.acting_overlaps:
            fault = self.during(overlap.start.timestamp())
            inflight = classify(overlap, fault)
            caught = caught_mid_act(overlap, self.segment.acts)
            past = max(a.end for a in caught) - overlap.start.timestamp()
            for entry in self.entries(fault):
                if inflight:
                    entry.inflight += 1
                    entry.inflight_decided += overlap.late_decided > 0
                    entry.inflight_longest = max(entry.inflight_longest, overlap.seconds)
                    entry.caught += len(caught)
                    entry.caught_longest = max(entry.caught_longest, past)
                    entry.caught_refused += sum(a.outcome == REFUSED for a in caught)
                    entry.caught_written += sum(a.outcome == WRITTEN for a in caught)
                else:
                    entry.acting += 1
            self.segment.findings.append(self.finding(overlap, fault, inflight, caught))
        newest = 0
        for actor in report.acting.actors:  # in the order they began acting
            if actor.token < newest:
                for entry in self.entries(self.during(actor.first.timestamp())):
                    entry.regressions += 1
            newest = max(newest, actor.token)
        for idle in report.idle_gaps:
            for entry in self.entries(self.ender(idle.before, idle.end.timestamp())):
                entry.idle.append(idle.seconds)

    @staticmethod
    def finding(overlap: ActingOverlap, fault: FaultRecord | None, inflight: bool, caught: list[LoggedAct]) -> str:
        """One acting overlap as the render lists it: the verdict, the fault, and the earlier
        term's acts that ended after the later term's first act (the act log's evidence)."""
        verdict = "in flight through a freeze" if inflight else "ACTING OVERLAP (failure)"
        during = f"{fault.kind} #{fault.index} on {fault.pod}" if fault is not None else WARM_UP
        start = overlap.start.timestamp()
        acts = "; ".join(
            f"pid {a.pid}{' (detached)' if a.detached else ''} item {a.item}: {(a.began - start) * 1000:+.0f} ms to "
            f"{(a.end - start) * 1000:+.0f} ms, {a.outcome or 'never ended'}" for a in caught[:8])
        more = f"; {len(caught) - 8} more" if len(caught) > 8 else ""
        return (f"{verdict} during {during}: {overlap}; token {overlap.earlier}'s acts ending after token "
                f"{overlap.later}'s first (times from it): {acts}{more}")


@dataclass
class BackendResult:
    backend: str
    segments: list[Segment] = field(default_factory=list)
    stats: dict[str, Stats] = field(default_factory=dict)
    """Per fault kind."""
    paths: dict[str, Stats] = field(default_factory=dict)
    """Per path (how the old term ended)."""
    graceful_deletion_losses: int = 0
    """See ``lost_at_graceful_deletion``."""

    @property
    def faults(self) -> list[FaultRecord]:
        return [f for s in self.segments for f in s.faults]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.segments)

    @property
    def unrecovered(self) -> list[FaultRecord]:
        return [f for f in self.faults if f.failover is None]

    def attribute(self) -> None:
        """Fill ``stats`` and ``paths`` from the segments' faults and reports."""
        kinds = {kind: Stats(kind) for kind in (*ALL_KINDS, *NODE_KINDS, WARM_UP)}
        paths = {path: Stats(path) for path in (*ALL_PATHS, WARM_UP)}
        self.graceful_deletion_losses = 0
        for segment in self.segments:
            attribution = _Attribution(segment, kinds, paths)
            attribution.run()
            self.graceful_deletion_losses += attribution.lost_at_graceful_deletion
        self.stats = {k: v for k, v in kinds.items() if not v.empty}
        self.paths = {k: v for k, v in paths.items() if not v.empty}

    def lost_at_graceful_deletion(self) -> int:
        """Items lost when a leader's pod was deleted gracefully with time enough to finish
        (``delete-pod`` of a quick pod). Not ``drain-timeout``: its slow app is killed at a
        drain timeout shorter than its work on purpose, and may lose the item it was on; nor
        ``delete-pod`` dealt to a slow leader, which is the same (a ``--kinds`` run without
        ``drain-timeout`` deals it so)."""
        return self.graceful_deletion_losses


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _spread(values: list[float]) -> list[str]:
    """Median, p99, max (nearest rank), or dashes."""
    if not values:
        return ["-", "-", "-"]
    return [_duration(statistics.median(values)), _duration(percentile(values, 0.99)), _duration(max(values))]


def _total(rows: list[Stats]) -> Stats:
    total = Stats("all")
    for row in rows:
        total.merge(row)
    return total


def _acting_cells(entry: Stats) -> list[str]:
    decided = f"; {entry.inflight_decided} decided before, begun after" if entry.inflight_decided else ""
    acts = f"; {entry.caught} act{'' if entry.caught == 1 else 's'}"
    inflight = f"{entry.inflight} ({_duration(entry.inflight_longest)}{acts}{decided})" if entry.inflight else "0"
    return [str(entry.acting), inflight]


def table(result: BackendResult) -> str:
    """Per fault kind: the act log's verdict and idle gaps, the fenced ledger's, failover."""
    lines = ["| fault | n | acting overlaps | in flight through a freeze (longest) | idle gap p50 | p99 | max |"
             " fenced overlaps | regressions | stale accepted | failover p50 | p99 | max | of which restart |"
             " new term | ledger gap max | gaps > bound | first write after ready, max | lost in flight |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [*result.stats.values()]
    for entry in [*rows, _total(rows)]:
        unrecovered = f" (+{entry.unrecovered} unrecovered)" if entry.unrecovered else ""
        name = f"**{entry.name}**" if entry.name == "all" else entry.name
        restart = _duration(statistics.median(entry.outages)) if entry.outages and entry.name != "all" else "-"
        lines.append(f"| {name} | {entry.count}{unrecovered} | {' | '.join(_acting_cells(entry))} | "
                     f"{' | '.join(_spread(entry.idle))} | {entry.overlaps} | {entry.regressions} | {entry.stale} | "
                     f"{' | '.join(_spread(entry.failovers))} | {restart} | {entry.changed}/{entry.count} | "
                     f"{_duration(entry.max_gap) if entry.max_gap else '-'} | {entry.long_gaps} | "
                     f"{_duration(entry.write_stall) if entry.write_stall else '-'} | {entry.lost} |")
    return "\n".join(lines)


def _merged(results: list[BackendResult], attribute: str, order: tuple[str, ...]) -> dict[str, Stats]:
    merged: dict[str, Stats] = {}
    for result in results:
        for name, entry in getattr(result, attribute).items():
            merged.setdefault(name, Stats(name)).merge(entry)
    return {name: merged[name] for name in (*order, WARM_UP) if name in merged}


def kind_table(results: list[BackendResult]) -> str:
    """Per fault kind, over every backend (``table``'s columns)."""
    everything = BackendResult("all")
    everything.stats = _merged(results, "stats", (*ALL_KINDS, *NODE_KINDS))
    return table(everything)


def path_table(results: list[BackendResult]) -> str:
    """Per path, over every backend: how long no app acted, and the failover."""
    merged = _merged(results, "paths", ALL_PATHS)
    order = list(merged)
    lines = ["| path (how the old term ended) | n | acting overlaps | in flight through a freeze (longest) |"
             " idle gap p50 | p99 | max | failover p50 | p99 | max | lost in flight |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        entry = merged[name]
        lines.append(f"| {name} | {entry.count} | {' | '.join(_acting_cells(entry))} | "
                     f"{' | '.join(_spread(entry.idle))} | {' | '.join(_spread(entry.failovers))} | {entry.lost} |")
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
        return sum(getattr(s, attribute) for b in self.backends for s in b.stats.values())

    @property
    def total_acting_failures(self) -> int:
        """Acting overlaps counted as gate failures."""
        return self._sum("acting")

    @property
    def total_inflight(self) -> int:
        """Acting overlaps in flight through a freeze (reported, not failures)."""
        return self._sum("inflight")

    @property
    def total_inflight_decided(self) -> int:
        """Of those, the ones whose late acts were decided before the freeze (see ``classify``)."""
        return self._sum("inflight_decided")

    @property
    def total_caught(self) -> int:
        """Acts a whole-pod freeze caught mid-act that ended after the successor began acting."""
        return self._sum("caught")

    @property
    def caught_longest(self) -> float:
        """How long after the successor's first act the latest of those ended."""
        return max((s.caught_longest for b in self.backends for s in b.stats.values()), default=0.0)

    @property
    def freezes(self) -> int:
        """Whole-pod freezes injected."""
        return sum(1 for b in self.backends for f in b.faults if f.kind == FROZEN)

    def caught_line(self) -> str:
        """The acts a whole-pod freeze caught mid-act, and the rule that excuses them."""
        caught, refused, written = self.total_caught, self._sum("caught_refused"), self._sum("caught_written")
        head = (f"Acts a whole-pod freeze caught mid-act that finished after the successor began acting: {caught} "
                f"(in {self.total_inflight} of {self.freezes} freezes)")
        if caught:
            other = caught - refused - written
            head += (f", the latest ending {_duration(self.caught_longest)} after the successor's first act; "
                     f"{refused} refused by the fence, {written} written"
                     + (f", {other} failed or never ended" if other else ""))
        return (f"{head}. Not counted as acting overlaps, and excused only so: a frozen app finishes on "
                f"waking an act it had begun (or decided on) in its term, which no gate and no deadline check "
                f"can stop; only a fence refuses those. Any act begun after the successor's first without "
                f"such a decision, and any overlap in another fault, is a failure.")

    @property
    def total_overlaps(self) -> int:
        """Fenced ledger overlaps (fenced segments)."""
        return self._sum("overlaps")

    @property
    def total_regressions(self) -> int:
        return self._sum("regressions")

    @property
    def total_stale(self) -> int:
        shared = sum(len(s.report.shared_tokens) for b in self.backends for s in b.segments
                     if s.report is not None and s.variant.fence)
        return self._sum("stale") + shared

    @property
    def unrecovered(self) -> list[FaultRecord]:
        return [f for b in self.backends for f in b.unrecovered]

    def problems(self) -> list[str]:
        found = []
        for b in self.backends:
            for s in b.segments:
                where = f"{b.backend} segment {s.index + 1} ({s.variant})"
                if s.aborted:
                    found.append(f"{where}: aborted: {s.aborted}")
                if s.report is None:
                    found.append(f"{where}: no ledger report")
                    continue
                if s.variant.fence and not s.report.ledger_safe:
                    found.append(f"{where}: {s.report.summary()}")
                if not s.report.acts_checked:
                    # Its worker logs every act: no act log means acting went unjudged, not that it was safe.
                    found.append(f"{where}: {s.report.acting.summary()}")
            acting = sum(s.acting for s in b.stats.values())
            if acting:
                found.append(f"{b.backend}: {acting} acting overlaps that are not acts in flight through a freeze")
            regressions = sum(s.regressions for s in b.stats.values())
            if regressions:
                found.append(f"{b.backend}: {regressions} regressions")
            for failed, what in ((True, "faults not injected"), (False, "faults without a new ready leader")):
                if records := [f for f in b.unrecovered if f.not_injected is failed]:
                    found.append(f"{b.backend}: {len(records)} {what} ("
                                 + "; ".join(f"{f.kind} #{f.index}: {f.error}" for f in records) + ")")
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
        longest = f", the latest {_duration(self.caught_longest)} after it" if self.total_caught else ""
        figures = (f"{self.total_faults} faults ({per}) in {self.seconds:.0f} s, seed {self.seed}: "
                   f"{self.total_acting_failures} acting overlaps ({self.total_inflight} in flight through a "
                   f"freeze, {self.total_inflight_decided} of them with acts decided before it and begun after: "
                   f"{self.total_caught} acts caught mid-act finished after the successor began{longest}; "
                   f"not counted, only a fence refuses those), "
                   f"{self.total_overlaps} fenced overlaps, {self.total_regressions} "
                   f"regressions, {self.total_stale} stale writes accepted, {len(self.unrecovered)} unrecovered")
        if self.verdict_ok:
            return f"VERDICT: PASS: {figures}"
        return f"VERDICT: FAIL: {figures}; " + "; ".join(self.problems())

    def render(self) -> str:
        parts = [f"Fault campaign, seed {self.seed}{' (quick)' if self.quick else ''}, "
                 f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}"]
        if self.command:
            parts.append(f"command: {self.command}")
        for b in self.backends:
            parts.append(f"\n{b.backend} backend: {len(b.faults)} faults in {b.seconds:.0f} s")
            parts += [s.describe() for s in b.segments]
            parts += ["", table(b)]
        if len(self.backends) > 1:
            parts += ["\nAll backends, per fault kind:", "", kind_table(self.backends)]
        parts += ["\nAll backends, per path (how the old term ended):", "", path_table(self.backends)]
        parts += ["", self.goals(), self.caught_line(), self.verdict()]
        return "\n".join(parts)
