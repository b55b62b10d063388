"""Three or more real sidecar processes on the real PostgreSQL server (postgres backend,
outside Kubernetes): leadership, failover, fencing, draining, faults."""

from __future__ import annotations

import asyncio
import json
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
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from singleton_testbed.harness.sidecars import (
    FAST_TIMINGS,
    SidecarProcess,
    leaders,
    one_leader,
    pause_leader_past_its_lease,
    stop_gate_script,
    wait_for,
)
from singleton_testbed.ledger import check_ledger
from singleton_testbed.pgbouncer import PgBouncer, PoolMode
from singleton_testbed.postgres import APP_PASSWORD, PostgresInfo, PostgresServer
from singleton_testbed.procs import free_port
from tests.support.paths import DATA
from tests.support.pgquery import fetchval

WORKER = str(DATA / "ledger_worker.py")
Factory = Callable[..., list[SidecarProcess]]


@pytest.fixture
def group() -> str:
    return "g-" + uuid.uuid4().hex[:10]


@pytest.fixture
def sidecars(pg_dsn: str, group: str, tmp_path: Path) -> Iterator[Factory]:
    started: list[SidecarProcess] = []

    def make(count: int = 3, *, gated: bool = False, extra: dict[str, str] | None = None) -> list[SidecarProcess]:
        new = []
        for _ in range(count):
            index = len(started)
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": pg_dsn,
                   "SINGLETON_IDENTITY": f"c{index}-{uuid.uuid4().hex[:6]}", "LEDGER_DSN": pg_dsn,
                   **FAST_TIMINGS, **(extra or {})}
            sidecar = SidecarProcess(f"c{index}", env, tmp_path / f"c{index}.log",
                                     command=[sys.executable, WORKER] if gated else [])
            started.append(sidecar.start())
            new.append(sidecar)
        return new

    yield make
    for sidecar in started:
        sidecar.stop()


admin = fetchval


def test_exactly_one_leader_and_probes(sidecars: Factory) -> None:
    group = sidecars(3)
    leader = one_leader(group)
    for sidecar in group:
        # A standby learns the holder's name when its lock wait times out (one retry period).
        doc = wait_for(lambda s=sidecar: (d := s.leader_doc()) and d["leader"] and d, 3, "the leader's name")
        assert doc["leader"] == leader.env["SINGLETON_IDENTITY"]
        assert sidecar.get("/livez")[0] == 200
        assert (sidecar.get("/readyz")[0] == 200) == (sidecar is leader)
        assert doc["isLeader"] == (sidecar is leader)
    metrics = leader.get("/metrics")[1]
    assert 'singleton_is_leader{backend="postgres"' in metrics and "} 1.0" in metrics
    assert "singleton_renew_latency_seconds_bucket" in metrics
    for sidecar in group:
        families = text_string_to_metric_families(sidecar.get("/metrics")[1])
        samples = {sample.name: sample.value for family in families for sample in family.samples}
        # Every replica sees the lock held (the standbys learned the holder above); one term was won.
        assert samples["singleton_lock_held"] == 1.0
        assert samples["singleton_terms_total"] == (1.0 if sidecar is leader else 0.0)
    # What Prometheus gets: OpenMetrics, the same series (a client that does not ask for it gets
    # the classic format above).
    content_type, body = leader.scrape()
    assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert body.endswith("# EOF\n")
    labelled: dict[tuple[str, str | None], float] = {
        (s.name, s.labels.get("role")): s.value for family in openmetrics_families(body) for s in family.samples}
    assert labelled[("singleton_is_leader", None)] == 1.0
    assert labelled[("singleton_terms_total", None)] == 1.0
    assert labelled[("singleton_role", "leader")] == 1.0
    assert ("singleton_renew_latency_seconds_bucket", None) in labelled
    plain_type, _ = leader.scrape("text/plain;version=0.0.4")
    assert plain_type == "text/plain; version=0.0.4; charset=utf-8"
    # Control actions are not reachable through the probe port: it has no such routes at all
    # (405 would mean a /drain route exists there for some method), and the leader still leads.
    for path in ("/drain", "/drain?wait=true", "/step-down"):
        assert leader.probe("POST", path)[0] == 404, path
        assert leader.get(path)[0] == 404, path
    assert one_leader(group) is leader
    assert (leader.leader_doc() or {}).get("role") == "leader"


def test_sigkill_failover_with_greater_token(sidecars: Factory) -> None:
    group = sidecars(3)
    tokens = []
    for _ in range(2):
        leader = one_leader([s for s in group if s.alive()])
        doc = leader.leader_doc()
        assert doc is not None
        tokens.append(doc["token"])
        leader.signal(signal.SIGKILL)
        started = time.monotonic()
        new = one_leader([s for s in group if s.alive()], timeout=10)
        # Bounded by the dead leader's term (its app may act until then: lease 2 s) plus a
        # retry (0.5 s), with room for a loaded machine: a bound of 2 s once failed at 2.003 s.
        assert time.monotonic() - started < 4.0
        assert new is not leader
    doc = one_leader([s for s in group if s.alive()]).leader_doc()
    assert doc is not None
    tokens.append(doc["token"])
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


async def test_pg_terminate_backend_makes_leader_step_down_at_once(
    sidecars: Factory, group: str, pg_admin_dsn: str
) -> None:
    members = sidecars(2)
    leader = await asyncio.to_thread(one_leader, members)
    pid = await admin(pg_admin_dsn, "SELECT holder_pid FROM singleton_leases WHERE group_name = $1", f"local/{group}")
    assert await admin(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid)
    started = time.monotonic()
    await asyncio.to_thread(wait_for, lambda: not leader.ready() or None, 2, "the leader to step down")
    assert time.monotonic() - started < 0.5
    await asyncio.to_thread(one_leader, members, 5)


async def test_sigstop_leader_steps_down_and_its_token_is_fenced(
    sidecars: Factory, group: str, pg_dsn: str
) -> None:
    # Woken as a whole, the pod's keeper (which kills the worker at once, its deadline long past)
    # and the worker race, so whether the worker writes at all is not definite. Woken first,
    # alone, with an item in flight, a worker that cannot check its term's deadline (an app
    # paused between its check and its write) definitely writes that item's done row: the
    # case only the fence covers, so the fence must refuse it.
    members = sidecars(3, gated=True, extra={"LEDGER_ITEM_SECONDS": "0.5", "LEDGER_DEADLINE_CHECK": "off"})
    leader, old = await pause_leader_past_its_lease(members, pg_dsn, group, wake_app_first=True)
    report = await check_ledger(pg_dsn, group)
    newer = report.terms[-1][0]
    assert newer > old["token"], report.terms
    assert f"fenced out: group {old['fenceKey']}: token {old['token']} is stale (the fence has seen {newer})" \
        in leader.log(), leader.log()[-4000:]
    assert not report.stale_accepted, report.summary()
    # The refused row is the done row of the item in flight: that item stays open, the only one.
    assert [o.token for o in report.lost_at_handover] == [old["token"]], report.summary()


async def test_sigterm_drains_then_hands_over_without_losing_work(
    sidecars: Factory, group: str, pg_dsn: str
) -> None:
    members = sidecars(3, gated=True, extra={"SINGLETON_DRAIN_TIMEOUT": "10"})
    for _ in range(2):
        alive = [s for s in members if s.alive()]
        leader = await asyncio.to_thread(one_leader, alive)
        # Its worker acts before the drain (a fixed pause ran out on a loaded machine: the
        # worker's Python had not started, and the ledger had nothing to judge).
        await rows_written(pg_dsn, leader.env["SINGLETON_IDENTITY"], at_least=3)
        leader.signal(signal.SIGTERM)
        started = time.monotonic()
        await asyncio.to_thread(one_leader, [s for s in alive if s is not leader], 5)
        handover = time.monotonic() - started
        assert handover < 1.0, handover
        assert await asyncio.to_thread(leader.wait_exit, 10) == 0
    await asyncio.sleep(0.3)
    report = await check_ledger(pg_dsn, group)
    assert not report.overlaps, report.overlaps
    assert not report.regressions
    # A drain waits for the app to exit before it releases: no two apps ever acted at once.
    assert report.acts_checked and not report.acting_overlaps, report.summary()
    # The last leader is still working; every earlier term finished all its items.
    assert not [item for item in report.lost_items if f"token {report.terms[-1][0]} " not in item]


async def rows_written(dsn: str, identity: str, *, at_least: int, timeout: float = 20.0) -> None:
    """Until the ledger worker of ``identity`` has written ``at_least`` rows (its Python starts
    in a second or more on a loaded machine; the table is made by the first worker)."""
    deadline = time.monotonic() + timeout
    written: object = 0
    while time.monotonic() < deadline:
        try:
            written = await fetchval(dsn, "SELECT count(*) FROM ledger WHERE identity = $1", identity)
        except asyncpg.UndefinedTableError:
            written = 0
        if isinstance(written, int) and written >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{identity}'s worker wrote {written} rows in {timeout} s, not {at_least}")


async def test_postgres_restart_never_gives_two_leaders(
    sidecars: Factory, group: str, pg_dsn: str, postgres_server: PostgresServer | None
) -> None:
    if postgres_server is None:
        pytest.skip("needs the test session's own PostgreSQL server")
    members = sidecars(3, gated=True)
    leader = await asyncio.to_thread(one_leader, members)
    await rows_written(pg_dsn, leader.env["SINGLETON_IDENTITY"], at_least=1)  # its worker has started
    postgres_server.restart()  # main thread: servers die with the thread that started them
    await asyncio.to_thread(one_leader, members, 15)
    await asyncio.sleep(0.5)
    report = await check_ledger(pg_dsn, group)
    assert not report.overlaps, report.overlaps
    assert not report.regressions
    assert report.acts_checked and not report.acting_overlaps, report.summary()
    assert len(leaders(members)) == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "SINGLETON_GROUP (--group): required"),
        ({"SINGLETON_GROUP": "Bad_Name"}, "SINGLETON_GROUP (--group): must be a DNS-1123 label"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_BACKEND": "redis"}, "SINGLETON_BACKEND (--backend): must be one of"),
        ({"SINGLETON_GROUP": "g"}, "SINGLETON_POSTGRES_DSN (--postgres-dsn): required with backend postgres"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_LOCK_KEY": ""},
         "SINGLETON_LOCK_KEY (--lock-key): required with backend postgres outside Kubernetes"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "mysql://x"}, "must be a postgres:// or postgresql://"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_BACKEND": "lease"}, "SINGLETON_NAMESPACE (--namespace): required"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_LEASE_DURATION": "abc"},
         "SINGLETON_LEASE_DURATION (--lease-duration): must be a number of seconds"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_RETRY_PERIOD": "-1"},
         "SINGLETON_RETRY_PERIOD (--retry-period): must be a positive number"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_LEASE_DURATION": "4",
          "SINGLETON_RENEW_DEADLINE": "4"}, "SINGLETON_RENEW_DEADLINE (--renew-deadline) = 4s: must be shorter than "
         "SINGLETON_LEASE_DURATION (--lease-duration) = 4s"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_LISTEN": "8080"},
         "SINGLETON_LISTEN (--listen): must be host:port"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d",
          "SINGLETON_CONTROL_LISTEN": "0.0.0.0:9"}, "control actions must listen on loopback only"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_KILL_GRACE": "5"},
         "SINGLETON_KILL_GRACE (--kill-grace): must be shorter than lease_duration - renew_deadline"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN_FILE": "/nonexistent/dsn"},
         "SINGLETON_POSTGRES_DSN_FILE (--postgres-dsn-file): cannot read"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_IDENTITY": "a b"},
         "SINGLETON_IDENTITY (--identity): identity must be"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_LOG_LEVEL": "loud"},
         "SINGLETON_LOG_LEVEL (--log-level): must be debug, info, warning or error"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d",
          "SINGLETON_DRAIN_WAIT_CONTAINER": "app"}, "SINGLETON_DRAIN_WAIT_CONTAINER (--drain-wait-container): needs"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_NATIVE_SIDECAR": "true"},
         "SINGLETON_NATIVE_SIDECAR (--native-sidecar): needs SINGLETON_DRAIN_WAIT_CONTAINER"),
        ({"SINGLETON_GROUP": "g", "SINGLETON_POSTGRES_DSN": "postgres://h/d", "SINGLETON_NATIVE_SIDECAR": "maybe"},
         "SINGLETON_NATIVE_SIDECAR (--native-sidecar): must be"),
    ],
    ids=lambda v: "-".join(f"{k}" for k in v) if isinstance(v, dict) else None,
)
def test_bad_settings_exit_2_with_one_precise_line(env: dict[str, str], expected: str) -> None:
    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SINGLETON_")}
    if "SINGLETON_POSTGRES_DSN" in env and "SINGLETON_NAMESPACE" not in env:
        clean["SINGLETON_LOCK_KEY"] = "local/g"  # so the setting under test is the first one wrong
    result = subprocess.run([sys.executable, "-m", "singleton_sidecar.cli", "run"], env={**clean, **env},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def _cli_env(group: str, dsn: str) -> dict[str, str]:
    """The environment of a `singleton-sidecar run` outside Kubernetes on free loopback ports,
    with none of this process's SINGLETON_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SINGLETON_")}
    return {**clean, "SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_LOCK_KEY": f"local/{group}",
            "SINGLETON_POSTGRES_DSN": dsn, "SINGLETON_LISTEN": f"127.0.0.1:{free_port()}",
            "SINGLETON_CONTROL_LISTEN": f"127.0.0.1:{free_port()}"}


def _is_log_record(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and {"time", "level", "logger", "msg"} <= record.keys()


@pytest.mark.postgres
@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
def test_a_transaction_pooler_exits_2_with_one_line_saying_what_to_change(
    pg_info: PostgresInfo | None, group: str, pool_mode: PoolMode
) -> None:
    """The pooler check refuses the DSN before any lock is taken; the CLI reports it as a
    setting to change (status 2, one line), not as an outage to retry or a crash."""
    if pg_info is None:
        pytest.skip("PgBouncer needs the session's own server")
    with PgBouncer(pg_info, pool_mode=pool_mode) as bouncer:
        result = subprocess.run([sys.executable, "-m", "singleton_sidecar.cli", "run"],
                                env=_cli_env(group, bouncer.dsn), capture_output=True, text=True, timeout=30,
                                check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # The sidecar's own log (JSON records) goes to stderr too, as in a container; besides it,
    # exactly one line: the error.
    lines = [line for line in result.stderr.splitlines() if line.strip() and not _is_log_record(line)]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("singleton-sidecar: error: "), line
    assert "through a connection pooler in transaction or statement pooling mode" in line, line
    assert "connect directly to PostgreSQL or use session pooling" in line, line
    assert APP_PASSWORD not in result.stderr + result.stdout, "the DSN's password was printed"


@pytest.mark.postgres
def test_a_session_pooler_is_accepted_and_the_sidecar_leads(
    pg_info: PostgresInfo | None, group: str, tmp_path: Path
) -> None:
    if pg_info is None:
        pytest.skip("PgBouncer needs the session's own server")
    with PgBouncer(pg_info, pool_mode="session") as bouncer:
        sidecar = SidecarProcess("pooled", {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres",
                                            "SINGLETON_POSTGRES_DSN": bouncer.dsn, **FAST_TIMINGS},
                                 tmp_path / "pooled.log").start()
        try:
            leader = one_leader([sidecar], timeout=15)
            doc = leader.leader_doc()
            assert doc is not None and doc["isLeader"] is True and doc["role"] == "leader", doc
            assert isinstance(doc["token"], int) and doc["token"] > 0, doc
            assert sidecar.alive(), sidecar.log()
        finally:
            sidecar.stop()
        assert sidecar.wait_exit(0) == 0, sidecar.log()  # drained and released through the pooler


def test_file_gate_runs_the_app_only_on_the_leader(sidecars: Factory, tmp_path: Path) -> None:
    """gate.sh (POSIX sh, as in a main container with only /bin/sh) follows the flag."""
    dirs = [tmp_path / f"gate{i}" for i in range(2)]
    members = [sidecars(1, extra={"SINGLETON_GATE_DIR": str(d)})[0] for d in dirs]
    wait_for(lambda: all((d / "gate.sh").exists() for d in dirs), 10, "gate.sh to be installed")
    apps = []
    for d in dirs:
        out = d / "out"
        app = subprocess.Popen(["/bin/sh", str(d / "gate.sh"), "/bin/sh", "-c",
                                f'while :; do echo "$SINGLETON_TOKEN" >> {out}; sleep 0.05; done'],
                               start_new_session=True)
        apps.append(app)
    try:
        leader = one_leader(members)
        index = members.index(leader)
        wait_for((dirs[index] / "out").exists, 5, "the leader's app to run")
        time.sleep(0.5)
        assert not (dirs[1 - index] / "out").exists(), "the standby's app ran"
        doc = leader.leader_doc()
        assert doc is not None
        assert (dirs[index] / "out").read_text().split()[0] == str(doc["token"])
        # Drain the leader: its app stops, the other's starts.
        leader.signal(signal.SIGTERM)
        wait_for((dirs[1 - index] / "out").exists, 5, "the new leader's app to run")
        size = (dirs[index] / "out").stat().st_size
        time.sleep(0.5)
        assert (dirs[index] / "out").stat().st_size == size, "the old leader's app kept running"
    finally:
        for app in apps:
            stop_gate_script(app)


async def test_same_named_groups_in_two_namespaces_share_a_database_without_meeting(
    sidecars: Factory, group: str, pg_dsn: str
) -> None:
    """The lock and fence keys are ``<namespace>/<group>``: each namespace's group has its
    own leader, and neither's fenced writes refuse the other's (tokens come from one sequence)."""
    first = sidecars(2, gated=True, extra={"SINGLETON_NAMESPACE": "team-a"})
    second = sidecars(2, gated=True, extra={"SINGLETON_NAMESPACE": "team-b"})
    leader_a = await asyncio.to_thread(one_leader, first)
    leader_b = await asyncio.to_thread(one_leader, second)
    doc_a, doc_b = leader_a.leader_doc(), leader_b.leader_doc()
    assert doc_a is not None and doc_b is not None
    assert (doc_a["group"], doc_a["fenceKey"]) == (group, f"team-a/{group}")
    assert (doc_b["group"], doc_b["fenceKey"]) == (group, f"team-b/{group}")
    keys = await admin(pg_dsn, "SELECT array_agg(group_name ORDER BY group_name) FROM singleton_leases "
                               "WHERE group_name LIKE $1", f"%/{group}")
    assert keys == [f"team-a/{group}", f"team-b/{group}"]
    # Both gated ledger workers write, each fenced on its own key, and neither is fenced out.
    for leader in (leader_a, leader_b):
        await rows_written(pg_dsn, leader.env["SINGLETON_IDENTITY"], at_least=6)
        assert "fenced out" not in leader.log()
    fences = await admin(pg_dsn, "SELECT array_agg(token ORDER BY group_name) FROM singleton_fence "
                                 "WHERE group_name LIKE $1", f"%/{group}")
    assert fences == [doc_a["token"], doc_b["token"]]


def test_a_replica_on_a_vm_and_one_in_a_pod_share_one_lock(sidecars: Factory, group: str) -> None:
    """Was: the pod's sidecar keyed its lock <namespace>/<group>, the VM's the bare group: both led."""
    in_pod = sidecars(1, extra={"SINGLETON_NAMESPACE": "team-a"})[0]
    on_vm = sidecars(1, extra={"SINGLETON_LOCK_KEY": f"team-a/{group}"})[0]
    leader = one_leader([in_pod, on_vm])
    time.sleep(1.0)
    assert leaders([in_pod, on_vm]) == [leader], "both replicas lead"
    other = on_vm if leader is in_pod else in_pod
    leader.signal(signal.SIGKILL)
    assert one_leader([other], 10) is other


def test_after_a_stalled_holder_is_replaced_a_step_down_hands_over_to_a_standby(sidecars: Factory) -> None:
    """A leader frozen past its lease is replaced (a standby ends its session); once it wakes,
    the new leader steps down: a standby (the woken one or the third) takes the free lock at
    once, not the stepped-down leader after its pause (seen in a fault campaign: the lock stayed
    held across the release)."""
    members = sidecars(3)
    for round_ in range(4):
        leader = one_leader(members)
        leader.signal(signal.SIGSTOP)
        try:
            new = one_leader([s for s in members if s is not leader], timeout=10)
        finally:
            leader.signal(signal.SIGCONT)
        wait_for(lambda woken=leader: (doc := woken.leader_doc()) is not None and doc["role"] == "standby", 5,
                 "the woken leader to stand by")
        time.sleep(0.3)
        status, body = new.control("POST", "/step-down")
        assert status in (200, 202), body
        after = one_leader(members, timeout=10)
        assert after is not new, (f"round {round_}: {new.name} stepped down and took the lock back: no standby "
                                  "took it\n" + "\n".join(f"--- {s.name}\n{s.log()[-3000:]}" for s in members))
