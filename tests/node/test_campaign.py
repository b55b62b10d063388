"""The checkers can fail, and the fault campaign finds nothing to fail on.

- Deliberately unsafe configurations, real sidecar processes on the real PostgreSQL server
  (postgres backend), judged by the act log and the fenced ledger:
  - a worker that cannot check its term's deadline (``LEDGER_DEADLINE_CHECK=off``), its whole
    pod frozen mid-item past the lease and thawed worker first (the order no gate can prevent):
    unfenced, its late write is accepted (overlap, regression, stale write) and the act log shows
    it acting in its successor's term; fenced, the fence refuses it ("fenced out") and the ledger
    stays clean, while the act log still shows the refused act, begun after its successor's
    first: unsafe for an app whose acts are not fenced writes;
  - a writer outside any gate, started by the test with a deposed term's token and identity
    (nothing a gated worker can do escapes the keeper: see the next case): unfenced, the checker
    reports overlaps and stale writes; fenced, it is fenced out and the act log still shows it;
  - a gated writer that escapes into a session of its own, deaf to SIGTERM (``LEDGER_ESCAPE``):
    the keeper, a child subreaper, still stops it when its sidecar dies (it is reparented to the
    keeper once its parent is killed), so nothing overlaps.
- The campaign's verdict rule on hand-made act logs (pure): an acting overlap is an act in flight
  through a freeze only during a whole-pod freeze, from the frozen term, with no late act.
- The same through the campaign's pipeline: pods on the session's real node whose workers cannot
  check their deadline, the whole pod frozen past the lease: the verdict must be FAIL.
- The CI quick campaign (``benchmarks.campaign``, ``--quick``) on the session's real node
  (its control plane restarted by the faults, its own PostgreSQL): 3 sidecar pods per group, two
  groups per backend (exec gate and file gate, fenced and not), every pod's app detaching a
  worker (setsid, Popen(start_new_session=True), a daemon's double fork), every fault kind
  (the Lease forced free and deleted, and a PostgreSQL session ended while its sidecar is stalled,
  included), 0 acting overlaps (but acts in flight through
  a freeze), 0 fenced overlaps, 0 regressions, bounded in time (under 5 minutes on the 2-core
  development machine).
- The app's launcher (pure, local processes): it detaches its worker each way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from benchmarks.campaign_bed import Borrowed

from singleton_testbed.harness.sidecars import FAST_TIMINGS, SidecarProcess, one_leader, wait_for
from singleton_testbed.ledger import LedgerReport, check_ledger
from singleton_testbed.procs import process_alive
from tests.conftest import REAL_NODE_TOLERATION, RealNode
from tests.support.paths import DATA

WORKER = str(DATA / "ledger_worker.py")
Factory = Callable[..., list[SidecarProcess]]


@pytest.fixture
def group() -> str:
    return "camp-" + uuid.uuid4().hex[:10]


@pytest.fixture
def gated(pg_dsn: str, group: str, tmp_path: Path) -> Iterator[Factory]:
    """Postgres-backend sidecars gating the ledger worker, with worker options."""
    started: list[SidecarProcess] = []

    def make(count: int = 3, **worker: str) -> list[SidecarProcess]:
        for index in range(count):
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": pg_dsn,
                   "SINGLETON_IDENTITY": f"w{index}-{uuid.uuid4().hex[:6]}", "LEDGER_DSN": pg_dsn,
                   **FAST_TIMINGS, **worker}
            started.append(SidecarProcess(f"w{index}", env, tmp_path / f"w{index}.log",
                                          command=[sys.executable, WORKER]).start())
        return list(started)

    yield make
    for sidecar in started:
        sidecar.stop()


async def last_row(dsn: str, group: str) -> tuple[int, str] | None:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow("SELECT token, phase FROM ledger WHERE group_name = $1 ORDER BY id DESC LIMIT 1",
                                  group)
    except asyncpg.UndefinedTableError:
        return None
    finally:
        await conn.close()
    return None if row is None else (int(row["token"]), str(row["phase"]))


async def wait_row(dsn: str, group: str, token: int, phase: str | None = None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (row := await last_row(dsn, group)) is None or row[0] != token or phase not in (None, row[1]):
        assert time.monotonic() < deadline, f"no {phase or 'row'} of token {token} in the ledger (last: {row})"
        await asyncio.sleep(0.01)


async def late_act(dsn: str, group: str, old: int, new: int, timeout: float = 10.0) -> str:
    """Wait until token ``old`` has ended an act it began after token ``new``'s first act, and
    return that act's outcome (written, refused, failed)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = await asyncpg.connect(dsn)
        try:
            outcome = await conn.fetchval(
                "SELECT outcome FROM acts WHERE group_name = $1 AND token = $2 AND outcome IS NOT NULL AND began_at > "
                "(SELECT min(began_at) FROM acts WHERE group_name = $1 AND token = $3) ORDER BY id LIMIT 1",
                group, old, new)
        finally:
            await conn.close()
        if outcome is not None:
            return str(outcome)
        assert time.monotonic() < deadline, f"token {old} did not act after token {new} began"
        await asyncio.sleep(0.02)


async def freeze_mid_item_past_the_lease(members: list[SidecarProcess], dsn: str,
                                         group: str) -> tuple[LedgerReport, str, int]:
    """Freeze the leader's whole pod (every process) while its worker has an item in flight, until
    another sidecar leads and has written; thaw the worker first and wait until it has acted once
    more, then the rest of the pod. Returns the report, that late act's outcome and the frozen
    term's token."""
    leader = await asyncio.to_thread(one_leader, members)
    doc = leader.leader_doc()
    assert doc is not None
    await wait_row(dsn, group, doc["token"], "start")
    leader.signal(signal.SIGSTOP)  # the whole pod: sidecar, keeper, worker
    new = await asyncio.to_thread(one_leader, [m for m in members if m is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None and new_doc["token"] > doc["token"]
    await wait_row(dsn, group, new_doc["token"])
    leader.signal_app_only(signal.SIGCONT)  # the worker wakes before its keeper can stop it
    outcome = await late_act(dsn, group, doc["token"], new_doc["token"])
    leader.signal(signal.SIGCONT)
    await asyncio.to_thread(wait_for, lambda: not leader.ready() and leader.leader_doc() is not None, 5,
                            "the woken leader to answer as a standby")
    await asyncio.sleep(1.0)
    return await check_ledger(dsn, group), outcome, int(doc["token"])


@pytest.mark.postgres
async def test_checker_catches_unfenced_writes_of_a_worker_woken_past_its_lease(
    gated: Factory, pg_dsn: str, group: str
) -> None:
    members = gated(LEDGER_FENCE="off", LEDGER_DEADLINE_CHECK="off", LEDGER_ITEM_SECONDS="0.3")
    report, outcome, frozen = await freeze_mid_item_past_the_lease(members, pg_dsn, group)
    assert outcome == "written"
    assert not report.safe, report.summary()
    assert report.overlaps, report.summary()
    assert report.stale_accepted and report.regressions, report.summary()
    stale = report.stale_accepted[0]
    assert stale.token < stale.newest_seen == report.terms[-1][0]
    assert report.acts_checked, report.summary()
    assert [(o.earlier, o.late_acts > 0) for o in report.acting_overlaps] == [(frozen, True)], report.summary()


@pytest.mark.postgres
async def test_the_same_pause_with_fencing_is_refused_and_clean(gated: Factory, pg_dsn: str, group: str) -> None:
    members = gated(LEDGER_DEADLINE_CHECK="off", LEDGER_ITEM_SECONDS="0.3")
    report, outcome, frozen = await freeze_mid_item_past_the_lease(members, pg_dsn, group)
    assert outcome == "refused"
    assert report.ledger_safe, report.summary()
    assert not report.overlaps and not report.regressions and not report.stale_accepted
    assert any("fenced out" in m.log() for m in members), (
        f"the woken worker's write was refused by the fence: {report.summary()}")
    assert report.lost_at_handover, "its item stayed in flight: the fence refused the done row"
    # The refused write was an act all the same, begun after the new term's first: the act log
    # shows what the ledger cannot.
    assert report.acts_checked, report.summary()
    assert [(o.earlier, o.late_acts) for o in report.acting_overlaps] == [(frozen, 1)], report.summary()
    assert not report.safe


async def stale_writer_outside_any_gate(members: list[SidecarProcess], dsn: str, group: str, tmp_path: Path,
                                        **worker: str) -> tuple[LedgerReport, int, str, int]:
    """The leader's pod is killed and another leads; then a worker the test starts itself, under no
    gate, acts with the killed term's token and identity for a second. Returns the report, the
    writer's exit status, its output, and the killed term's token."""
    leader = await asyncio.to_thread(one_leader, members)
    doc = leader.leader_doc()
    assert doc is not None
    await wait_row(dsn, group, doc["token"])
    leader.signal(signal.SIGKILL)  # the whole pod
    new = await asyncio.to_thread(one_leader, [m for m in members if m is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None and new_doc["token"] > doc["token"]
    await wait_row(dsn, group, new_doc["token"])
    env = {**os.environ, "LEDGER_DSN": dsn, "SINGLETON_GROUP": group, "SINGLETON_FENCE_KEY": doc["fenceKey"],
           "SINGLETON_TOKEN": str(doc["token"]), "SINGLETON_IDENTITY": doc["identity"], **worker}
    status, output = await asyncio.to_thread(run_for, [sys.executable, WORKER], env, 1.5, tmp_path / "stale.log")
    await asyncio.sleep(0.5)
    return await check_ledger(dsn, group), status, output, int(doc["token"])


def run_for(argv: list[str], env: dict[str, str], seconds: float, log: Path) -> tuple[int, str]:
    """Run ``argv`` until it exits or ``seconds`` passed (then SIGTERM): its status and output."""
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        status = process.wait(seconds)
    except subprocess.TimeoutExpired:
        process.terminate()
        status = process.wait(10)
    return status, log.read_text(errors="replace")


@pytest.mark.postgres
async def test_checker_catches_a_writer_outside_any_gate(gated: Factory, pg_dsn: str, group: str,
                                                         tmp_path: Path) -> None:
    members = gated(LEDGER_FENCE="off")
    report, status, output, stale = await stale_writer_outside_any_gate(members, pg_dsn, group, tmp_path,
                                                                        LEDGER_FENCE="off")
    assert status == 0, output  # it acted until told to stop
    assert report.overlaps, report.summary()
    assert report.stale_accepted and all(row.token == stale for row in report.stale_accepted), report.summary()
    assert report.acts_checked, report.summary()
    assert any(o.earlier == stale and o.late_acts > 1 for o in report.acting_overlaps), report.summary()


@pytest.mark.postgres
async def test_a_writer_outside_any_gate_is_still_fenced_out(gated: Factory, pg_dsn: str, group: str,
                                                             tmp_path: Path) -> None:
    members = gated()
    report, status, output, stale = await stale_writer_outside_any_gate(members, pg_dsn, group, tmp_path)
    assert status == 3 and "fenced out" in output, output
    assert report.ledger_safe, report.summary()
    # Refused, it had acted all the same, in its successor's term.
    assert report.acts_checked, report.summary()
    assert [(o.earlier, o.late_acts) for o in report.acting_overlaps] == [(stale, 1)], report.summary()
    assert not report.safe


def pids_alive(pidfile: Path) -> list[int]:
    pids = [int(pid) for pid in pidfile.read_text().split()] if pidfile.exists() else []
    return [pid for pid in pids if process_alive(pid)]


def kill_escaped(pidfile: Path) -> None:
    for pid in pids_alive(pidfile):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.postgres
async def test_a_writer_escaped_into_its_own_session_is_stopped_by_the_keeper(
    gated: Factory, pg_dsn: str, group: str, tmp_path: Path
) -> None:
    """``LEDGER_ESCAPE``: the gated process starts the real writer in a session of its own, deaf
    to SIGTERM. The leader's sidecar is killed alone: its keeper kills the app's group at once,
    and the escaped writer, reparented to the keeper (a child subreaper) when its parent dies,
    with it. Unfenced, nothing but the keeper stands between it and the next leader."""
    pidfile = tmp_path / "escaped.pids"
    members = gated(LEDGER_FENCE="off", LEDGER_ESCAPE="60", LEDGER_ESCAPE_PIDFILE=str(pidfile))
    try:
        leader = await asyncio.to_thread(one_leader, members)
        doc = leader.leader_doc()
        assert doc is not None
        await wait_row(pg_dsn, group, doc["token"])  # the escaped writer writes
        escaped = pids_alive(pidfile)
        assert escaped, "the escaped writer runs"
        leader.signal_sidecar_only(signal.SIGKILL)
        await asyncio.to_thread(wait_for, lambda: not pids_alive(pidfile), 5, "the keeper to kill the escaped writer")
        new = await asyncio.to_thread(one_leader, [m for m in members if m is not leader], 10)
        new_doc = new.leader_doc()
        assert new_doc is not None
        await wait_row(pg_dsn, group, new_doc["token"])
        await asyncio.sleep(0.5)
        report = await check_ledger(pg_dsn, group)
    finally:
        kill_escaped(pidfile)
    assert report.acts_checked and len(report.acting.actors) >= 2, report.summary()
    assert report.safe, report.summary()


def test_the_verdict_rule_on_acts_in_flight_through_a_freeze() -> None:
    """``campaign_report``: an acting overlap is an act in flight through a freeze only during a
    whole-pod ``sigstop``, from the frozen term, with no act begun after its successor began but
    those decided (deadline check passed) before it;
    anything else is a gate failure. Such an overlap's acts that ended after the successor's
    first act are counted, with the latest's end and their outcomes, in a line of the render
    that states the rule (only a fence refuses those). Idle gaps go to the fault (and path)
    that ended the term. An unfenced segment's ledger findings are reported, not counted."""
    from datetime import UTC, datetime, timedelta

    from benchmarks.campaign_bed import Variant
    from benchmarks.campaign_faults import FaultRecord
    from benchmarks.campaign_report import BackendResult, CampaignResult, LoggedAct, Segment

    from singleton_testbed.ledger import judge, judge_acts

    t = datetime(2026, 1, 1, tzinfo=UTC)
    base = t.timestamp()

    def act(i: int, token: int, began: int, ended: int, decided: int | None = None) -> dict[str, object]:
        return {"id": i, "identity": f"id-{token}", "token": token, "pid": token, "max_seconds": 0.05,
                "began_at": t + timedelta(milliseconds=began), "ended_at": t + timedelta(milliseconds=ended),
                "decided_at": None if decided is None else t + timedelta(milliseconds=decided),
                "item": i, "outcome": "refused" if token == 5 else "written"}

    def row(i: int, token: int, phase: str, ms: int) -> dict[str, object]:
        return {"id": i, "identity": f"id-{token}", "token": token, "item": 1, "phase": phase,
                "at": t + timedelta(milliseconds=ms)}

    def fault(kind: str, old: int, new: int, at_ms: int, path: str) -> FaultRecord:
        return FaultRecord("postgres", kind, 0, "pod", old, base + at_ms / 1000, path=path,
                           recovered=base + at_ms / 1000 + 0.1, new_token=new)

    # Token 5 frozen at 1000 ms mid-act; token 7 acts from 3000; 5 ends its act at 3050: in flight.
    inflight = [act(1, 5, 0, 10), act(2, 5, 990, 3050), act(3, 7, 3000, 3010), act(4, 7, 3100, 3110)]
    # The same, but token 5 then begins another act at 3060: a late act, a failure.
    late = [*inflight, act(5, 5, 3060, 3070)]
    # Token 5's deadline check passed at 999 ms, the freeze came before its act, which began at
    # 3060 on waking: decided in its term, in flight. Checked at 3055 instead: a failure.
    decided = [*inflight, act(5, 5, 3060, 3070, decided=999)]
    checked_late = [*inflight, act(5, 5, 3060, 3070, decided=3055)]
    # Token 7 steps down at 5000; token 9 begins at 5600 while 7's last act ends at 5650: a failure
    # in a step-down, whatever its late acts.
    step = [act(1, 7, 0, 10), act(2, 7, 5590, 5650), act(3, 9, 5600, 5610)]
    freeze = fault("sigstop", 5, 7, 1000, "pod frozen whole")
    # (acts, faults, in flight, failures, acts caught mid-act that ended after token 7's first
    # act and the latest's end after it in ms: counted for overlaps in flight only)
    cases = [(inflight, [freeze], 1, 0, 1, 50), (late, [freeze], 0, 1, 0, 0), (decided, [freeze], 1, 0, 2, 70),
             (checked_late, [freeze], 0, 1, 0, 0),
             (step, [fault("step-down", 7, 9, 5000, "step-down (POST /step-down)")], 0, 1, 0, 0),
             # an overlap during a freeze whose earlier actor is not the frozen term
             (inflight, [fault("sigstop", 3, 7, 1000, "pod frozen whole")], 0, 1, 0, 0)]
    for acts, faults, in_flight, failures, caught, latest_ms in cases:
        report = judge([row(1, 5, "start", 0)])  # type: ignore[list-item]
        report.acting = judge_acts(acts)
        earlier = {o.earlier for o in report.acting_overlaps}
        segment = Segment(0, "g", Variant("exec", True), faults=faults, report=report,
                          acts=[LoggedAct.of(a) for a in acts if a["token"] in earlier])
        result = BackendResult("postgres", [segment])
        result.attribute()
        entry = result.stats[faults[0].kind]
        assert (entry.inflight, entry.acting) == (in_flight, failures), (acts, faults)
        assert result.paths[faults[0].path].acting == failures
        assert (entry.caught, entry.caught_refused) == (caught, caught), (acts, faults)
        assert entry.caught_longest == pytest.approx(latest_ms / 1000), (acts, faults)
        # Every acting overlap is listed with its verdict, its fault and the acts that made it.
        assert len(segment.findings) == 1 and (("in flight through a freeze" in segment.findings[0]) == bool(in_flight))
        assert f"{faults[0].kind} #0" in segment.findings[0]
        campaign = CampaignResult(seed=1, quick=True, backends=[result])
        line = campaign.caught_line()
        assert line.startswith(f"Acts a whole-pod freeze caught mid-act that finished after the successor began "
                               f"acting: {caught} (in {in_flight} of {int(faults[0].kind == 'sigstop')} freezes)")
        assert "only a fence refuses those" in line and line in campaign.render()
        if caught:
            assert f"the latest ending {latest_ms} ms after the successor's first act; {caught} refused" in line
            assert f"{caught} acts caught mid-act finished after the successor began" in campaign.verdict()

    # Without the acts read, an overlap in flight stands for one act ending where it ends.
    report = judge([row(1, 5, "start", 0)])  # type: ignore[list-item]
    report.acting = judge_acts(inflight)
    result = BackendResult("postgres", [Segment(0, "g", Variant("exec", True), faults=[freeze], report=report)])
    result.attribute()
    assert (result.stats["sigstop"].caught, result.stats["sigstop"].caught_refused) == (1, 0)
    assert result.stats["sigstop"].caught_longest == pytest.approx(0.05)

    # Idle gaps by kind and path; an unfenced segment's ledger overlap is reported, not counted.
    acts = [act(1, 5, 0, 10), act(2, 7, 800, 810)]
    ledger = [row(1, 5, "start", 0), row(2, 7, "start", 800), row(3, 5, "done", 900)]
    handover = fault("handover", 5, 7, 200, "handover (singletonctl)")
    for fence in (True, False):
        report = judge(ledger)  # type: ignore[arg-type]
        report.acting = judge_acts(acts)
        result = BackendResult("lease", [Segment(0, "g", Variant("file", fence), faults=[handover], report=report)])
        result.attribute()
        entry = result.stats["handover"]
        assert entry.idle == [pytest.approx(0.79)] and result.paths["handover (singletonctl)"].idle == entry.idle
        assert (entry.overlaps, entry.stale, entry.unfenced_ledger) == ((1, 1, 0) if fence else (0, 0, 2))


def test_gaps_and_lost_items_are_measured() -> None:
    """The checker's arithmetic on a hand-made ledger: two terms, a gap, a lost item."""
    from datetime import UTC, datetime, timedelta

    from singleton_testbed.ledger import LedgerJudge, judge

    t = datetime(2026, 1, 1, tzinfo=UTC)

    def row(i: int, token: int, item: int, phase: str, ms: int) -> dict[str, object]:
        return {"id": i, "identity": f"id-{token}", "token": token, "item": item, "phase": phase,
                "at": t + timedelta(milliseconds=ms)}

    rows = [row(1, 5, 1, "start", 0), row(2, 5, 1, "done", 10), row(3, 5, 2, "start", 20),
            row(4, 7, 1, "start", 2520), row(5, 7, 1, "done", 2530), row(6, 7, 2, "start", 2540)]
    report = judge(rows, gap_bound=2.0)  # type: ignore[arg-type]
    assert report.safe and report.rows == 6
    assert not report.acts_checked and "acts NOT checked" in report.summary(), "judge() reads no act log"
    assert [(g.before, g.after) for g in report.gaps] == [(5, 7)] and report.handovers == report.gaps
    assert report.max_gap == pytest.approx(2.5)
    assert len(report.long_gaps) == 1
    assert [(o.token, o.item) for o in report.lost_at_handover] == [(5, 2)]
    assert report.lost_items == ["token 5 item 2", "token 7 item 2"]

    late = [*rows, row(7, 5, 2, "done", 2550)]  # token 5 writes after token 7 began
    bad = judge(late)  # type: ignore[arg-type]
    assert len(bad.overlaps) == 1 and len(bad.regressions) == 1 and len(bad.stale_accepted) == 1
    assert bad.stale_accepted[0].newest_seen == 7
    assert not bad.gaps and [h.seconds for h in bad.handovers] == [pytest.approx(-0.03)]  # the overlap, signed
    assert not bad.safe

    # The demo feeds one judge row by row and asks for the verdict after each poll: asking
    # must not disturb what follows, and a report must not change as more rows come.
    fed = LedgerJudge(gap_bound=2.0)
    begun: list[object] = []
    reports = []
    for r in late:
        if fed.add(r):  # type: ignore[arg-type]
            begun.append(r["token"])
        reports.append(fed.report())
    assert begun == [5, 7]
    assert reports == [judge(late[:count], gap_bound=2.0) for count in range(1, len(late) + 1)]  # type: ignore[arg-type]


# --- the CI quick campaign ----------------------------------------------------------------------

@pytest.fixture
def borrowed(real_node: RealNode, project_image: str, test_apps_image: str) -> Borrowed:
    """The session's control plane and real node, with both images, for the campaign."""
    assert real_node.cluster.control_plane is not None
    return Borrowed(real_node.cluster.control_plane, real_node.node, project_image, test_apps_image,
                    tolerations=[REAL_NODE_TOLERATION])


@pytest.mark.k8s
@pytest.mark.postgres
@pytest.mark.timeout(480)
def test_ci_quick_campaign_all_faults_no_overlap_no_regression(borrowed: Borrowed, tmp_path: Path) -> None:
    """CI's quick fault campaign (``python -m benchmarks.campaign --quick``): each backend in
    turn, an exec-gated and a file-gated group, fenced and not, every fault kind that applies to
    it (the API server and etcd restarts on one backend each), seeded, every pod's app detaching
    a worker that acts too; safety must hold by what the apps did (the act log: the detached
    workers' acts included) and by the fenced ledger, and time is bounded."""
    from benchmarks.campaign import CampaignOptions, run_campaign
    from benchmarks.campaign_faults import (
        ACT_LOG_KINDS,
        ALL_KINDS,
        DRAIN_TIMEOUT_PATH,
        FORCED_LEASE_KINDS,
        NEW_KINDS,
        PATHS,
    )

    seed = int(os.environ.get("SINGLETON_CAMPAIGN_SEED", "1"))
    started = time.monotonic()
    result = run_campaign(CampaignOptions(quick=True, seed=seed, workdir=tmp_path / "campaign", borrowed=borrowed))
    elapsed = time.monotonic() - started
    print(result.render())
    assert result.total_acting_failures == 0, result.render()
    assert result.total_overlaps == 0, result.render()
    assert result.total_regressions == 0 and result.total_stale == 0, result.render()
    assert not result.unrecovered, result.render()
    assert result.verdict_ok, result.render()
    segments = [(b.backend, s) for b in result.backends for s in b.segments]
    assert all(s.report is not None and s.report.acts_checked for _, s in segments), result.render()
    assert {(backend, s.variant.gate) for backend, s in segments} == {
        (b, g) for b in ("postgres", "lease", "both") for g in ("exec", "file")}, "each gate on every backend"
    assert {s.variant.fence for _, s in segments} == {True, False}
    injected = {record.kind for backend in result.backends for record in backend.faults}
    assert set(ACT_LOG_KINDS) <= injected, f"act-log kinds not injected: {set(ACT_LOG_KINDS) - injected}"
    assert set(NEW_KINDS) <= injected, f"new kinds not injected: {set(NEW_KINDS) - injected}"
    assert injected == set(ALL_KINDS), f"not injected: {set(ALL_KINDS) - injected}"
    # The forced Lease releases and deletions, on both backends with a Lease, each ended its term.
    lease_faults = [(b.backend, r) for b in result.backends for r in b.faults if r.kind in FORCED_LEASE_KINDS]
    assert {(backend, r.kind) for backend, r in lease_faults} == {
        (b, k) for b in ("lease", "both") for k in FORCED_LEASE_KINDS}, lease_faults
    assert all(r.changed and r.path == PATHS[r.kind] for _, r in lease_faults), lease_faults
    # A PostgreSQL session ended while its sidecar was stalled, on both backends with PostgreSQL,
    # each with a new term (the stall outlasts the takeover wait) and its sessions named.
    stalled = [(b.backend, r) for b in result.backends for r in b.faults if r.kind == "pg-terminate-stalled"]
    assert {backend for backend, _ in stalled} == {"postgres", "both"}, stalled
    assert all(r.changed and r.path == PATHS[r.kind] and "terminated" in r.detail for _, r in stalled), stalled
    # Every pod detached a worker, and in every segment the detached workers acted and logged it.
    assert all(p.detach for _, s in segments for p in s.profiles.values()), result.render()
    assert all(s.detached_acts > 0 and s.detached_processes > 0 for _, s in segments), result.render()
    assert "Acts a whole-pod freeze caught mid-act that finished after the successor began acting: " in (
        result.render())
    # The slow pod's drain always outlasts its timeout, pod deleted or not: the report must say so.
    timed_out = [(r.kind, r.detail, r.path) for b in result.backends for r in b.faults if r.kind == "drain-timeout"]
    assert timed_out and all(path == DRAIN_TIMEOUT_PATH for _, _, path in timed_out), timed_out
    assert elapsed < 300, f"the quick campaign took {elapsed:.0f}s (about 160 s on 2 cores)"


def test_the_launcher_detaches_a_worker_each_way(tmp_path: Path) -> None:
    """``campaign_bed.APP_COMMAND``: the app's launcher starts one more worker outside the app's
    process group and session (``setsid``, ``popen``, ``daemon``: orphaned, its parent gone), as
    child ``DETACHED_CHILD`` with no children of its own, then becomes the worker itself (same
    pid, still in the launcher's group); with no idiom it only becomes the worker."""
    import json

    from benchmarks.campaign_bed import APP_COMMAND, DETACH_IDIOMS, DETACHED_CHILD

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys, time\n"
        "record = {'pid': os.getpid(), 'ppid': os.getppid(), 'pgid': os.getpgid(0), 'sid': os.getsid(0),\n"
        "          'child': os.environ.get('LEDGER_CHILD'), 'children': os.environ.get('LEDGER_CHILDREN'),\n"
        "          'detach': os.environ.get('LEDGER_DETACH')}\n"
        "with open(sys.argv[0] + '.out', 'a') as out:\n"
        "    out.write(json.dumps(record) + '\\n')\n"
        "time.sleep(0.3)\n")
    command = [sys.executable, *APP_COMMAND[1:-1], str(worker)]
    assert APP_COMMAND[-1].endswith("/data/ledger_worker.py")
    for idiom in (*DETACH_IDIOMS, ""):
        out = Path(f"{worker}.out")
        out.unlink(missing_ok=True)
        env = {**os.environ, "LEDGER_DETACH": idiom, "LEDGER_DETACHED_CHILD": str(DETACHED_CHILD),
               "LEDGER_CHILDREN": "2"}
        launcher = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
        _, said = launcher.communicate(timeout=10)
        assert launcher.returncode == 0, said
        deadline = time.monotonic() + 5
        while len(out.read_text().splitlines() if out.exists() else []) < (2 if idiom else 1):
            assert time.monotonic() < deadline, (idiom, said)
            time.sleep(0.02)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        app = next(r for r in records if r["pid"] == launcher.pid)
        assert app["pgid"] == launcher.pid and app["child"] is None and app["children"] == "2", records
        assert app["detach"] is None, "the worker itself runs without LEDGER_DETACH"
        detached = [r for r in records if r["pid"] != launcher.pid]
        if not idiom:
            assert not detached, records
            continue
        assert len(detached) == 1, records
        assert detached[0]["child"] == str(DETACHED_CHILD) and detached[0]["children"] == "0", records
        assert detached[0]["pgid"] != app["pgid"] and detached[0]["sid"] != app["sid"], (idiom, records)
        assert detached[0]["sid"] == detached[0]["pgid"], records  # a session and group of its own
        if idiom == "daemon":
            assert detached[0]["sid"] != detached[0]["pid"], "the middle process led the session"
            assert detached[0]["ppid"] != launcher.pid, "orphaned: its parent, the middle process, exited"
        else:
            assert detached[0]["sid"] == detached[0]["pid"] and detached[0]["ppid"] == launcher.pid, records
        assert f"detached a worker ({idiom})" in said.decode()
        time.sleep(0.4)  # the workers end


def test_the_issue_31_faults_apply_where_they_elect() -> None:
    """``lease-release`` and ``lease-delete`` apply to the backends with a Lease,
    ``pg-terminate-stalled`` to those with PostgreSQL, each with a path of its own; quick mode
    deals every kind that applies, the API server and etcd restarts once per run (on one backend
    each), the rest on every backend they apply to."""
    from benchmarks.campaign import CampaignOptions, _kinds
    from benchmarks.campaign_faults import (
        ALL_KINDS,
        APPLIES,
        FORCED_LEASE_KINDS,
        NEW_KINDS,
        NODE_KINDS,
        PATHS,
        POSTGRES_KINDS,
        RELEASE_PATCH,
    )

    assert set(FORCED_LEASE_KINDS) == {"lease-release", "lease-delete"}
    assert set(NEW_KINDS) == {*FORCED_LEASE_KINDS, "pg-terminate-stalled"} and set(NEW_KINDS) <= set(ALL_KINDS)
    assert len(set(ALL_KINDS)) == len(ALL_KINDS) == 18
    for kind in FORCED_LEASE_KINDS:
        assert kind in APPLIES["lease"] and kind in APPLIES["both"] and kind not in APPLIES["postgres"]
    assert "pg-terminate-stalled" in POSTGRES_KINDS
    assert [b for b in ("postgres", "lease", "both") if "pg-terminate-stalled" in APPLIES[b]] == ["postgres", "both"]
    assert set(APPLIES["both"]) == set(ALL_KINDS) and set(PATHS) == set(ALL_KINDS) | set(NODE_KINDS)
    for kind in NEW_KINDS:
        assert [k for k, path in PATHS.items() if path == PATHS[kind]] == [kind]
    quick = {b: _kinds(b, CampaignOptions(quick=True)) for b in ("postgres", "lease", "both")}
    assert [len(kinds) for kinds in quick.values()] == [13, 13, 17]
    assert set(quick["postgres"]) | set(quick["lease"]) | set(quick["both"]) == set(ALL_KINDS)
    # The API server and etcd restarts once per quick run, on a backend each; everything else wherever it applies.
    assert ("apiserver-restart" in quick["lease"], "etcd-restart" in quick["both"]) == (True, True)
    assert "apiserver-restart" not in quick["both"] and "etcd-restart" not in quick["lease"]
    assert all(set(FORCED_LEASE_KINDS) <= set(quick[b]) for b in ("lease", "both"))
    assert all("pg-terminate-stalled" in quick[b] for b in ("postgres", "both"))
    assert [len(_kinds(b, CampaignOptions())) for b in ("postgres", "lease", "both")] == [13, 14, 18]
    one = CampaignOptions(quick=True, backends=("both",))
    assert {"apiserver-restart", "etcd-restart"} <= set(_kinds("both", one))
    assert RELEASE_PATCH == '{"spec":{"holderIdentity":null}}'  # the runbook's


@pytest.mark.k8s
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_the_campaign_fails_when_apps_cannot_check_their_deadline(borrowed: Borrowed, tmp_path: Path) -> None:
    """The same pipeline with workers that cannot check their term's deadline and do not fence:
    a whole pod frozen past the lease and thawed app first acts again after its successor began.
    A freeze shows up as an acting overlap with late acts (a failure, not an act in flight
    through a freeze), the ledger must show the late writes, and the verdict must say FAIL."""
    from benchmarks.campaign import CampaignOptions, run_campaign
    from benchmarks.campaign_bed import Variant

    result = run_campaign(CampaignOptions(backends=("postgres",), kinds=("sigstop",), faults=2, seed=7,
                                          variants=(Variant("exec", False),),
                                          worker_env={"LEDGER_DEADLINE_CHECK": "off"},
                                          workdir=tmp_path / "campaign", borrowed=borrowed))
    print(result.render())
    stats = result.backends[0].stats["sigstop"]
    # Not every freeze can show: a worker frozen inside a transaction longer than its
    # idle-in-transaction timeout finds its session ended on waking and exits without acting
    # again; the act it was in when frozen then ends, failed, after its successor began: an act
    # in flight through the freeze (reported, not a failure). One late act is enough to fail.
    assert stats.count == 2 and stats.acting >= 1, result.render()
    assert stats.unfenced_ledger > 0, result.render()
    assert not result.verdict_ok and "VERDICT: FAIL" in result.verdict()


def test_whole_node_faults_are_dealt_with_two_nodes_while_the_leader_is_on_the_second() -> None:
    """``--nodes 2`` adds the whole-node faults to every backend; the deck deals one only while
    the leader runs on the second node, and first then (as the slow pod's ``drain-timeout``)."""
    import random

    from benchmarks.campaign import CampaignOptions, _kinds
    from benchmarks.campaign_faults import ALL_KINDS, NODE_KINDS, PATHS, Deck

    for backend in ("postgres", "lease", "both"):
        assert not set(NODE_KINDS) & set(_kinds(backend, CampaignOptions()))
        assert set(NODE_KINDS) <= set(_kinds(backend, CampaignOptions(nodes=2)))
    assert not set(NODE_KINDS) & set(ALL_KINDS) and len({PATHS[k] for k in NODE_KINDS}) == len(NODE_KINDS)
    deck = Deck(("sigkill", "sigstop", *NODE_KINDS), random.Random(7))
    on_first = [deck.deal() for _ in range(6)]
    assert not set(on_first) & set(NODE_KINDS), on_first
    on_second = [deck.deal(second_node_leader=True) for _ in range(3)]
    assert set(on_second) == set(NODE_KINDS), on_second


def test_only_a_deletion_with_time_to_finish_may_not_lose_its_item() -> None:
    """``delete-pod`` and ``drain-timeout`` (as a deletion) both delete the leader's pod; only
    the first must not lose the item in flight (both on one path here, so that only the kind
    and the pod tell them apart): the second kills its slow app at a drain timeout shorter
    than its work, on purpose, as does a ``delete-pod`` dealt to the slow pod (a ``--kinds``
    run without ``drain-timeout``)."""
    from datetime import UTC, datetime, timedelta

    from benchmarks.campaign_bed import Variant
    from benchmarks.campaign_faults import FaultRecord
    from benchmarks.campaign_report import BackendResult, Segment

    from singleton_testbed.ledger import judge

    t = datetime(2026, 1, 1, tzinfo=UTC)
    # Token 5 starts item 1 and never finishes it; token 7 takes over at 800 ms.
    ledger = [{"id": 1, "identity": "id-5", "token": 5, "item": 1, "phase": "start", "at": t},
              {"id": 2, "identity": "id-7", "token": 7, "item": 2, "phase": "start",
               "at": t + timedelta(milliseconds=800)}]
    for kind, slow, lost in (("delete-pod", False, 1), ("drain-timeout", True, 0), ("delete-pod", True, 0)):
        fault = FaultRecord("lease", kind, 0, "pod", 5, t.timestamp() + 0.2, path="drain (pod deleted)",
                            recovered=t.timestamp() + 0.3, new_token=7, slow=slow)
        report = judge(ledger)  # type: ignore[arg-type]
        result = BackendResult("lease", [Segment(0, "g", Variant("file", True), faults=[fault], report=report)])
        result.attribute()
        assert result.paths["drain (pod deleted)"].lost == 1
        assert result.lost_at_graceful_deletion() == lost, (kind, slow)


def test_a_fault_counts_from_when_it_took_effect() -> None:
    """A fault whose pod took long to find (the API's container IDs lag after an API server
    restart) counts its hold and failover from when it took effect, and the report says how
    late that was; a prompt one keeps its start and says nothing; a late one whose group has a
    new leader already (nothing had been done to it yet) is an error, not a failover."""
    import random
    import time
    from typing import Any, cast

    from benchmarks.campaign_bed import CampaignError
    from benchmarks.campaign_faults import FaultRecord, Injector
    from benchmarks.campaign_poll import Sample

    class Answers:
        def __init__(self) -> None:
            self.samples: dict[str, Sample] = {}

        def latest(self) -> dict[str, Sample]:
            return dict(self.samples)

    answers = Answers()
    injector = Injector(bed=cast(Any, None), group=cast(Any, None), poller=cast(Any, answers), rng=random.Random(1))
    answers.samples = {"pod-3": Sample("pod-3", 0.0, 0.0, 200, 7), "pod-1": Sample("pod-1", 0.0, 0.0, 503, None)}
    late = FaultRecord("lease", "sigstop", 4, "pod-3", 7, t0=time.time() - 27.0, detail="5 processes")
    injector._begins(late, "frozen")
    assert abs(late.t0 - time.time()) < 1.0
    assert late.detail.startswith("5 processes; frozen 27.") and late.detail.endswith("s after being dealt")

    prompt_start = time.time() - 0.2
    prompt = FaultRecord("lease", "sigstop-sidecar", 5, "pod-3", 7, t0=prompt_start)
    injector._begins(prompt, "stopped")
    assert prompt.detail == "" and prompt.t0 > prompt_start

    answers.samples["pod-1"] = Sample("pod-1", 0.0, 0.0, 200, 8)
    changed = FaultRecord("lease", "sigkill", 6, "pod-3", 7, t0=time.time() - 5.0)
    with pytest.raises(CampaignError, match="the leader changed before the fault took effect"):
        injector._begins(changed, "killed")
