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

from singleton_testbed.ledger import check_ledger
from singleton_testbed.procs import free_port

FAST_TIMINGS = {"SINGLETON_LEASE_DURATION": "2", "SINGLETON_RENEW_DEADLINE": "1.5", "SINGLETON_RETRY_PERIOD": "0.5"}


@dataclass
class SidecarProcess:
    name: str
    env: dict[str, str]
    log_path: Path
    command: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    control_port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> SidecarProcess:
        env = {**os.environ, **self.env, "SINGLETON_LISTEN": f"127.0.0.1:{self.port}",
               "SINGLETON_CONTROL_LISTEN": f"127.0.0.1:{self.control_port}", "SINGLETON_LOG_FORMAT": "text"}
        if "SINGLETON_NAMESPACE" not in env and "SINGLETON_GROUP" in env:
            # Outside Kubernetes the PostgreSQL lock key is given, as on a VM.
            env.setdefault("SINGLETON_LOCK_KEY", f"local/{env['SINGLETON_GROUP']}")
        argv = [sys.executable, "-m", "singleton_sidecar.cli", "run"]
        if self.command:
            argv += ["--", *self.command]
        with open(self.log_path, "ab") as out:
            # Its own process group, so SIGSTOP/SIGKILL reach the gated child too, as in a pod.
            self.popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 1.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

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


def process_groups_below(root: int) -> list[int]:
    """The process groups of ``root``'s descendants other than its own, parents first."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = (int(fields[1]), int(fields[2]))
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
        wait_for(lambda s=sidecar: s.leader_doc() is not None, timeout, f"{sidecar.name} to serve")


async def pause_leader_past_its_lease(members: Sequence[S], pg_dsn: str, group: str) -> tuple[S, dict[str, Any]]:
    """SIGSTOP the leader's whole "pod" (sidecar and gated worker) until another leads,
    SIGCONT it, and check it says at once that it no longer leads and that the ledger shows
    no overlap. Returns the old leader and its last /leader document."""
    leader = await asyncio.to_thread(one_leader, members)
    old = leader.leader_doc()
    assert old is not None
    await asyncio.sleep(0.5)  # let the gated worker write
    leader.signal(signal.SIGSTOP)
    new = await asyncio.to_thread(one_leader, [s for s in members if s is not leader], 10)
    new_doc = new.leader_doc()
    assert new_doc is not None and new_doc["token"] > old["token"]
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
    return leader, old
