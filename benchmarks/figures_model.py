"""What ``benchmarks/figures.json`` holds: every figure of README's Figures section from one run
of ``python -m benchmarks.figures``, with the machine, the commit and the date of that run.

A figure is one cell's measurement: its scenario in words, its setup (host processes or the real
node, the gate, the backend, the timings), n, median, p99 (nearest rank) and max with their unit,
facts that are counts or single values (runs with two leaders, groups left without one...), and
where the row compares, the counterpart measured by the same script with the same fault
(client-go's elector, or the operator burst's floor). Plain data: reading and writing it needs
nothing but the standard library, so the renderer and the goals run anywhere.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from singleton_testbed.ledger import percentile

SCHEMA = 1
"""The JSON's layout version: a reader refuses another."""
HOST = "host processes"
NODE = "real node"
CLIENT_GO = "client-go"
FLOOR = "floor"
FULL = "full"
QUICK = "quick"

Fact = int | float | str


@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    p99: float
    """Nearest rank (``singleton_testbed.ledger.percentile``): one of the values, so the p99 of
    fewer than 100 runs is their maximum."""
    max: float
    unit: str
    """``s`` (times), ``MB``, ``requests/s``, ``%``, ``ratio``."""

    @classmethod
    def of(cls, values: Sequence[float], unit: str) -> Stats:
        """The statistics of ``values`` (at least one)."""
        if not values:
            raise ValueError("no values to summarize")
        return cls(len(values), statistics.median(values), percentile(values, 0.99), max(values), unit)

    @classmethod
    def single(cls, value: float, unit: str) -> Stats:
        """One measurement (a rest window): n = 1, every statistic the value."""
        return cls(1, value, value, value, unit)


@dataclass(frozen=True)
class Setup:
    where: str
    """``HOST`` or ``NODE``."""
    gate: str
    """``exec``, ``file``, ``none`` (no gated app), or ``-`` where no app is involved."""
    backend: str
    """``postgres``, ``lease``, ``both``, or ``-``."""
    timings: str
    """Lease duration / renew deadline / retry period, e.g. ``6/4/2 s``, or ``-``."""
    details: str = ""
    """The rest of the setup in words: apps, polling, windows, what is left out."""


@dataclass(frozen=True)
class Counterpart:
    """The same fault in the same script, measured on another peer."""

    peer: str
    """``CLIENT_GO`` or ``FLOOR``."""
    setup: str
    stats: Stats
    facts: dict[str, Fact] = field(default_factory=dict)


@dataclass(frozen=True)
class Figure:
    id: str
    """``<row>.<column>``: ``handover.lease``, ``partition-api.vs-clientgo``, ``burst.500``."""
    row: str
    scenario: str
    setup: Setup
    stats: Stats
    facts: dict[str, Fact] = field(default_factory=dict)
    counterpart: Counterpart | None = None

    @property
    def column(self) -> str:
        return self.id.split(".", 1)[1]


@dataclass(frozen=True)
class StepRun:
    """One benchmark module's run within the whole run."""

    id: str
    command: list[str]
    seconds: float
    estimate_seconds: float
    status: str
    """``ok``, ``skipped`` (could not run here: ``reason``), ``failed`` (no figures: ``reason``)."""
    reason: str = ""
    exit_code: int | None = None
    skipped_rows: dict[str, str] = field(default_factory=dict)
    """Rows the step left out although it ran (the partition without a real node), and why."""


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    memory_gib: float
    kernel: str
    load_before: float
    """The 1-minute load average when the run began (a quiet 2-core machine: well under 1)."""
    load_after: float


@dataclass(frozen=True)
class Commit:
    sha: str
    dirty: bool
    """Tracked files differed from the commit when the run began."""


@dataclass(frozen=True)
class Document:
    mode: str
    machine: Machine
    commit: Commit
    date: str
    """When the run began, ISO 8601 in UTC."""
    seconds: float
    """The whole run."""
    rows: list[str]
    """The rows this run measured (all of them, or ``--only``'s)."""
    steps: list[StepRun]
    figures: list[Figure]
    schema: int = SCHEMA

    def figure(self, figure_id: str) -> Figure | None:
        return next((f for f in self.figures if f.id == figure_id), None)

    def of_row(self, row: str) -> list[Figure]:
        return [f for f in self.figures if f.row == row]


def to_json(document: Document) -> str:
    return json.dumps(asdict(document), indent=1, sort_keys=False) + "\n"


def from_json(text: str) -> Document:
    """A document written by ``to_json``; ValueError when it is not one of this schema."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"not a figures document of schema {SCHEMA}")
    return Document(
        mode=data["mode"], machine=Machine(**data["machine"]), commit=Commit(**data["commit"]), date=data["date"],
        seconds=data["seconds"], rows=list(data["rows"]), steps=[StepRun(**s) for s in data["steps"]],
        figures=[_figure(f) for f in data["figures"]], schema=data["schema"])


def _figure(data: Mapping[str, Any]) -> Figure:
    counterpart = data.get("counterpart")
    return Figure(id=data["id"], row=data["row"], scenario=data["scenario"], setup=Setup(**data["setup"]),
                  stats=Stats(**data["stats"]), facts=dict(data.get("facts") or {}),
                  counterpart=None if counterpart is None else Counterpart(
                      peer=counterpart["peer"], setup=counterpart["setup"], stats=Stats(**counterpart["stats"]),
                      facts=dict(counterpart.get("facts") or {})))


def load(path: Path) -> Document:
    return from_json(path.read_text())


# --- values in words (README's cells and the goals' details) ----------------------------------------------


def duration(seconds: float) -> str:
    """``59 ms``, ``8.47 s``, ``17.9 s``: three figures at most, in the unit that reads best."""
    if abs(seconds) < 1:
        milliseconds = seconds * 1000
        return f"{milliseconds:.1f} ms" if abs(milliseconds) < 10 else f"{milliseconds:.0f} ms"
    return f"{seconds:.2f} s" if abs(seconds) < 10 else f"{seconds:.1f} s"


def quantity(value: float, unit: str) -> str:
    """A value in its unit: seconds as ``duration``, the others with up to three figures."""
    if unit == "s":
        return duration(value)
    number = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{number} {unit}" if unit else number


# --- the machine and the commit, as the run finds them ------------------------------------------------


def read_machine(load_before: float, proc: Path = Path("/proc")) -> Machine:
    """This machine, from ``/proc``: CPU model, cores, memory, kernel, load average now."""
    return Machine(cpu=_cpu_model(proc), cores=os.cpu_count() or 1, memory_gib=_memory_gib(proc),
                   kernel=_read(proc / "sys" / "kernel" / "osrelease") or platform.release(),
                   load_before=load_before, load_after=load_average(proc))


def load_average(proc: Path = Path("/proc")) -> float:
    """The 1-minute load average (0.0 where ``/proc/loadavg`` cannot be read)."""
    fields = _read(proc / "loadavg").split()
    return float(fields[0]) if fields else 0.0


def _cpu_model(proc: Path) -> str:
    for line in _read(proc / "cpuinfo").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib(proc: Path) -> float:
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024**2, 1)
    return 0.0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_commit(repo: Path) -> Commit:
    """HEAD, and whether tracked files differ from it (untracked ones do not count)."""
    sha = _git(repo, "rev-parse", "HEAD")
    return Commit(sha=sha or "unknown", dirty=bool(_git(repo, "status", "--porcelain", "--untracked-files=no")))


def _git(repo: Path, *arguments: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *arguments], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return done.stdout.strip()
