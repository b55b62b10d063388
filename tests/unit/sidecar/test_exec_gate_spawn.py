"""The exec gate while a keeper is being spawned (issue 31, item 4), with the real keeper and a
real app: the keeper already runs the app before the spawn's await returns, so a stop said in
that window must reach it and ``stop()`` must wait for it; otherwise the lock is released while
the app runs on to the old deadline. Each spawn is held open (after the real one started the
keeper) for as long as the test needs, which makes the window wide but changes nothing else.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.gates import exec_gate as gate_module
from singleton_sidecar.gates.exec_gate import ExecGate
from singleton_testbed.procs import process_alive

ME = Identity("pod/uid/n")
# The app: appends "<pid> <deadline file>" to its output, then sleeps; with "once", only its
# first run exits at once (an app that exits and is restarted).
APP = ('echo "$$ $SINGLETON_DEADLINE_FILE" >> "$1"; '
       'if [ "$2" = once ] && [ ! -e "$1.ran" ]; then touch "$1.ran"; exit 0; fi; exec sleep 60')


def status(role: Role, token: int | None = None) -> ElectionStatus:
    term = Term(identity=ME, token=Token(token)) if token is not None else None
    return ElectionStatus(group="g", identity=ME, role=role, term=term, leader=ME if term else None,
                          leader_token=term.token if term else None, leader_since=None, transitions=0,
                          reason="test")


class HeldSpawns:
    """Wraps the real ``asyncio.create_subprocess_exec``: the spawns numbered in ``hold`` return
    only once ``release()`` is called, their keeper (and app) already running."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: set[int],
                 fail: BaseException | None = None) -> None:
        self.count = 0
        self.holding = asyncio.Event()
        self._go = asyncio.Event()
        real = asyncio.create_subprocess_exec

        async def spawn(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
            if fail is not None:
                raise fail
            proc = await real(*args, **kwargs)
            self.count += 1
            if self.count in hold:
                self.holding.set()
                await self._go.wait()
            return proc

        monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)

    def release(self) -> None:
        self._go.set()


@pytest.fixture(autouse=True)
def no_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep kills every child of this process: here, the session's servers too. The test
    # process is no subreaper, so there is nothing of the app's for it to find anyway.
    monkeypatch.setattr(gate_module, "sweep_orphans", lambda **_: 0)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "app"


def runs(out: Path) -> list[tuple[int, str]]:
    if not out.exists():
        return []
    return [(int(pid), path) for pid, _, path in (line.partition(" ") for line in out.read_text().splitlines())]


def lead(gate: ExecGate) -> None:
    """A term begins, a minute long: what the elector tells a gate."""
    gate.on_status(status(Role.LEADER, 1))
    gate.on_deadline(time.monotonic() + 60)


def end_term(gate: ExecGate) -> None:
    """The term ends: what the elector's ``_finish`` tells a gate before it stops the app."""
    gate.on_status(status(Role.STANDBY))
    gate.on_deadline(0.0)


async def wait_for(what: Callable[[], bool], timeout: float = 10.0, failure: str = "timed out") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.02)


@pytest.fixture
async def started(out: Path) -> AsyncIterator[Callable[[str], ExecGate]]:
    gates: list[tuple[ExecGate, asyncio.Task[None]]] = []

    def start(mode: str = "") -> ExecGate:
        gate = ExecGate(("sh", "-c", APP, "app", str(out), mode), kill_grace=1.0, env={})
        gates.append((gate, asyncio.create_task(gate.run())))
        return gate

    yield start
    for _, runner in gates:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    for pid, _ in runs(out):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def test_a_stop_while_the_keeper_is_spawned_waits_until_the_app_is_gone(
        monkeypatch: pytest.MonkeyPatch, out: Path, started: Callable[[str], ExecGate]) -> None:
    spawns = HeldSpawns(monkeypatch, hold={1})
    gate = started("")
    lead(gate)
    await spawns.holding.wait()
    await wait_for(lambda: len(runs(out)) == 1)  # the app runs; the keeper's pipe is not ours yet
    [(pid, _)] = runs(out)
    end_term(gate)
    stopping = asyncio.create_task(gate.stop())
    await asyncio.sleep(0.2)
    spawns.release()
    await asyncio.wait_for(stopping, 10)
    assert not process_alive(pid), "stop() reported the app stopped while it still runs"


async def test_a_stop_while_an_exited_app_is_restarted_waits_until_it_is_gone(
        monkeypatch: pytest.MonkeyPatch, out: Path, started: Callable[[str], ExecGate]) -> None:
    spawns = HeldSpawns(monkeypatch, hold={2})  # the first run exits at once; its restart is held
    gate = started("once")
    lead(gate)
    await spawns.holding.wait()
    await wait_for(lambda: len(runs(out)) == 2)
    pid, _ = runs(out)[1]
    end_term(gate)
    stopping = asyncio.create_task(gate.stop(urgent=True))
    await asyncio.sleep(0.2)
    spawns.release()
    await asyncio.wait_for(stopping, 10)
    assert not process_alive(pid), "stop() reported the restarted app stopped while it still runs"
    await asyncio.sleep(0.3)
    assert len(runs(out)) == 2, "started again after the term ended"


async def test_a_renewal_while_the_keeper_is_spawned_reaches_it(
        monkeypatch: pytest.MonkeyPatch, out: Path, started: Callable[[str], ExecGate]) -> None:
    spawns = HeldSpawns(monkeypatch, hold={1})
    gate = started("")
    lead(gate)
    await spawns.holding.wait()
    await wait_for(lambda: len(runs(out)) == 1)
    [(_, deadline_file)] = runs(out)
    renewed = time.monotonic() + 61
    gate.on_deadline(renewed)
    spawns.release()
    await wait_for(lambda: abs(float(Path(deadline_file).read_text()) - renewed) < 1e-3, timeout=5,
                   failure="the keeper kept the deadline it was started with; the renewal was lost")
    gate.on_status(status(Role.STANDBY))
    await asyncio.wait_for(gate.stop(urgent=True), 10)


async def test_a_failed_spawn_leaves_nothing_to_wait_for(
        monkeypatch: pytest.MonkeyPatch, started: Callable[[str], ExecGate]) -> None:
    HeldSpawns(monkeypatch, hold=set(), fail=OSError(errno.EMFILE, "too many open files"))
    gate = started("")
    lead(gate)
    await asyncio.sleep(0.1)
    await asyncio.wait_for(gate.stop(), 2)  # not waiting for a keeper that was never started
