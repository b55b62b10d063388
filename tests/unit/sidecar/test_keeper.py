"""The exec gate's keeper on its own, with real processes: it stops the app's whole group at
the term's deadline, at once when the sidecar's pipe closes, and only ever exits once every
process it kept is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from singleton_sidecar.gates import keeper
from singleton_testbed.procs import process_alive

KEEPER = keeper.__file__
# The app: records its pid and those of its children, ignores nothing unless told.
APP = """
import os, signal, subprocess, sys, time
out = sys.argv[1]
mode = sys.argv[2]
if mode == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
deaf = "import time, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", deaf])
escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
time.sleep(0.5)  # the child has set its SIGTERM handling by now
with open(out, "w") as f:
    f.write(f"{os.getpid()} {child.pid} {escaped.pid}\\n")
if mode == "exit":
    sys.exit(7)
time.sleep(60)
"""


@dataclass
class Kept:
    proc: subprocess.Popen[bytes]
    control: int
    pids_file: Path

    def pids(self) -> list[int]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.pids_file.exists() and self.pids_file.read_text().endswith("\n"):
                return [int(p) for p in self.pids_file.read_text().split()]
            time.sleep(0.01)
        raise AssertionError("the app did not start")

    def tell(self, line: str) -> None:
        os.write(self.control, f"{line}\n".encode())


class Start(Protocol):
    def __call__(self, *, deadline_in: float, kill_grace: float, mode: str = ...) -> Kept: ...


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    started: list[Kept] = []

    def run(*, deadline_in: float, kill_grace: float, mode: str = "plain") -> Kept:
        read_end, write_end = os.pipe()
        pids_file = tmp_path / f"pids{len(started)}"
        proc = subprocess.Popen(
            [sys.executable, "-S", "-E", KEEPER, "--deadline", repr(time.monotonic() + deadline_in),
             "--kill-grace", repr(kill_grace), "--control-fd", str(read_end),
             "--deadline-file", str(tmp_path / "deadline"), "--",
             sys.executable, "-c", APP, str(pids_file), mode],
            pass_fds=(read_end,))
        os.close(read_end)
        kept = Kept(proc, write_end, pids_file)
        started.append(kept)
        return kept

    yield run
    for kept in started:
        if kept.proc.poll() is None:
            kept.proc.kill()
            kept.proc.wait()
        for pid in kept.pids() if kept.pids_file.exists() else []:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_deadline_stops_the_whole_group_without_the_sidecar(start: Start, tmp_path: Path) -> None:
    began = time.monotonic()
    kept = start(deadline_in=1.0, kill_grace=0.5, mode="deaf")
    pids = kept.pids()
    assert float((tmp_path / "deadline").read_text()) > time.monotonic()
    assert kept.proc.wait(10) == 128 + signal.SIGKILL  # deaf to SIGTERM: killed after the grace
    assert 1.45 < time.monotonic() - began < 3.0, "SIGKILL at the deadline plus the kill grace"
    assert not any(process_alive(pid) for pid in pids), "a process of the group (or an escaped child) survived"


def test_renewals_move_the_deadline(start: Start) -> None:
    kept = start(deadline_in=3.0, kill_grace=0.2)
    kept.pids()
    for _ in range(6):
        kept.tell(f"deadline {time.monotonic() + 0.6}")
        time.sleep(0.2)
    assert kept.proc.poll() is None, "stopped although the deadline kept moving"
    kept.tell("stop 0.2")
    assert kept.proc.wait(5) != 0


def test_a_closed_pipe_kills_at_once(start: Start) -> None:
    kept = start(deadline_in=30, kill_grace=5)
    pids = kept.pids()
    began = time.monotonic()
    os.close(kept.control)  # the sidecar died
    kept.proc.wait(5)
    assert time.monotonic() - began < 0.5, "the kill grace applies only when the sidecar is alive"
    assert not any(process_alive(pid) for pid in pids)


def test_a_graceful_stop_waits_for_the_app(start: Start) -> None:
    kept = start(deadline_in=30, kill_grace=0.2)
    pids = kept.pids()
    kept.tell("stop inf")
    time.sleep(1.0)
    # The app ended on SIGTERM; its SIGTERM-deaf child is not killed while the drain lasts.
    assert kept.proc.poll() is None and process_alive(pids[1])
    kept.tell("stop 0")
    kept.proc.wait(5)
    assert not any(process_alive(pid) for pid in pids)


def test_an_app_that_exits_takes_what_it_left_with_it(start: Start) -> None:
    kept = start(deadline_in=30, kill_grace=0.3, mode="exit")
    pids = kept.pids()
    assert kept.proc.wait(5) == 7  # the app's own status
    assert not any(process_alive(pid) for pid in pids)


def test_a_signal_to_the_sidecars_group_does_not_stop_the_keeper(start: Start, tmp_path: Path) -> None:
    kept = start(deadline_in=30, kill_grace=0.2)
    pids = kept.pids()
    kept.proc.send_signal(signal.SIGTERM)
    kept.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert kept.proc.poll() is None and process_alive(pids[0])
    kept.tell("ended")
    time.sleep(0.2)
    assert float((tmp_path / "deadline").read_text()) == 0.0, "an ended term tells the app at once"
    kept.tell("stop 0")
    kept.proc.wait(5)
