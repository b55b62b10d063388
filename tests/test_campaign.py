"""The ledger checker can fail, and the fault campaign finds nothing to fail on.

- Deliberately unsafe configurations, real sidecar processes on the real PostgreSQL server
  (postgres backend): a worker that writes without its fencing token, its leader SIGSTOPped
  mid-item past the lease; a writer that escapes the exec gate (neither the gate's SIGTERM,
  nor its SIGKILL after the kill grace, nor the pod's SIGKILL reaches it) after its leader is
  SIGKILLed. The checker must report overlaps and stale writes accepted; the same scenarios
  with fencing on must come out clean.
- The same through the campaign's pipeline: pods on the stand-in kubelet with fencing off,
  SIGSTOP past the lease: the campaign's verdict must be FAIL.
- The CI quick campaign (``benchmarks.campaign``, ``--quick``): 3 sidecar pods per backend on
  the stand-in kubelet, every fault type, 0 overlaps, 0 regressions, bounded in time (about
  2.5 minutes on the 2-core development machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest

from singleton_testbed.ledger import LedgerReport, check_ledger
from singleton_testbed.netns import netns_supported
from tests.conftest import use_existing_cluster
from tests.sidecars import FAST_TIMINGS, SidecarProcess, one_leader, wait_for

WORKER = str(Path(__file__).parent / "data" / "ledger_worker.py")
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


async def sigstop_mid_item_past_the_lease(members: list[SidecarProcess], dsn: str, group: str) -> LedgerReport:
    """SIGSTOP the leader's process group while its worker holds an item in flight, until
    another sidecar leads and has written; then SIGCONT: the woken worker finishes its item."""
    leader = await asyncio.to_thread(one_leader, members)
    doc = leader.leader_doc()
    assert doc is not None
    await wait_row(dsn, group, doc["token"], "start")
    leader.signal(signal.SIGSTOP)
    new = await asyncio.to_thread(one_leader, [m for m in members if m is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None and new_doc["token"] > doc["token"]
    await wait_row(dsn, group, new_doc["token"])
    leader.signal(signal.SIGCONT)
    await asyncio.to_thread(wait_for, lambda: not leader.ready() and leader.leader_doc() is not None, 5,
                            "the woken leader to answer as a standby")
    await asyncio.sleep(1.0)
    return await check_ledger(dsn, group)


@pytest.mark.postgres
async def test_checker_catches_unfenced_writes_of_a_leader_paused_past_its_lease(
    gated: Factory, pg_dsn: str, group: str
) -> None:
    members = gated(LEDGER_FENCE="off", LEDGER_ITEM_SECONDS="0.3")
    report = await sigstop_mid_item_past_the_lease(members, pg_dsn, group)
    assert not report.safe, report.summary()
    assert report.overlaps, report.summary()
    assert report.stale_accepted and report.regressions, report.summary()
    stale = report.stale_accepted[0]
    assert stale.token < stale.newest_seen


@pytest.mark.postgres
async def test_the_same_pause_with_fencing_is_refused_and_clean(gated: Factory, pg_dsn: str, group: str) -> None:
    members = gated(LEDGER_ITEM_SECONDS="0.3")
    report = await sigstop_mid_item_past_the_lease(members, pg_dsn, group)
    assert report.safe, report.summary()
    assert not report.overlaps and not report.regressions and not report.stale_accepted
    assert any("fenced out" in m.log() for m in members), "the woken worker's write was refused by the fence"
    assert report.lost_at_handover, "its item stayed in flight: the fence refused the done row"


async def escaped_writer_outlives_its_killed_leader(members: list[SidecarProcess], dsn: str,
                                                    group: str) -> LedgerReport:
    leader = await asyncio.to_thread(one_leader, members)
    doc = leader.leader_doc()
    assert doc is not None
    await wait_row(dsn, group, doc["token"])
    leader.signal(signal.SIGKILL)  # the whole process group, as a pod's container: not the escaped writer
    new = await asyncio.to_thread(one_leader, [m for m in members if m is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None
    await asyncio.sleep(1.5)
    return await check_ledger(dsn, group)


def kill_escaped(pidfile: Path) -> None:
    for pid in pidfile.read_text().split() if pidfile.exists() else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.postgres
async def test_checker_catches_a_writer_the_gate_cannot_stop(
    gated: Factory, pg_dsn: str, group: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "escaped.pids"
    members = gated(LEDGER_FENCE="off", LEDGER_ESCAPE="4", LEDGER_ESCAPE_PIDFILE=str(pidfile))
    try:
        report = await escaped_writer_outlives_its_killed_leader(members, pg_dsn, group)
    finally:
        kill_escaped(pidfile)
    assert report.overlaps, report.summary()
    assert report.stale_accepted, report.summary()


@pytest.mark.postgres
async def test_a_writer_the_gate_cannot_stop_is_still_fenced_out(
    gated: Factory, pg_dsn: str, group: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "escaped.pids"
    members = gated(LEDGER_ESCAPE="4", LEDGER_ESCAPE_PIDFILE=str(pidfile))
    try:
        report = await escaped_writer_outlives_its_killed_leader(members, pg_dsn, group)
    finally:
        kill_escaped(pidfile)
    assert report.safe, report.summary()
    assert any("fenced out" in m.log() for m in members), "the escaped writer was refused by the fence"


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

_NO_PODS = netns_supported() or ("the campaign runs pods on this machine's stand-in kubelet"
                                 if use_existing_cluster() else None)


@pytest.mark.k8s
@pytest.mark.postgres
@pytest.mark.timeout(480)
@pytest.mark.skipif(_NO_PODS is not None, reason=str(_NO_PODS))
def test_ci_quick_campaign_all_faults_no_overlap_no_regression(tmp_path: Path) -> None:
    """CI's quick fault campaign (``python -m benchmarks.campaign --quick``): each backend in
    turn, every fault type that applies to it, seeded; safety must hold, time is bounded."""
    from benchmarks.campaign import CampaignOptions, run_campaign
    from benchmarks.campaign_faults import ALL_KINDS

    seed = int(os.environ.get("SINGLETON_CAMPAIGN_SEED", "1"))
    started = time.monotonic()
    result = run_campaign(CampaignOptions(quick=True, seed=seed, workdir=tmp_path / "campaign"))
    elapsed = time.monotonic() - started
    print(result.render())
    assert result.total_overlaps == 0, result.render()
    assert result.total_regressions == 0 and result.total_stale == 0, result.render()
    assert not result.unrecovered, result.render()
    assert result.verdict_ok, result.render()
    injected = {record.kind for backend in result.backends for record in backend.faults}
    assert injected == set(ALL_KINDS), f"not injected: {set(ALL_KINDS) - injected}"
    assert elapsed < 300, f"the quick campaign took {elapsed:.0f}s (about 140 s on 2 cores)"


@pytest.mark.k8s
@pytest.mark.postgres
@pytest.mark.timeout(240)
@pytest.mark.skipif(_NO_PODS is not None, reason=str(_NO_PODS))
def test_the_campaign_fails_when_fencing_is_off(tmp_path: Path) -> None:
    """The same pipeline with the workers' fencing switched off: SIGSTOP past the lease must
    show up as overlaps and stale writes, and the verdict must say FAIL."""
    from benchmarks.campaign import CampaignOptions, run_campaign

    result = run_campaign(CampaignOptions(backends=("postgres",), kinds=("sigstop",), faults=2, seed=7,
                                          fence=False, workdir=tmp_path / "campaign"))
    print(result.render())
    assert result.total_overlaps > 0 and result.total_stale > 0, result.render()
    assert not result.verdict_ok and "VERDICT: FAIL" in result.verdict()
