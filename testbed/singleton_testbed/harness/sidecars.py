"""Run real sidecar processes for tests and benchmarks, and talk to them over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from singleton_testbed.ledger import check_ledger
from singleton_testbed.procs import free_port

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
"""The ``Accept`` header of Prometheus's scrapes (2.x; 3.x sends the same types, weighted alike)."""
FAST_TIMINGS = {"SINGLETON_LEASE_DURATION": "2", "SINGLETON_RENEW_DEADLINE": "1.5", "SINGLETON_RETRY_PERIOD": "0.5"}


@dataclass
class SidecarProcess:
    name: str
    env: dict[str, str]
    log_path: Path
    command: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    control_port: int = field(default_factory=free_port)
    log_format: str = "text"
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    """``time.monotonic()`` when the process was started."""
    nice: int = 0
    """The process's niceness (below 0 needs root): a test whose point is a sidecar that runs
    gives it the CPU first, so the suite's other work beside it does not stall it."""

    def start(self) -> SidecarProcess:
        env = {**os.environ, **self.env, "SINGLETON_LISTEN": f"127.0.0.1:{self.port}",
               "SINGLETON_CONTROL_LISTEN": f"127.0.0.1:{self.control_port}", "SINGLETON_LOG_FORMAT": self.log_format}
        if "SINGLETON_NAMESPACE" not in env and "SINGLETON_GROUP" in env:
            # Outside Kubernetes the PostgreSQL lock key is given, as on a VM.
            env.setdefault("SINGLETON_LOCK_KEY", f"local/{env['SINGLETON_GROUP']}")
        argv = [sys.executable, "-m", "singleton_sidecar.cli", "run"]
        if self.nice:
            argv = ["nice", "-n", str(self.nice), *argv]  # nice execs: popen.pid is the sidecar's
        if self.command:
            argv += ["--", *self.command]
        with open(self.log_path, "ab") as out:
            self.started_at = time.monotonic()
            # Its own process group, so SIGSTOP/SIGKILL reach the gated child too, as in a pod.
            self.popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 1.0) -> tuple[int, str]:
        return self.probe("GET", path, timeout)

    def probe(self, method: str, path: str, timeout: float = 1.0) -> tuple[int, str]:
        """A request to the probe port (``SINGLETON_LISTEN``): (status, body)."""
        request = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def scrape(self, accept: str = PROMETHEUS_ACCEPT, timeout: float = 1.0) -> tuple[str, str]:
        """``GET /metrics`` as a scraper that sends ``accept``: (content type, body)."""
        request = urllib.request.Request(self.url + "/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.headers["Content-Type"], resp.read().decode()

    def leader_doc(self, timeout: float = 1.0) -> dict[str, Any] | None:
        try:
            status, body = self.get("/leader", timeout)
        except (urllib.error.URLError, OSError):
            return None
        return json.loads(body) if status == 200 else None

    def ready(self) -> bool:
        try:
            return self.get("/readyz", 0.5)[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def control(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.control_port}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def signal(self, signum: int) -> None:
        """Signal the whole "pod": the sidecar's process group and the groups of everything it
        started (the exec gate's app runs in a group of its own), as a cgroup freeze or kill would."""
        assert self.popen is not None
        for pgid in [self.popen.pid, *process_groups_below(self.popen.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signum)

    def signal_app_only(self, signum: int) -> None:
        """Signal what the sidecar started in process groups of its own (the exec gate's app),
        not the sidecar's group (the sidecar and its keeper)."""
        assert self.popen is not None
        for pgid in process_groups_below(self.popen.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signum)

    def app_running(self) -> bool:
        """Whether a process of those groups is still alive (a zombie is not: it has exited)."""
        assert self.popen is not None
        groups = set(process_groups_below(self.popen.pid))
        return any(pgid in groups and state != "Z" for state, _, pgid in _processes().values())

    def signal_sidecar_only(self, signum: int) -> None:
        """Signal the sidecar process alone (a GC pause, CPU starvation): its app and keeper run on."""
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signum)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_exit(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _processes() -> dict[int, tuple[str, int, int]]:
    """Every process: pid -> (state, parent pid, process group)."""
    table: dict[int, tuple[str, int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def process_groups_below(root: int) -> list[int]:
    """The process groups of ``root``'s descendants other than its own, parents first."""
    parents = {pid: (ppid, pgid) for pid, (_, ppid, pgid) in _processes().items()}
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop(0)
        for pid, (ppid, pgid) in parents.items():
            if ppid == parent:
                frontier.append(pid)
                if pgid != root and pgid not in found:
                    found.append(pgid)
    return found


def stop_gate_script(script: subprocess.Popen[bytes]) -> None:
    """Stop a ``gate.sh`` the way its container would be stopped: SIGTERM (it stops the app it
    runs, in a process group of its own, and exits), then SIGKILL to whatever is left of its
    group and of the groups below it, so a test never leaves an app running."""
    groups = {script.pid, *process_groups_below(script.pid)}
    if script.poll() is None:
        script.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            script.wait(10)
        groups.update(process_groups_below(script.pid))  # started meanwhile, if it did not exit
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    script.wait()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


S = TypeVar("S", bound="SidecarProcess")


def leaders(sidecars: Sequence[S]) -> list[S]:
    result = []
    for sidecar in sidecars:
        doc = sidecar.leader_doc() if sidecar.alive() else None
        if doc is not None and doc["isLeader"]:
            result.append(sidecar)
    return result


def one_leader(sidecars: Sequence[S], timeout: float = 10.0) -> S:
    def check() -> S | None:
        found = leaders(sidecars)
        return found[0] if len(found) == 1 and found[0].ready() else None

    leader: S = wait_for(check, timeout, "exactly one ready leader")
    return leader


def wait_serving(sidecars: Sequence[SidecarProcess], timeout: float = 10.0) -> None:
    """Wait until every sidecar answers on its probe port."""
    for sidecar in sidecars:
        def serving(s: SidecarProcess = sidecar) -> bool:
            assert s.alive(), f"{s.name} exited (code {s.popen and s.popen.returncode}) before serving"
            return s.leader_doc() is not None

        try:
            wait_for(serving, timeout, f"{sidecar.name} to serve")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- its log ---\n{sidecar.log()[-3000:]}") from None


async def last_row(dsn: str, group: str) -> tuple[int, str] | None:
    """(token, phase) of the group's last ledger row, or None before the first."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow("SELECT token, phase FROM ledger WHERE group_name = $1 ORDER BY id DESC LIMIT 1",
                                  group)
    except asyncpg.UndefinedTableError:
        row = None  # no worker has started yet
    finally:
        await conn.close()
    return None if row is None else (int(row["token"]), str(row["phase"]))


async def wait_last_row(dsn: str, group: str, token: int, phase: str | None = None, timeout: float = 10.0) -> None:
    """Until the group's last ledger row is one of ``token`` (and of ``phase``, if given)."""
    deadline = time.monotonic() + timeout
    while (row := await last_row(dsn, group)) is None or row[0] != token or phase not in (None, row[1]):
        assert time.monotonic() < deadline, f"no {phase or 'row'} of token {token} last in the ledger (last: {row})"
        await asyncio.sleep(0.01)


async def pause_leader_past_its_lease(members: Sequence[S], pg_dsn: str, group: str, *,
                                      wake_app_first: bool = False) -> tuple[S, dict[str, Any]]:
    """SIGSTOP the leader's whole "pod" (sidecar and gated worker) until another leads,
    SIGCONT it, and check it says at once that it no longer leads and that the ledger shows
    no overlap. Returns the old leader and its last /leader document.

    With ``wake_app_first`` the pause is made definite for the fence: the pod is stopped while
    its worker has an item in flight (its start row written, not its done row: give it items
    long enough to catch, ``LEDGER_ITEM_SECONDS``), and once the new leader has written, the
    worker alone is woken, its sidecar and keeper still stopped. It stands for a process paused
    between checking its term and writing, which nothing but the fence can stop: it must stop
    on its own (its next write refused) before the rest of the pod is woken."""
    leader = await asyncio.to_thread(one_leader, members)
    old = leader.leader_doc()
    assert old is not None
    if wake_app_first:
        await wait_last_row(pg_dsn, group, old["token"], "start")
    else:
        await asyncio.sleep(0.5)  # let the gated worker write
    leader.signal(signal.SIGSTOP)
    if wake_app_first:
        assert await last_row(pg_dsn, group) == (old["token"], "start"), \
            "the worker finished its item before the pod was stopped: give it longer items"
    new = await asyncio.to_thread(one_leader, [s for s in members if s is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None and new_doc["token"] > old["token"]
    if wake_app_first:
        await wait_last_row(pg_dsn, group, new_doc["token"])  # the fence has seen the new token
        leader.signal_app_only(signal.SIGCONT)
        await asyncio.to_thread(wait_for, lambda: not leader.app_running(), 10,
                                "the woken worker to stop on its own (its write refused by the fence)")
    else:
        await asyncio.sleep(0.5)
    leader.signal(signal.SIGCONT)
    # On waking, the old leader knows its deadline passed: it says so before anything else.
    doc = await asyncio.to_thread(wait_for, leader.leader_doc, 3, "the old leader to answer")
    assert doc["isLeader"] is False
    # The new leader's app writes once it has started (keeper, interpreter, connection): wait for it.
    deadline = time.monotonic() + 10
    report = await check_ledger(pg_dsn, group)
    while len(report.terms) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        report = await check_ledger(pg_dsn, group)
    assert len(report.terms) >= 2, report.summary()
    assert not report.overlaps, report.overlaps
    assert not report.regressions
    # Acting overlaps are not asserted away: whether the woken app acts before it is stopped is
    # up to the gate (a refused write counts). That they were judged at all is asserted.
    assert report.acts_checked, report.summary()
    return leader, old
