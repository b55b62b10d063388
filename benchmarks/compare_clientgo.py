"""Side by side with client-go leader election, on one control plane.

    .venv/bin/python -m benchmarks.compare_clientgo --runs 10

Starts PostgreSQL (or uses SINGLETON_TEST_DSN; only the SIGSTOP ledger needs it) and the
test bed's etcd + kube-apiserver, builds our client-go elector (benchmarks/clientgo) and
measures groups of 3 of each peer:
- ours: singleton-sidecar, lease backend, its default timings (9 s / 7.5 s / 6 s);
- client-go at its usual defaults (15 s / 10 s / 2 s);
- client-go with our timings (9 s / 7.5 s / 6 s).
Per peer: graceful handover (SIGTERM to the leader -> another member's /readyz 200),
SIGKILL failover (same, after SIGKILL), API requests/s of the group at rest (distinct
auditIDs in the audit log by user agent), RSS and CPU at rest; with root, partition failover
(``benchmarks/compare_partition.py``: groups of 3 pods on the test bed's real node, started for
them on this control plane, which then advertises the node IP; the leader's pod cut off from
the API server by iptables in its network namespace). Then the SIGSTOP safety
scenario with short timings (2 s / 1.5 s / 0.5 s) for both, like with like: each member has
a worker that appends to a PostgreSQL ledger while its elector says it leads and logs every
act before doing it (the act protocol of singleton_testbed.actlog; ours: the exec gate with
tests/data/ledger_worker.py; client-go: benchmarks/clientgo/unfenced_worker.py polling
/leader), both peers once with unfenced workers and once with fenced ones (client-go's
fenced with its term's start). The leader's process group is stopped past the lease, a new
leader takes over, the old one is continued, and singleton_testbed.ledger judges the act log
(two workers acting at once, acts begun by the deposed one) and the ledger (overlaps, stale
writes accepted; the act log counts the writes the fence refused).
Prints tables and ratios (client-go / ours) and writes PNG plots to benchmarks/plots/ (``--no-plots``:
none; ``--json`` is written first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg

from benchmarks.campaign_bed import CampaignError
from benchmarks.clientgo.elector import CLIENTGO_DEFAULTS, USER_AGENT, ClientGoProcess, build
from benchmarks.clientgo.unfenced_worker import term_of
from benchmarks.compare_partition import PartitionRun, PodPeer, partition_runs
from benchmarks.failover import Bench, Starter, bench_servers, cpu_seconds, rss_mb, running, summary
from singleton_election.core.timings import BACKEND_DEFAULTS
from singleton_testbed.binaries import find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.harness.sidecars import SidecarProcess, one_leader, wait_for
from singleton_testbed.ledger import LedgerReport, check_ledger, percentile
from singleton_testbed.node import busy_reason, unavailable_reason
from singleton_testbed.node_config import NodeLayout

Timings = tuple[float, float, float]  # lease duration, renew deadline, retry period (s)
OURS_DEFAULTS: Timings = (BACKEND_DEFAULTS["lease"].lease_duration, BACKEND_DEFAULTS["lease"].renew_deadline,
                          BACKEND_DEFAULTS["lease"].retry_period)
FAST: Timings = (2.0, 1.5, 0.5)
SIDECAR_AGENT = "singleton-sidecar"
LEDGER_WORKER = Path(__file__).resolve().parent.parent / "tests" / "data" / "ledger_worker.py"
PLOTS = Path(__file__).resolve().parent / "plots"


def fmt_timings(timings: Timings) -> str:
    return "/".join(f"{t:g}" for t in timings) + " s"


def ms(seconds: float) -> str:
    value = seconds * 1000
    # By magnitude: a margin of -4.4 s (an overlap) reads as seconds, like +4.4 s.
    return f"{value:.1f} ms" if abs(value) < 1000 else f"{value / 1000:.2f} s"


@dataclass
class ClientGoBench(Bench):
    """A ``Bench`` whose groups are client-go electors (optionally with unfenced ledger workers)."""

    binary: Path = Path()
    timings: Timings = CLIENTGO_DEFAULTS
    ledger_dsn: str | None = None
    fenced: bool = False

    def group(self, count: int) -> AbstractContextManager[list[SidecarProcess]]:
        return running(self._new_group, count)

    def _new_group(self) -> Starter:
        assert self.control_plane is not None
        kubeconfig = self.control_plane.info.kubeconfig
        lease = "cg-" + uuid.uuid4().hex[:8]

        def start(index: int) -> SidecarProcess:
            identity = f"g{index}-{uuid.uuid4().hex[:6]}"
            return ClientGoProcess(
                f"g{index}", {"SINGLETON_GROUP": lease, "SINGLETON_IDENTITY": identity},
                self.workdir / f"{lease}-{index}.log", binary=self.binary, kubeconfig=kubeconfig,
                namespace=self.namespace, lease=lease, identity=identity, timings=self.timings,
                ledger_dsn=self.ledger_dsn, fence=self.fenced).start()

        return start


@dataclass
class GatedBench(Bench):
    """A ``Bench`` of our sidecars (lease backend, no pod objects) whose exec gate runs the
    ledger worker (fenced, or with ``LEDGER_FENCE=off``), with the given timings."""

    timings: Timings = FAST
    fenced: bool = True

    def group(self, count: int) -> AbstractContextManager[list[SidecarProcess]]:
        return running(self._new_group, count)

    def _new_group(self) -> Starter:
        assert self.control_plane is not None
        kubeconfig = self.control_plane.info.kubeconfig
        group = "stop-" + uuid.uuid4().hex[:8]
        lease_duration, renew_deadline, retry_period = self.timings

        def start(index: int) -> SidecarProcess:
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": self.backend,
                   "SINGLETON_IDENTITY": f"s{index}-{uuid.uuid4().hex[:6]}", "LEDGER_DSN": self.dsn,
                   "KUBECONFIG": str(kubeconfig), "SINGLETON_NAMESPACE": self.namespace,
                   "SINGLETON_LEASE_DURATION": f"{lease_duration:g}",
                   "SINGLETON_RENEW_DEADLINE": f"{renew_deadline:g}",
                   "SINGLETON_RETRY_PERIOD": f"{retry_period:g}", "LEDGER_FENCE": "on" if self.fenced else "off"}
            return SidecarProcess(f"s{index}", env, self.workdir / f"{group}-{index}.log",
                                  command=[sys.executable, str(LEDGER_WORKER)]).start()

        return start


@dataclass
class Rest:
    rss: list[float]
    cpu: list[float]
    requests: float
    kinds: dict[str, int]


@dataclass
class StopRun:
    takeover: float
    """SIGSTOP to another member's /readyz 200 (s)."""
    acting_overlaps: int
    """Pairs of workers acting in intersecting time (``ActingReport.overlaps``, the act log)."""
    late_acts: int
    """Acts the stopped leader's worker began once the new leader's worker had begun acting."""
    overlap_seconds: float
    """The longest acting overlap (s)."""
    acted_after_wake: float
    """From SIGCONT to the end of the stopped leader's worker's last act (s; 0: none after SIGCONT)."""
    ledger_overlaps: int
    """Terms that wrote in interleaved time (``LedgerReport.overlaps``, the ledger)."""
    stale_accepted: int
    """Rows committed with a token older than one already committed (``LedgerReport.stale_accepted``)."""
    refused: int
    """Acts of the group whose write the fence refused (outcome ``refused`` in the act log)."""
    acts_checked: bool
    fenced_out: bool
    """The stopped leader's worker said "fenced out" in its log."""
    group: str
    dump: str = ""
    """Where the run's act log and ledger rows were saved when it found anything (else "")."""


@dataclass
class PeerResult:
    key: str
    label: str
    agent: str
    timings: Timings
    graceful: list[float] = field(default_factory=list)
    kill: list[float] = field(default_factory=list)
    partition: list[float] = field(default_factory=list)
    """Partition failovers (s)."""
    partition_margin: list[float] = field(default_factory=list)
    """Per partition: the new leader's first ready answer minus the cut-off one's last (s); < 0: overlap."""
    rest: Rest | None = None
    stops: list[StopRun] = field(default_factory=list)


def audit_size(plane: ControlPlane) -> int:
    path = plane.workdir / "audit.log"
    return path.stat().st_size if path.exists() else 0


def count_requests(plane: ControlPlane, start: int, end: int, agent: str) -> tuple[int, dict[str, int]]:
    """Distinct requests (auditIDs) by user agents starting with ``agent`` in the audit log
    between two offsets, and their count by verb and resource."""
    with (plane.workdir / "audit.log").open("rb") as audit:
        audit.seek(start)
        entries = [entry for entry in map(json.loads, audit.read(end - start).splitlines())
                   if entry.get("userAgent", "").startswith(agent)]
    kinds: dict[str, set[str]] = {}
    for entry in entries:
        ref = entry.get("objectRef", {})
        kind = f"{entry['verb']} {ref.get('resource')}" + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        kinds.setdefault(kind, set()).add(entry["auditID"])
    return len({entry["auditID"] for entry in entries}), {k: len(v) for k, v in sorted(kinds.items())}


def at_rest(bench: Bench, plane: ControlPlane, agent: str, seconds: float) -> Rest:
    with bench.group(3) as members:
        one_leader(members, timeout=30)
        time.sleep(3)  # past the election's own requests
        pids = [m.popen.pid for m in members if m.popen is not None]
        before = [cpu_seconds(p) for p in pids]
        start = audit_size(plane)
        time.sleep(seconds)
        end = audit_size(plane)  # before the group stops: its farewell writes are not "at rest"
        cpu = [(cpu_seconds(p) - b) / seconds for p, b in zip(pids, before, strict=True)]
        rss = [rss_mb(p) for p in pids]
    count, kinds = count_requests(plane, start, end, agent)
    return Rest(rss, cpu, count / seconds, kinds)


def takeover(bench: Bench, signum: int, cycle: float, rng: random.Random) -> float:
    """``Bench.takeover`` at a random phase: the signal comes 0.3 s plus a uniformly random
    part of ``cycle`` (the peer's retry cycle) after the group elected its leader, as a
    real SIGTERM or crash would, instead of always just after the election."""
    with bench.group(3) as members:
        leader = one_leader(members, timeout=30)
        others = [m for m in members if m is not leader]
        time.sleep(0.3 + rng.uniform(0, cycle))
        started = time.monotonic()
        leader.signal(signum)
        wait_for(lambda: any(m.ready() for m in others), 60, "a new ready leader", interval=0.001)
        return time.monotonic() - started


def cycle_of(key: str, timings: Timings) -> float:
    """How long one retry cycle lasts: client-go waits retry period x (1 + jitter 1.2) at most
    between attempts; our leader renews every retry period and our standbys watch."""
    return timings[2] * (2.2 if key.startswith("clientgo") else 1.0)


async def group_rows(dsn: str, group: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The group's act log and ledger rows, in id order, for a record of a run."""
    conn = await asyncpg.connect(dsn)
    try:
        acts = await conn.fetch("SELECT * FROM acts WHERE group_name = $1 ORDER BY id", group)
        ledger = await conn.fetch("SELECT * FROM ledger WHERE group_name = $1 ORDER BY id", group)
    finally:
        await conn.close()
    return [dict(r) for r in acts], [dict(r) for r in ledger]


async def acted(dsn: str, group: str, identity: str, token: int) -> bool:
    """Whether ``identity`` has logged an act in term ``token``."""
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetchval("SELECT 1 FROM acts WHERE group_name = $1 AND identity = $2 AND token = $3 "
                                    "LIMIT 1", group, identity, token)
    except asyncpg.UndefinedTableError:
        found = None  # no worker has started yet
    finally:
        await conn.close()
    return found is not None


def term_id(member: SidecarProcess) -> tuple[str, int]:
    """(identity, token) of a leading member's term, as its worker logs its acts: our sidecar's
    token, or client-go's term start (epoch ms)."""
    doc = member.leader_doc()
    assert doc is not None
    token = doc["token"] if doc.get("token") is not None else term_of(doc)
    assert token is not None, doc
    return member.env["SINGLETON_IDENTITY"], int(token)


def judge_stop(report: LedgerReport, acts: list[dict[str, object]], *, old: tuple[str, int], new: tuple[str, int],
               woke: float, takeover: float, fenced_out: bool, group: str) -> StopRun:
    """One run's figures from its verdict and act rows: ``old`` is the stopped leader's term
    (identity, token), continued at ``woke`` (epoch s), ``new`` the term that took over."""
    acting = report.acting
    actors = {(a.identity, a.token): a for a in acting.actors}
    stopped, successor = actors.get(old), actors.get(new)
    after = stopped.last.timestamp() - woke if stopped is not None else 0.0
    late = 0
    if successor is not None:
        late = sum(1 for act in acts if (act["identity"], act["token"]) == old
                   and isinstance(act["began_at"], datetime) and act["began_at"] >= successor.first)
    return StopRun(takeover=takeover, acting_overlaps=len(acting.overlaps), late_acts=late,
                   overlap_seconds=max((o.seconds for o in acting.overlaps), default=0.0),
                   acted_after_wake=max(after, 0.0), ledger_overlaps=len(report.overlaps),
                   stale_accepted=len(report.stale_accepted),
                   refused=sum(1 for act in acts if act["outcome"] == "refused"), acts_checked=acting.checked,
                   fenced_out=fenced_out, group=group)


def sigstop_run(bench: Bench, dsn: str, timings: Timings) -> StopRun:
    """Stop the leader's process group (elector + worker) past the lease once its worker acts,
    let a new leader take over and act, continue the old one, and judge the act log and the ledger."""
    lease_duration, renew_deadline, _ = timings
    with bench.group(3) as members:
        group = members[0].env["SINGLETON_GROUP"]
        leader = one_leader(members, timeout=30)
        old = term_id(leader)
        wait_for(lambda: asyncio.run(acted(dsn, group, *old)), 20, "the leader's worker to act", interval=0.05)
        time.sleep(0.3)  # the leader's worker acts
        leader.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        successor = one_leader([m for m in members if m is not leader], timeout=3 * lease_duration + 10)
        takeover = time.monotonic() - stopped
        new = term_id(successor)
        wait_for(lambda: asyncio.run(acted(dsn, group, *new)), 20, "the new leader's worker to act", interval=0.05)
        time.sleep(0.3)  # the new leader's worker acts
        woke = time.time()
        leader.signal(signal.SIGCONT)
        time.sleep(renew_deadline + 1.5)  # the old one wakes up: give it its renew deadline and more
    report = asyncio.run(check_ledger(dsn, group))
    acts, ledger = asyncio.run(group_rows(dsn, group))
    run = judge_stop(report, acts, old=old, new=new, woke=woke, takeover=takeover,
                     fenced_out="fenced out" in leader.log(), group=group)
    if run.acting_overlaps or run.ledger_overlaps or run.stale_accepted or not run.acts_checked:
        path = bench.workdir / f"{group}-rows.json"
        path.write_text(json.dumps({"stopped": {"identity": old[0], "token": old[1], "sigcont_epoch": woke,
                                                "log": str(leader.log_path)},
                                    "new": {"identity": new[0], "token": new[1], "log": str(successor.log_path)},
                                    "verdict": report.summary(), "acts": acts, "ledger": ledger},
                                   indent=1, default=str))
        run.dump = str(path)
    return run


def print_peer(result: PeerResult) -> None:
    print(f"\n{result.label}: 3 members, timings {fmt_timings(result.timings)}, {os.cpu_count()} CPUs")
    if result.graceful:
        print(summary("graceful handover (SIGTERM)", result.graceful))
    if result.kill:
        print(summary("SIGKILL failover", result.kill))
    if result.partition:
        print(summary("partition failover (API server)", result.partition))
        print(f"{'old stopped -> new began (margin)':<34} min {ms(min(result.partition_margin))}, "
              f"overlaps {sum(1 for m in result.partition_margin if m < 0)}")
    if result.rest is not None:
        rest = result.rest
        print(f"{'RSS at rest (3 members)':<34} " + ", ".join(f"{v:.1f} MB" for v in rest.rss))
        print(f"{'CPU at rest (3 members)':<34} " + ", ".join(f"{v * 100:.2f} %" for v in rest.cpu))
        print(f"{'API requests/s at rest (group)':<34} {rest.requests:.3f}  ("
              + ", ".join(f"{k}: {v}" for k, v in rest.kinds.items()) + ")")
    sys.stdout.flush()


def med_p99(values: list[float]) -> str:
    return f"{ms(statistics.median(values))} / {ms(percentile(values, 0.99))}" if values else "-"


def ratio(num: float, den: float) -> str:
    return f"{num / den:,.0f}x" if den > 0 and num / den >= 10 else (f"{num / den:.1f}x" if den > 0 else "-")


def print_tables(results: Sequence[PeerResult], stops: Sequence[PeerResult], rest_seconds: float) -> None:
    if results:
        print_failover_tables(results, rest_seconds)
    if stops:
        print_stop_table(stops)
    sys.stdout.flush()


def print_failover_tables(results: Sequence[PeerResult], rest_seconds: float) -> None:
    print("\n| figure (3 members) | " + " | ".join(f"{r.label}, {fmt_timings(r.timings)}" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| graceful handover, median / p99 | " + " | ".join(
        f"{med_p99(r.graceful)} (n={len(r.graceful)})" for r in results) + " |")
    print("| SIGKILL failover, median / p99 | " + " | ".join(
        f"{med_p99(r.kill)} (n={len(r.kill)})" for r in results) + " |")
    if any(r.partition for r in results):
        print("| partition failover, median / p99 | " + " | ".join(
            f"{med_p99(r.partition)} (n={len(r.partition)})" if r.partition else "-" for r in results) + " |")
        print("| partition: old leader's last ready → new leader's first, min (overlaps) | " + " | ".join(
            f"{ms(min(r.partition_margin))} ({sum(1 for m in r.partition_margin if m < 0)})"
            if r.partition_margin else "-" for r in results) + " |")
    rests = [r.rest for r in results]
    print(f"| API requests/s at rest, group ({rest_seconds:g} s) | " + " | ".join(
        f"{x.requests:.3f}" if x else "-" for x in rests) + " |")
    print("| RSS at rest, per member | " + " | ".join(
        f"{statistics.median(x.rss):.1f} MB" if x else "-" for x in rests) + " |")
    print("| CPU at rest, per member (median, max) | " + " | ".join(
        f"{statistics.median(x.cpu) * 100:.2f} %, {max(x.cpu) * 100:.2f} %" if x else "-" for x in rests) + " |")
    ours, others = results[0], results[1:]
    if ours.key == "ours" and others:
        print("\n| client-go / ours | " + " | ".join(f"{r.label}, {fmt_timings(r.timings)}" for r in others) + " |")
        print("|---|" + "---|" * len(others))
        for name, pick in (("graceful handover, median", lambda r: statistics.median(r.graceful)),
                           ("graceful handover, p99", lambda r: percentile(r.graceful, 0.99)),
                           ("SIGKILL failover, median", lambda r: statistics.median(r.kill)),
                           ("SIGKILL failover, p99", lambda r: percentile(r.kill, 0.99))):
            if ours.graceful and ours.kill:
                print(f"| {name} | " + " | ".join(
                    ratio(pick(r), pick(ours)) if r.graceful and r.kill else "-" for r in others) + " |")
        for name, pick in (("partition failover, median", lambda r: statistics.median(r.partition)),
                           ("partition failover, p99", lambda r: percentile(r.partition, 0.99))):
            if ours.partition:
                print(f"| {name} | " + " | ".join(
                    ratio(pick(r), pick(ours)) if r.partition else "-" for r in others) + " |")
        if ours.rest is not None:
            print("| API requests/s at rest | " + " | ".join(
                ratio(r.rest.requests, ours.rest.requests) if r.rest else "-" for r in others) + " |")


def print_stop_table(stops: Sequence[PeerResult]) -> None:
    print(f"\nSIGSTOP of the leader's process group past the lease, timings {fmt_timings(FAST)}:")
    print("\n| peer, worker | runs | runs with two workers acting at once (act log) | acts begun by the "
          "stopped leader once the new one acted, total (most in a run) | longest acting overlap | "
          "stopped leader still acting after SIGCONT, longest | runs with ledger overlaps | "
          "stale writes accepted | writes refused by the fence | SIGSTOP to new leader ready, median |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in stops:
        runs = r.stops
        unchecked = sum(1 for s in runs if not s.acts_checked)
        print(f"| {r.label} | {len(runs)} | {sum(1 for s in runs if s.acting_overlaps)}"
              + (f" ({unchecked} not judged: no acts)" if unchecked else "") + " | "
              f"{sum(s.late_acts for s in runs)} ({max(s.late_acts for s in runs)}) | "
              f"{ms(max(s.overlap_seconds for s in runs))} | {ms(max(s.acted_after_wake for s in runs))} | "
              f"{sum(1 for s in runs if s.ledger_overlaps)} | {sum(s.stale_accepted for s in runs)} | "
              f"{sum(s.refused for s in runs)} | {ms(statistics.median(s.takeover for s in runs))} |")
    for r in stops:
        for run in r.stops:
            if run.dump:
                print(f"  {r.key}: group {run.group}: act log and ledger rows in {run.dump}")


def plot(results: Sequence[PeerResult], folder: Path, prefix: str = "clientgo") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for attr, title, name in (("graceful", "Graceful handover: SIGTERM to the leader → new leader ready",
                               f"{prefix}-graceful.png"),
                              ("kill", "SIGKILL failover: leader killed → new leader ready", f"{prefix}-sigkill.png"),
                              ("partition", "Partition failover: leader's pod cut off from the API server → "
                               "new leader ready", f"{prefix}-partition.png")):
        series = [(f"{r.label}\n{fmt_timings(r.timings)}", getattr(r, attr)) for r in results if getattr(r, attr)]
        if not series:
            continue
        everything = [v for _, values in series for v in values]
        log = max(everything) / max(min(everything), 1e-6) > 20
        scale = 1000.0 if log else 1.0
        fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
        ax.boxplot([[v * scale for v in values] for _, values in series], whis=(0, 100), widths=0.4)
        for index, (_, values) in enumerate(series, start=1):
            offsets = [index + 0.15 * ((i * 0.618) % 1 - 0.5) for i in range(len(values))]
            ax.scatter(offsets, [v * scale for v in values], s=14, alpha=0.6, zorder=3)
            median = statistics.median(values)
            ax.annotate(f"median {ms(median)}\np99 {ms(percentile(values, 0.99))}", (index + 0.24, median * scale),
                        fontsize=8, va="center")
        ax.set_xticks(range(1, len(series) + 1), [label for label, _ in series], fontsize=8)
        ax.set_xlim(0.5, len(series) + 0.9)
        if log:
            ax.set_yscale("log")
            decades = [10.0**e for e in range(-1, 6)]
            ax.set_yticks(decades, [f"{d:g} ms" if d < 1000 else f"{d / 1000:g} s" for d in decades])
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_ylim(min(everything) * scale / 2, max(everything) * scale * 2)
        else:
            ax.set_ylim(0, max(everything) * 1.1)
        ax.set_ylabel("time (log scale)" if log else "seconds")
        ax.set_title(f"{title}\n3 members, one kube-apiserver, {os.cpu_count()} CPUs", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
        fig.tight_layout()
        path = folder / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


STOP_PEERS = ("ours-unfenced", "clientgo-unfenced", "ours-fenced", "clientgo-fenced")


def stop_peer(key: str, binary: Path, dsn: str, workdir: Path, plane: ControlPlane) -> tuple[PeerResult, Bench]:
    """A peer of the SIGSTOP scenario: ours or client-go, with an unfenced or a fenced worker
    that logs its acts (the same act protocol for both)."""
    fenced = key.endswith("-fenced")
    if key.startswith("ours"):
        label = f"ours (sidecar, lease, exec gate), {'fenced' if fenced else 'unfenced'} worker"
        return (PeerResult(key, label, SIDECAR_AGENT, FAST),
                GatedBench("lease", dsn, workdir, plane, timings=FAST, fenced=fenced))
    label = f"client-go, {'fenced (token: term start)' if fenced else 'unfenced'} worker"
    return (PeerResult(key, label, USER_AGENT, FAST),
            ClientGoBench("lease", dsn, workdir, plane, binary=binary, timings=FAST, ledger_dsn=dsn, fenced=fenced))


def measure(args: argparse.Namespace, binary: Path, dsn: str, workdir: Path, plane: ControlPlane) -> None:
    started = time.monotonic()
    rng = random.Random(args.seed)

    def progress(text: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {text}", flush=True)

    peers = {
        "ours": (PeerResult("ours", "ours (sidecar, lease)", SIDECAR_AGENT, OURS_DEFAULTS),
                 Bench("lease", dsn, workdir, plane)),
        "clientgo-defaults": (PeerResult("clientgo-defaults", "client-go", USER_AGENT, CLIENTGO_DEFAULTS),
                              ClientGoBench("lease", dsn, workdir, plane, binary=binary, timings=CLIENTGO_DEFAULTS)),
        "clientgo-ours": (PeerResult("clientgo-ours", "client-go", USER_AGENT, OURS_DEFAULTS),
                          ClientGoBench("lease", dsn, workdir, plane, binary=binary, timings=OURS_DEFAULTS)),
    }
    results = []
    for key in args.peers:
        result, bench = peers[key]
        progress(f"{key}: graceful handover x{args.runs}")
        cycle = cycle_of(key, result.timings)
        result.graceful = [takeover(bench, signal.SIGTERM, cycle, rng) for _ in range(args.runs)]
        kills = args.slow_runs if key == "clientgo-defaults" else args.runs
        progress(f"{key}: SIGKILL failover x{kills}")
        result.kill = [takeover(bench, signal.SIGKILL, cycle, rng) for _ in range(kills)]
        if args.rest_seconds > 0:
            progress(f"{key}: at rest {args.rest_seconds:g} s")
            result.rest = at_rest(bench, plane, result.agent, args.rest_seconds)
        results.append(result)
    if args.partition_runs > 0:
        pod_peers = [PodPeer(r.key, r.label, r.timings, cycle_of(r.key, r.timings),
                             binary if r.key.startswith("clientgo") else None) for r in results]
        try:
            runs = partition_runs(plane, workdir, pod_peers, runs=args.partition_runs, rng=rng,
                                  progress=progress)
        except CampaignError as exc:
            progress(f"partition runs skipped: {exc}")
            runs = {}
        for result in results:
            found: list[PartitionRun] = runs.get(result.key, [])
            result.partition = [run.failover for run in found]
            result.partition_margin = [run.margin for run in found]
    for result in results:
        print_peer(result)
    stops = []
    for key in args.sigstop_peers if args.sigstop_runs > 0 else []:
        result, bench = stop_peer(key, binary, dsn, workdir, plane)
        progress(f"{key}: SIGSTOP x{args.sigstop_runs}")
        result.stops = [sigstop_run(bench, dsn, FAST) for _ in range(args.sigstop_runs)]
        for run in result.stops:
            print(f"  {key}: {run}")
        stops.append(result)
    progress(f"done; machine: {os.cpu_count()} CPUs, Linux {os.uname().release}; logs in {workdir}")
    print_tables(results, stops, args.rest_seconds)
    if args.json is not None:  # before the plots: a plot that fails (no matplotlib) loses no figure
        args.json.write_text(json.dumps([asdict(r) for r in [*results, *stops]], indent=1))
    if not args.no_plots:
        for path in plot(results, args.plots):
            print(f"plot: {path} ({path.stat().st_size // 1024} KB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs per failover scenario (default 10)")
    parser.add_argument("--slow-runs", type=int, default=5,
                        help="SIGKILL runs for client-go at its defaults, ~20 s each (default 5)")
    parser.add_argument("--rest-seconds", type=float, default=300.0,
                        help="how long to watch idle groups (default 300: at least the sidecars' watch timeouts, "
                             "so the re-opened watches are counted)")
    parser.add_argument("--partition-runs", type=int, default=5,
                        help="partitions per peer, on the test bed's real node: needs root, containerd and "
                             "the node lock (default 5; 0 skips them)")
    parser.add_argument("--sigstop-runs", type=int, default=10, help="SIGSTOP runs per peer (default 10)")
    parser.add_argument("--sigstop-peers", nargs="*", choices=STOP_PEERS, default=list(STOP_PEERS),
                        help="peers of the SIGSTOP scenario (default: all four)")
    parser.add_argument("--peers", nargs="*", choices=["ours", "clientgo-defaults", "clientgo-ours"],
                        default=["ours", "clientgo-defaults", "clientgo-ours"],
                        help="peers of the failover figures (none: only the SIGSTOP scenario)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random signal phases (default 1)")
    parser.add_argument("--plots", type=Path, default=PLOTS, help=f"folder for the PNGs (default {PLOTS})")
    parser.add_argument("--no-plots", action="store_true", help="draw no plots (they need matplotlib)")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plots from a --json file")
    args = parser.parse_args()
    if args.replot is not None:
        saved = [PeerResult(d["key"], d["label"], d["agent"], tuple(d["timings"]), d["graceful"], d["kill"],
                            d.get("partition", []))
                 for d in json.loads(args.replot.read_text())]
        for path in plot([r for r in saved if r.graceful or r.kill or r.partition], args.plots):
            print(f"plot: {path} ({path.stat().st_size // 1024} KB)")
        return 0
    advertise = None
    if args.partition_runs > 0:
        # Checked before anything starts: the partition runs come last, after half an hour of
        # other figures. The lock is checked again (for real) when the node starts.
        if (reason := unavailable_reason(find_all())) is not None:
            print(f"partition runs skipped: {reason}", flush=True)
            args.partition_runs = 0
        elif (busy := busy_reason()) is not None:
            print(f"compare_clientgo: error: {busy} (or pass --partition-runs 0)", file=sys.stderr)
            return 2
        else:
            # The pods reach the API server through the `kubernetes` Service, whose endpoint is
            # the advertised address: it must be the node IP.
            advertise = NodeLayout().node_ip
    binary = build()
    with bench_servers("singleton-bench-clientgo-", advertise_address=advertise) as (dsn, control_plane, workdir):
        measure(args, binary, dsn, workdir, control_plane)
    return 0


if __name__ == "__main__":
    sys.exit(main())
