"""Stop before release, judged by what the apps *do*: every gated app records each moment it
acts in a file (``tests/data/acting_app.py``), and no two tokens may ever act at once, on any
path that ends a term. Real sidecars, real PostgreSQL, real processes; no fence involved.

Each test fails on the code before this contract (release in the same instant as the new
role was published; SIGTERM to the direct child only; no deadline of the gate's own).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singleton_testbed.harness.sidecars import SidecarProcess, leaders, one_leader, stop_gate_script, wait_for
from tests.support.acting import APP, FINISH, TIMINGS, Factory, assert_never_two_actors, group_gone, has_acted, spans
from tests.support.pgquery import fetchval

pytestmark = pytest.mark.postgres


def test_step_down_with_a_slow_app_hands_over_only_once_it_stopped(gated: Factory, acting_log: Path) -> None:
    """Was: 0.77 s of two apps acting at once on every planned handover."""
    members = gated(3)
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    time.sleep(0.3)
    started = time.monotonic()
    status, _ = leader.control("POST", "/step-down?reason=test")
    assert status == 202
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    gaps = assert_never_two_actors(acting_log, terms=2)
    # Nobody acts while the old app finishes (its 0.8 s); the handover itself adds milliseconds.
    new_first = spans(acting_log)[1].first
    assert FINISH < new_first - started < FINISH + 1.0, new_first - started
    assert gaps[0] < 0.5, gaps
    assert leader.leader_doc()["role"] == "standby"  # type: ignore[index]
    metrics = leader.get("/metrics")[1]
    assert 'singleton_app_stop_seconds_count{backend="postgres"' in metrics
    assert next(line for line in metrics.splitlines()
                if line.startswith("singleton_app_stop_seconds_count")).endswith(" 1.0")
    assert next(line for line in metrics.splitlines()
                if line.startswith("singleton_app_stop_unconfirmed_total")).endswith(" 0.0")


def test_a_drain_that_hits_its_timeout_kills_the_app_before_release(gated: Factory, acting_log: Path) -> None:
    members = gated(2, env={"SINGLETON_DRAIN_TIMEOUT": "0.3"}, app_env={"ACT_FINISH": "5"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    leader.signal_sidecar_only(signal.SIGTERM)
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    gaps = assert_never_two_actors(acting_log, terms=2)
    assert gaps[0] < 2.0, "killed at the drain timeout (plus the kill grace), not after its own 5 s"
    assert leader.wait_exit(10) == 0


def test_children_of_the_app_are_stopped_with_it(gated: Factory, acting_log: Path) -> None:
    """Was: SIGTERM and SIGKILL reached only the gate's direct child; its children acted on."""
    members = gated(2, app_env={"ACT_CHILDREN": "2"})
    leader = one_leader(members)
    wait_for(lambda: acting_log.exists() and [len(s.pids) for s in spans(acting_log)] == [3], 10,
             "the app and 2 children")
    old = spans(acting_log)[0]
    status, _ = leader.control("POST", "/step-down")
    assert status == 202
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    assert_never_two_actors(acting_log, terms=2)
    assert group_gone(old.pids), "a child of the old app survived"


def test_a_stalled_sidecar_cannot_keep_its_app_acting(gated: Factory, acting_log: Path) -> None:
    """SIGSTOP of the sidecar process alone: the keeper stops the app at the term's deadline,
    before the lease lets anyone else lead."""
    members = gated(2, app_env={"ACT_CHILDREN": "1"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    stalled_at = time.monotonic()
    leader.signal_sidecar_only(signal.SIGSTOP)
    try:
        wait_for(lambda: len(spans(acting_log)) >= 2, 15, "a standby to take over")
        old = spans(acting_log)[0]
        gaps = assert_never_two_actors(acting_log, terms=2)
        renew_deadline, lease = float(TIMINGS["SINGLETON_RENEW_DEADLINE"]), float(TIMINGS["SINGLETON_LEASE_DURATION"])
        # Stopped by its deadline (SIGTERM) and the app's finishing time, or the kill grace (SIGKILL).
        assert old.last - stalled_at < renew_deadline + FINISH + 0.2
        assert gaps[0] > 0 and old.last < stalled_at + lease
        assert group_gone(old.pids)
    finally:
        leader.signal_sidecar_only(signal.SIGCONT)


def test_a_killed_sidecar_takes_its_app_with_it(gated: Factory, acting_log: Path) -> None:
    members = gated(2, app_env={"ACT_CHILDREN": "1"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    time.sleep(0.2)
    killed_at = time.monotonic()
    leader.signal_sidecar_only(signal.SIGKILL)
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the standby's app to act")
    old = spans(acting_log)[0]
    assert_never_two_actors(acting_log, terms=2)
    assert old.last - killed_at < 0.2, "the keeper kills the group as soon as the sidecar is gone"
    wait_for(lambda: group_gone(old.pids), 2, "the old app's group to be gone")


def test_a_drain_hook_that_refuses_the_connection_still_waits_for_the_app(gated: Factory,
                                                                            acting_log: Path) -> None:
    """Was: a refused drain-hook URL (the app closed its listener on SIGTERM) released at once."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    members = gated(2, env={"SINGLETON_DRAIN_URL": f"http://127.0.0.1:{port}/drain"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    started = time.monotonic()
    leader.signal_sidecar_only(signal.SIGTERM)
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    assert_never_two_actors(acting_log, terms=2)
    assert spans(acting_log)[1].first - started > FINISH, "released before the app had finished"
    assert "drain hook" in leader.log() and "failed" in leader.log()


# --- the file gate -----------------------------------------------------------------------------------


def run_gate_script(gate_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    wait_for((gate_dir / "gate.sh").exists, 10, "gate.sh to be installed")
    return subprocess.Popen(["/bin/sh", str(gate_dir / "gate.sh"), sys.executable, APP],
                            env={**os.environ, **env}, start_new_session=True)


@pytest.fixture
def gate_scripts() -> Iterator[list[subprocess.Popen[bytes]]]:
    scripts: list[subprocess.Popen[bytes]] = []
    yield scripts
    for script in scripts:
        stop_gate_script(script)


@pytest.mark.parametrize("ignore_term", [False, True], ids=["slow app", "app ignoring SIGTERM"])
def test_file_gate_step_down_waits_for_gate_sh(gated: Factory, acting_log: Path, tmp_path: Path,
                                               gate_scripts: list[subprocess.Popen[bytes]], ignore_term: bool) -> None:
    app_env = {"ACT_LOG": str(acting_log), "ACT_FINISH": str(FINISH), "ACT_CHILDREN": "1",
               "ACT_IGNORE_TERM": "1" if ignore_term else "0"}
    members = gated(2, file_gate=True, env={"SINGLETON_DRAIN_TIMEOUT": "0.5", "SINGLETON_KILL_GRACE": "0.3"})
    gate_scripts.extend(run_gate_script(tmp_path / f"gate{i}", app_env) for i in range(2))
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    old_token = leader.leader_doc()["token"]  # type: ignore[index]
    time.sleep(0.3)
    status, _ = leader.control("POST", "/step-down")
    assert status == 202
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    gaps = assert_never_two_actors(acting_log, terms=2)
    old = next(s for s in spans(acting_log) if s.token == old_token)
    assert group_gone(old.pids)
    if ignore_term:
        # Drain timeout 0.5 s, then the kill grace written in the flag (0.3 s), not gate.sh's old 1 s default.
        assert gaps[0] < 0.5 + 0.3 + 0.5, gaps


def test_file_gate_keeps_the_leaders_app_running_across_renewals(
        gated: Factory, acting_log: Path, tmp_path: Path, gate_scripts: list[subprocess.Popen[bytes]]) -> None:
    """The lease/both default timings (9 / 7.5 / 6 s) leave 1.5 s between a renewal and the
    deadline. Was: the flag was refreshed on a timer, expired between refreshes, and gate.sh
    stopped and restarted the leader's app while its sidecar kept leading."""
    slow = {"SINGLETON_LEASE_DURATION": "9", "SINGLETON_RENEW_DEADLINE": "7.5", "SINGLETON_RETRY_PERIOD": "6"}
    members = gated(1, file_gate=True, env=slow)
    gate_scripts.append(run_gate_script(tmp_path / "gate0", {"ACT_LOG": str(acting_log)}))
    one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    time.sleep(20)  # three renewals
    acting = spans(acting_log)
    assert len(acting) == 1 and len(acting[0].pids) == 1, "the leader's app was restarted"
    lines = acting_log.read_text().splitlines()
    times = [float(line.split()[2]) for line in lines]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.5, "the app was stopped for a while"


def test_file_gate_hands_over_when_its_container_stops(
        gated: Factory, acting_log: Path, tmp_path: Path, gate_scripts: list[subprocess.Popen[bytes]]) -> None:
    """gate.sh's SIGTERM (its container stopping) makes the leader hand over rather than hold
    the lock with no app; it used to write ``draining.requested`` that nothing read."""
    members = gated(2, file_gate=True)
    gate_scripts.extend(run_gate_script(tmp_path / f"gate{i}", {"ACT_LOG": str(acting_log)}) for i in range(2))
    leader = one_leader(members)
    index = members.index(leader)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    os.kill(gate_scripts[index].pid, signal.SIGTERM)
    assert gate_scripts[index].wait(10) == 0
    new = wait_for(lambda: [m for m in leaders(members) if m is not leader], 10, "the other replica to lead")
    assert new[0].ready()
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the new leader's app to act")
    assert_never_two_actors(acting_log, terms=2)
    assert "the main container is stopping" in leader.log()


def test_a_lost_session_makes_the_next_leader_wait_for_the_old_app(gated: Factory, acting_log: Path,
                                                                    pg_admin_dsn: str) -> None:
    """pg_terminate_backend frees the lock at once while the old app is still finishing: the
    next leader holds the term without acting until the old holder's stop bound has passed."""
    members = gated(2, env={"SINGLETON_KILL_GRACE": "0.9"}, app_env={"ACT_FINISH": "0.8"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    pid = _holder_pid(leader, pg_admin_dsn)
    assert asyncio.run(fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", pid)) is True
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    assert_never_two_actors(acting_log, terms=2)


def _holder_pid(leader: SidecarProcess, pg_admin_dsn: str) -> int:
    key = leader.env.get("SINGLETON_LOCK_KEY") or f"local/{leader.env['SINGLETON_GROUP']}"
    pid = asyncio.run(fetchval(pg_admin_dsn, "SELECT holder_pid FROM singleton_leases WHERE group_name = $1", key))
    assert isinstance(pid, int)
    return pid


def test_a_stalled_sidecar_whose_session_ends_cannot_keep_its_app_acting(gated: Factory, acting_log: Path,
                                                                         pg_admin_dsn: str) -> None:
    """Issue 31, item 3. Was: the next leader acted after the 0.25 s stop bound while the old app,
    whose sidecar was stalled and never heard its session end, acted on to its keeper's deadline.
    Now the keeper freezes the app once the sidecar's heartbeat is late, and kills it once the
    woken sidecar says its lock is gone."""
    members = gated(2, app_env={"ACT_CHILDREN": "1"})
    leader = one_leader(members)
    wait_for(lambda: acting_log.exists() and [len(s.pids) for s in spans(acting_log)] == [2], 10,
             "the app and its child")
    holder = _holder_pid(leader, pg_admin_dsn)
    stalled_at = time.monotonic()
    leader.signal_sidecar_only(signal.SIGSTOP)
    try:
        assert asyncio.run(fetchval(pg_admin_dsn, "SELECT pg_terminate_backend($1)", holder)) is True
        wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the standby's app to act")
        time.sleep(0.5)
        assert_never_two_actors(acting_log, terms=2)
        old = spans(acting_log)[0]
        # Frozen within the stop bound (0.25 s) of the stall, so of any session end after it.
        assert old.last - stalled_at < 0.25, old.last - stalled_at
        assert not group_gone(old.pids), "frozen, not killed, while its sidecar cannot say why"
    finally:
        leader.signal_sidecar_only(signal.SIGCONT)
    wait_for(lambda: group_gone(old.pids), 5, "the old app to be killed once its sidecar hears its lock is gone")
    time.sleep(0.3)
    assert_never_two_actors(acting_log, terms=2)
    assert spans(acting_log)[0].last == old.last, "the old app acted again after its sidecar woke"


def test_file_gate_a_killed_sidecar_leaves_no_two_apps(
        gated: Factory, acting_log: Path, tmp_path: Path, gate_scripts: list[subprocess.Popen[bytes]]) -> None:
    """With the file gate the app outlives a SIGKILLed sidecar until the flag's deadline; the
    lock is freed at once, so the next leader waits out the old term's lease before acting."""
    members = gated(2, file_gate=True)
    gate_scripts.extend(run_gate_script(tmp_path / f"gate{i}", {"ACT_LOG": str(acting_log)}) for i in range(2))
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    leader.signal_sidecar_only(signal.SIGKILL)
    wait_for(lambda: len(spans(acting_log)) >= 2, 15, "the next leader's app to act")
    assert_never_two_actors(acting_log, terms=2)


def _keeper_of(sidecar: SidecarProcess) -> int:
    assert sidecar.popen is not None
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == sidecar.popen.pid and b"keeper.py" in cmdline:
                return int(entry.name)
    raise AssertionError("no keeper under the sidecar")


def test_a_keeper_killed_alone_leaves_no_orphan_acting(gated: Factory, acting_log: Path) -> None:
    """Was: the app died with its keeper but its children, orphaned, acted on, and the sidecar
    took the keeper's exit for "stopped" and later released beside them."""
    members = gated(2, app_env={"ACT_CHILDREN": "1"})
    leader = one_leader(members)
    wait_for(lambda: acting_log.exists() and [len(s.pids) for s in spans(acting_log)] == [2], 10,
             "the app and its child")
    first = spans(acting_log)[0]
    os.kill(_keeper_of(leader), signal.SIGKILL)
    wait_for(lambda: group_gone(first.pids), 5, "the orphaned child to be stopped")
    status, _ = leader.control("POST", "/step-down")
    assert status == 202
    wait_for(lambda: len(spans(acting_log)) >= 2, 10, "the next leader's app to act")
    assert_never_two_actors(acting_log, terms=2)


def test_a_sidecar_stalled_while_draining_cannot_stretch_the_drain(gated: Factory, acting_log: Path) -> None:
    """Was: once draining, the keeper waited for the app without the term's deadline, so a
    sidecar stalled mid-drain let its app act on after another replica took over."""
    members = gated(2, env={"SINGLETON_DRAIN_TIMEOUT": "60"}, app_env={"ACT_FINISH": "30"})
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    leader.signal_sidecar_only(signal.SIGTERM)
    wait_for(lambda: (leader.leader_doc() or {}).get("role") == "draining", 5, "the drain to begin")
    leader.signal_sidecar_only(signal.SIGSTOP)
    try:
        wait_for(lambda: len(spans(acting_log)) >= 2, 20, "a standby to take over")
        assert_never_two_actors(acting_log, terms=2)
    finally:
        leader.signal_sidecar_only(signal.SIGCONT)


def test_a_healthy_exec_gated_leader_is_never_frozen(gated: Factory, acting_log: Path) -> None:
    """The heartbeat costs a leader's app nothing while its sidecar runs: over 10 s of renewals
    its acts (every 10 ms) never pause for long enough to have been frozen. "Runs": the sidecar
    gets the CPU first (nice -10). Starved for more than about 0.15 s, as CI's full suite once
    did to it (a 205 ms gap between beats), it freezes its app by design (docs/concepts.md)."""
    members = gated(1, nice=-10)
    leader = one_leader(members)
    wait_for(lambda: has_acted(acting_log), 10, "the leader's app to act")
    time.sleep(10)
    acting = spans(acting_log)
    assert len(acting) == 1 and len(acting[0].pids) == 1, "the leader's app was restarted"
    times = [float(line.split()[2]) for line in acting_log.read_text().splitlines()]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.3, "the app was stopped for a while"
    assert "freezing" not in leader.log()
