"""The exec gate's heartbeat (issue 31, item 3), with the real keeper and an app that records
every act (``tests/data/acting_app.py``): the takeover after a lost PostgreSQL session waits
only the keeper's 0.25 s stop bound, so an app whose sidecar stalls (and cannot hear its
session end) must stop acting within that bound on the keeper's own. The keeper freezes the
app (SIGSTOP: the app, its children and a worker that left its group) once the sidecar's
``alive <t>`` is older than ``--heartbeat``, thaws it when a fresh one comes, and kills it at
once if the term ends while it is frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.app import KEEPER_SLACK
from singleton_sidecar.gates import exec_gate as gate_module
from singleton_sidecar.gates import keeper
from singleton_sidecar.gates.exec_gate import HEARTBEAT_INTERVAL, HEARTBEAT_STALL, HEARTBEAT_TIMEOUT, ExecGate
from singleton_testbed.procs import process_alive
from tests.support.acting import APP, spans

H = HEARTBEAT_TIMEOUT


def acts(log: Path) -> list[tuple[int, float]]:
    """(pid, time) of every act so far."""
    if not log.exists():
        return []
    return [(int(pid), float(at)) for _, pid, at in (line.split() for line in log.read_text().splitlines())]


def acts_between(log: Path, start: float, end: float) -> list[tuple[int, float]]:
    return [(pid, at) for pid, at in acts(log) if start <= at < end]


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def app_env(log: Path, **more: str) -> dict[str, str]:
    # The app, a child in its group, and a worker that left the group (setsid) while its parent lives.
    return {**os.environ, "SINGLETON_TOKEN": "1", "ACT_LOG": str(log), "ACT_CHILDREN": "1",
            "ACT_DETACH": "setsid", **more}


@dataclass
class Kept:
    proc: subprocess.Popen[bytes]
    control: int
    log: Path

    def tell(self, line: str) -> None:
        os.write(self.control, f"{line}\n".encode())

    def beat(self, seconds: float) -> float:
        """Be the sidecar for ``seconds``: a heartbeat every ``HEARTBEAT_INTERVAL``, each
        vouching for the one before, as the gate sends them (until the keeper is gone). Returns
        the last time vouched for."""
        end, previous = time.monotonic() + seconds, time.monotonic()
        while time.monotonic() < end:
            time.sleep(HEARTBEAT_INTERVAL)
            with contextlib.suppress(BrokenPipeError):
                self.tell(f"alive {previous!r}")
            previous = time.monotonic()
        return previous - HEARTBEAT_INTERVAL

    def pids(self) -> set[int]:
        """The pids of the app, its child and its worker once all three acted, beating meanwhile:
        on a loaded machine they may start after the first beats, and without a heartbeat the
        keeper would freeze them before they act."""
        deadline = time.monotonic() + 10
        while len({pid for pid, _ in acts(self.log)}) < 3:
            assert time.monotonic() < deadline, "the app, its child and its worker to act"
            self.beat(HEARTBEAT_INTERVAL)
        return {pid for pid, _ in acts(self.log)}


class Start(Protocol):
    def __call__(self, *, deadline_in: float = ..., kill_grace: float = ..., finish: float = ...) -> Kept: ...


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    started: list[Kept] = []

    def run(*, deadline_in: float = 30.0, kill_grace: float = 5.0, finish: float = 0.0) -> Kept:
        read_end, write_end = os.pipe()
        log = tmp_path / f"acts{len(started)}"
        proc = subprocess.Popen(
            [sys.executable, "-S", "-E", keeper.__file__, "--deadline", repr(time.monotonic() + deadline_in),
             "--kill-grace", repr(kill_grace), "--control-fd", str(read_end), "--heartbeat", repr(H),
             "--", sys.executable, APP],
            pass_fds=(read_end,), env=app_env(log, ACT_FINISH=str(finish)))
        os.close(read_end)
        kept = Kept(proc, write_end, log)
        started.append(kept)
        return kept

    yield run
    for kept in started:
        pids = {pid for pid, _ in acts(kept.log)}
        if kept.proc.poll() is None:
            kept.proc.kill()
            kept.proc.wait()
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        os.close(kept.control)


def test_the_timeout_stays_inside_the_stop_bound() -> None:
    # The heartbeat vouches for a time before any session end it did not report: the app is
    # frozen within H of that end, before a successor waits out the stop bound.
    assert HEARTBEAT_INTERVAL < HEARTBEAT_STALL < H < KEEPER_SLACK


def test_a_late_heartbeat_freezes_the_whole_app_and_a_fresh_one_thaws_it(start: Start) -> None:
    kept = start()
    kept.beat(0.3)
    pids = kept.pids()
    vouched = kept.beat(0.5)
    assert kept.proc.poll() is None
    time.sleep(0.6)  # the sidecar stalls
    frozen_from = vouched + H + 0.05
    assert not acts_between(kept.log, frozen_from, time.monotonic()), "acted with no heartbeat"
    assert {state(pid) for pid in pids} == {"T"}, "frozen, not killed: the sidecar may only be slow"
    thawed = time.monotonic()
    kept.beat(0.5)
    assert {pid for pid, _ in acts_between(kept.log, thawed, time.monotonic())} == pids, "not thawed"
    assert kept.proc.poll() is None


def test_a_stale_heartbeat_does_not_thaw(start: Start) -> None:
    """A heartbeat vouches for a time: one from before the stall says nothing of it."""
    kept = start()
    kept.beat(0.3)
    kept.pids()
    stalled = kept.beat(0.3)
    time.sleep(0.5)
    kept.tell(f"alive {stalled!r}")  # a line written before the stall, read only now
    time.sleep(0.3)
    assert not acts_between(kept.log, stalled + H + 0.05, time.monotonic()), "thawed by a stale heartbeat"


def test_a_stop_while_frozen_kills_at_once(start: Start) -> None:
    kept = start(kill_grace=5.0, finish=5.0)
    kept.beat(0.3)
    pids = kept.pids()
    vouched = kept.beat(0.3)
    time.sleep(0.5)
    began = time.monotonic()
    kept.tell("stop 5")  # graceful, but a frozen app can finish nothing
    kept.tell("ended")
    assert kept.proc.wait(5) == 128 + signal.SIGKILL
    assert time.monotonic() - began < 1.0, "waited out the kill grace"
    assert not any(process_alive(pid) for pid in pids)
    assert not acts_between(kept.log, vouched + H + 0.05, time.monotonic()), "thawed to handle SIGTERM"


def test_a_heartbeat_after_a_stop_does_not_thaw(start: Start) -> None:
    """What the woken sidecar says once its lock is gone: the stop, then heartbeats again."""
    kept = start(kill_grace=5.0, finish=5.0)
    kept.beat(0.3)
    pids = kept.pids()
    vouched = kept.beat(0.3)
    time.sleep(0.5)
    kept.tell("stop 5")
    kept.beat(0.3)
    kept.proc.wait(5)
    assert not any(process_alive(pid) for pid in pids)
    assert not acts_between(kept.log, vouched + H + 0.05, time.monotonic())


def test_the_deadline_while_frozen_kills_at_once(start: Start) -> None:
    began = time.monotonic()
    kept = start(deadline_in=1.5, kill_grace=5.0, finish=5.0)
    kept.beat(0.8)
    pids = kept.pids()
    assert kept.proc.wait(10) == 128 + signal.SIGKILL
    assert time.monotonic() - began < 2.5, "frozen at the deadline: killed then, not after the kill grace"
    assert not any(process_alive(pid) for pid in pids)


def test_a_drain_while_frozen_goes_on_once_thawed(start: Start) -> None:
    """``stop inf`` does not end the term: the app handles its SIGTERM once the heartbeat is back."""
    kept = start(finish=0.3)
    kept.beat(0.3)
    pids = kept.pids()
    vouched = kept.beat(0.3)
    time.sleep(0.5)
    kept.tell("stop inf")
    time.sleep(0.3)
    assert kept.proc.poll() is None and {state(pid) for pid in pids} == {"T"}
    assert not acts_between(kept.log, vouched + H + 0.05, time.monotonic())
    thawed = time.monotonic()
    kept.beat(1.0)
    assert kept.proc.wait(5) == 0, "the app finished its drain and exited"
    finishing = acts_between(kept.log, thawed, time.monotonic())
    assert finishing and max(at for _, at in finishing) - thawed < 0.3 + 0.2, "SIGTERM not handled once thawed"


# --- the gate's side: what it sends when its own loop stalls ---------------------------------------

ME = Identity("pod/uid/n")


def status(role: Role, token: int | None = None) -> ElectionStatus:
    term = Term(identity=ME, token=Token(token)) if token is not None else None
    return ElectionStatus(group="g", identity=ME, role=role, term=term, leader=ME if term else None,
                          leader_token=term.token if term else None, leader_since=None, transitions=0,
                          reason="test")


@pytest.fixture
async def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ExecGate]:
    # The sweep kills every child of this process: here, the session's servers too.
    monkeypatch.setattr(gate_module, "sweep_orphans", lambda **_: 0)
    log = tmp_path / "acts"
    gate = ExecGate((sys.executable, APP), kill_grace=1.0, env={"ACT_LOG": str(log), "ACT_CHILDREN": "1"})
    runner = asyncio.create_task(gate.run())
    gate.on_status(status(Role.LEADER, 1))
    gate.on_deadline(time.monotonic() + 60)
    deadline = time.monotonic() + 10
    while len({pid for pid, _ in acts(log)}) < 2:
        assert time.monotonic() < deadline, "the app did not act"
        await asyncio.sleep(0.02)
    yield gate
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    for pid, _ in acts(log):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def gate_log(gate: ExecGate) -> Path:
    return Path(gate.env["ACT_LOG"])


async def test_a_healthy_gate_keeps_its_app_acting(gate: ExecGate) -> None:
    log = gate_log(gate)
    pids = {pid for pid, _ in acts(log)}
    began = time.monotonic()
    states: set[str] = set()
    while time.monotonic() < began + 2.0:
        states.update(state(pid) for pid in pids)
        await asyncio.sleep(0.005)
    assert "T" not in states, "the app was frozen while its sidecar ran"
    times = sorted(at for _, at in acts_between(log, began, time.monotonic()))
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.2, "the app stood still"


async def test_a_stalled_gate_freezes_its_app_then_thaws_it(gate: ExecGate) -> None:
    log = gate_log(gate)
    stalled = time.monotonic()
    time.sleep(0.5)  # noqa: ASYNC251 - the sidecar's loop stalls (a GC pause): no heartbeat
    resumed = time.monotonic()
    assert not acts_between(log, stalled + H + 0.05, resumed), "acted with no heartbeat"
    await asyncio.sleep(0.5)
    assert acts_between(log, resumed, time.monotonic()), "not thawed once the sidecar ran again"
    assert len(spans(log)) == 1


async def test_a_gate_woken_from_a_stall_vouches_only_once_it_caught_up(gate: ExecGate) -> None:
    """The sidecar wakes and learns, some loop iterations later, that its lock was lost while it
    stalled. A heartbeat vouches for the beat before it, not for the moment it is sent: the first
    after the stall says nothing of it, and by the next the loss is handled, its stop ahead in the
    pipe (the keeper then kills). One vouching for the moment it was sent would thaw the app,
    beside the next leader, until the stop arrived."""
    log = gate_log(gate)
    pids = {pid for pid, _ in acts(log)}

    def lost() -> None:  # what the elector does on a loss: publish, end the term, stop at once
        gate.on_status(status(Role.STANDBY))
        gate.on_deadline(0.0)

    stalled = time.monotonic()
    time.sleep(0.5)  # noqa: ASYNC251 - the stall
    asyncio.get_running_loop().call_later(HEARTBEAT_INTERVAL / 2, lost)
    await asyncio.sleep(HEARTBEAT_INTERVAL / 2 + 0.01)
    await asyncio.wait_for(gate.stop(urgent=True), 5)
    assert not any(process_alive(pid) for pid in pids)
    assert not acts_between(log, stalled + H + 0.05, time.monotonic()), "thawed before the loss was handled"
