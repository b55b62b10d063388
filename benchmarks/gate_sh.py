"""What ``gate.sh`` costs at rest and how fast it follows the sidecar, with its wake pipe and
without it (the 0.1 s check of the files that it falls back on, and that it did always before).

    .venv/bin/python -m benchmarks.gate_sh [--runs 20] [--rest-seconds 10] [--against OLD_GATE_SH]

``gate.sh`` runs as PID 1 of a PID namespace of its own (``unshare --pid --mount-proc``), as
the operator wires it in a container, so it takes the whole namespace for the app, around an
app that records when it starts (a shell that writes a file, then sleeps). The sidecar's side
is ``singleton_sidecar.gates.file_gate.FileGate``, called as the elector calls it. Measures, per mode:

- **start**: the flag written (a new term) -> the app's first sign of life, ``--runs`` times;
- **stop**: the flag removed and a stop requested -> ``gate.sh``'s acknowledgement that no
  process of the app is left (the app exits at once on SIGTERM), ``--runs`` times;
- **at rest**: CPU of ``gate.sh`` and everything it forks (its own and its children's ticks
  from /proc) over ``--rest-seconds``, while the app runs (one renewal a second, as with the
  default timings) and while it does not.

Needs root (a PID namespace) and util-linux's ``unshare``. Prints medians and p99 (nearest
rank) and the ratio of the two modes, measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_sidecar.gates.file_gate import FileGate
from singleton_testbed.ledger import percentile

APP = 'echo started > "$SINGLETON_GATE_DIR/started"; trap "exit 0" TERM; while :; do sleep 1; done'
TICKS = os.sysconf("SC_CLK_TCK")
POLL = 0.0005
T = TypeVar("T")


def status(role: Role, token: int) -> ElectionStatus:
    me = Identity("bench")
    term = Term(identity=me, token=Token(token), version="1", written_at=0.0)
    return ElectionStatus(group="bench", identity=me, role=role, term=term if role is Role.LEADER else None,
                          leader=me if role is Role.LEADER else None,
                          leader_token=Token(token) if role is Role.LEADER else None,
                          leader_since=0.0, transitions=token, reason="benchmark")


@contextlib.contextmanager
def running_gate(directory: Path, *, wake: bool, script: Path | None = None) -> Iterator[tuple[FileGate, int]]:
    """A FileGate and the pid of ``gate.sh`` (PID 1 of its namespace), stopped at the end;
    ``script``: another ``gate.sh`` than the one the FileGate installs."""
    follower = FileGate(directory, kill_grace=1.0)
    follower.install()
    if script is not None:
        shutil.copyfile(script, directory / "gate.sh")
    if not wake:
        (directory / "wake").unlink()  # what gate.sh finds without a sidecar that makes the pipe
    env = {**os.environ, "SINGLETON_GATE_DIR": str(directory)}
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                              "/bin/sh", str(directory / "gate.sh"), "/bin/sh", "-c", APP],
                             env=env, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        pid = wait_for(lambda: gate_pid(outer.pid), 10)
        wait_for((directory / "idle").exists, 10)
        yield follower, pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(outer.pid, signal.SIGKILL)
        outer.wait()


def gate_pid(unshare_pid: int) -> int | None:
    """The pid (outside) of the namespace's PID 1: the child of unshare's fork."""
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children")
    with contextlib.suppress(OSError):
        found = children.read_text().split()
        return int(found[0]) if found else None
    return None


def wait_for(probe: Callable[[], T | None], timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while (value := probe()) is None or value is False:
        if time.monotonic() > deadline:
            raise SystemExit(f"gate_sh: timed out after {timeout} s")
        time.sleep(POLL)
    return value


def stop_acknowledged(directory: Path) -> bool:
    """gate.sh copied the stop nonce into ``idle``: no process of the app is left."""
    try:
        return (directory / "idle").read_text().strip() == (directory / "stop").read_text().strip()
    except OSError:  # no stop file yet
        return False


def cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime: the process and the children it has reaped."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15])


def measure(directory: Path, *, wake: bool, runs: int, rest_seconds: float,
            script: Path | None = None) -> dict[str, list[float]]:
    started = directory / "started"
    figures: dict[str, list[float]] = {"start": [], "stop": [], "rest leading": [], "rest idle": []}
    with running_gate(directory, wake=wake, script=script) as (follower, pid):
        for run in range(1, runs + 1):
            time.sleep(random.uniform(0.15, 0.35))  # not in step with gate.sh's 0.1 s checks
            started.unlink(missing_ok=True)
            follower.on_deadline(time.monotonic() + 30)
            begun = time.monotonic()
            follower.on_status(status(Role.LEADER, run))
            wait_for(started.exists, 10)
            figures["start"].append(time.monotonic() - begun)
            time.sleep(0.2)
            begun = time.monotonic()
            follower.on_status(status(Role.STANDBY, run))
            wait_for(lambda: stop_acknowledged(directory), 10)
            figures["stop"].append(time.monotonic() - begun)
        for phase in ("rest leading", "rest idle"):
            if phase == "rest leading":
                follower.on_deadline(time.monotonic() + rest_seconds + 30)
                follower.on_status(status(Role.LEADER, runs + 1))
                wait_for(started.exists, 10)
            before, begun = cpu_ticks(pid), time.monotonic()
            while time.monotonic() - begun < rest_seconds:
                time.sleep(1.0)
                if phase == "rest leading":
                    follower.on_deadline(time.monotonic() + 30)  # a renewal a second
            spent = (cpu_ticks(pid) - before) / TICKS
            figures[phase].append(100 * spent / (time.monotonic() - begun))
            if phase == "rest leading":
                follower.on_status(status(Role.STANDBY, runs + 1))
                wait_for(lambda: stop_acknowledged(directory), 10)
    return figures


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="starts and stops per mode (default 20)")
    parser.add_argument("--rest-seconds", type=float, default=10.0, help="seconds of each at-rest measurement")
    parser.add_argument("--against", type=Path, metavar="GATE_SH",
                        help="compare with this gate.sh (wake pipe too) instead of the 0.1 s checks, e.g. "
                             "an earlier commit's: git show REV:sidecar/singleton_sidecar/gates/gate.sh > old.sh")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rest_seconds <= 0:
        parser.error("--runs must be at least 1 and --rest-seconds positive")
    if args.against is not None and not args.against.is_file():
        parser.error(f"--against: {args.against} is not a file")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        parser.error("needs root and util-linux's unshare (gate.sh runs as PID 1 of a PID namespace)")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, "
          f"kernel {platform.release()}, /bin/sh -> {os.path.realpath('/bin/sh')}")
    results: dict[str, dict[str, list[float]]] = {}
    modes: list[tuple[str, bool, Path | None]] = [("wake pipe", True, None)]
    modes.append(("0.1 s checks", False, None) if args.against is None else (str(args.against), True, args.against))
    for mode, wake, script in modes:
        with tempfile.TemporaryDirectory(prefix="gate-sh-bench-") as folder:
            results[mode] = measure(Path(folder) / "gate", wake=wake, runs=args.runs, rest_seconds=args.rest_seconds,
                                    script=script)
    print(f"\n{args.runs} runs per mode; at rest: % of one core over {args.rest_seconds:g} s\n")
    print(f"| figure | {' | '.join(results)} | ratio |")
    print("|---|" + "---|" * (len(results) + 1))
    for figure, unit in (("start", "ms"), ("stop", "ms"), ("rest leading", "%"), ("rest idle", "%")):
        cells, medians = [], []
        for per_mode in results.values():
            values = per_mode[figure]
            if unit == "ms":
                median = statistics.median(values) * 1000
                cells.append(f"{median:.1f} / {percentile(values, 0.99) * 1000:.1f} ms")
            else:
                median = values[0]
                cells.append(f"{median:.2f} %")
            medians.append(median)
        ratio = f"{medians[0] / medians[1]:.2f}" if medians[1] else "-"
        label = f"{figure} (median / p99)" if unit == "ms" else figure
        print(f"| {label} | {' | '.join(cells)} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
