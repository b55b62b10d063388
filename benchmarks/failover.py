"""Failover and handover times of real sidecar processes (postgres backend, or lease).

    .venv/bin/python -m benchmarks.failover --runs 20

Starts its own PostgreSQL (or uses SINGLETON_TEST_DSN), runs 3 sidecars, and measures:
- graceful handover: SIGTERM to the leader -> another sidecar's /readyz answers 200;
- SIGKILL failover: SIGKILL of the leader -> another sidecar's /readyz answers 200;
- start to campaigning: process start -> /leader answers;
- RSS of an idle standby and leader, and their CPU use over 10 s at rest.
Prints medians and p99 (nearest rank) over the runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.sidecars import SidecarProcess, one_leader, wait_for

from singleton_testbed.postgres import PostgresServer

DEFAULT_TIMINGS = {"SINGLETON_LEASE_DURATION": "6", "SINGLETON_RENEW_DEADLINE": "4", "SINGLETON_RETRY_PERIOD": "2"}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def summary(name: str, values: list[float], unit: str = "ms", scale: float = 1000.0) -> str:
    scaled = [v * scale for v in values]
    return (f"{name:<34} n={len(values):<3} median={statistics.median(scaled):8.1f} {unit}  "
            f"p99={percentile(scaled, 0.99):8.1f} {unit}  max={max(scaled):8.1f} {unit}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def new_group(dsn: str, workdir: Path, count: int) -> list[SidecarProcess]:
    group = "bench-" + uuid.uuid4().hex[:8]
    members = []
    for index in range(count):
        env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres", "SINGLETON_POSTGRES_DSN": dsn,
               "SINGLETON_IDENTITY": f"b{index}-{uuid.uuid4().hex[:6]}", **DEFAULT_TIMINGS}
        members.append(SidecarProcess(f"b{index}", env, workdir / f"{group}-{index}.log").start())
    return members


def measure_takeover(dsn: str, workdir: Path, signum: int) -> float:
    members = new_group(dsn, workdir, 3)
    try:
        leader = one_leader(members, timeout=15)
        others = [m for m in members if m is not leader]
        time.sleep(0.3)
        started = time.monotonic()
        leader.signal(signum)
        wait_for(lambda: any(m.ready() for m in others), 15, "a new ready leader", interval=0.001)
        return time.monotonic() - started
    finally:
        for member in members:
            member.stop()


def measure_start(dsn: str, workdir: Path) -> float:
    started = time.monotonic()
    members = new_group(dsn, workdir, 1)
    try:
        wait_for(lambda: members[0].leader_doc() is not None, 15, "the sidecar to answer", interval=0.005)
        return time.monotonic() - started
    finally:
        members[0].stop()


def measure_rest(dsn: str, workdir: Path) -> tuple[list[float], list[float]]:
    members = new_group(dsn, workdir, 3)
    try:
        one_leader(members, timeout=15)
        time.sleep(2)
        pids = [m.popen.pid for m in members if m.popen is not None]
        before = [cpu_seconds(p) for p in pids]
        time.sleep(10)
        cpu = [(cpu_seconds(p) - b) / 10 for p, b in zip(pids, before, strict=True)]
        return [rss_mb(p) for p in pids], cpu
    finally:
        for member in members:
            member.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario (default 20)")
    args = parser.parse_args()
    server = None
    dsn = os.environ.get("SINGLETON_TEST_DSN")
    if not dsn:
        server = PostgresServer()
        dsn = server.start().dsn
    workdir = Path(tempfile.mkdtemp(prefix="singleton-bench-"))
    try:
        graceful = [measure_takeover(dsn, workdir, signal.SIGTERM) for _ in range(args.runs)]
        kill = [measure_takeover(dsn, workdir, signal.SIGKILL) for _ in range(args.runs)]
        start = [measure_start(dsn, workdir) for _ in range(min(args.runs, 10))]
        rss, cpu = measure_rest(dsn, workdir)
        print(f"postgres backend, 3 sidecars, timings {DEFAULT_TIMINGS}, {os.cpu_count()} CPUs")
        print(summary("graceful handover (SIGTERM)", graceful))
        print(summary("SIGKILL failover", kill))
        print(summary("start to answering /leader", start))
        print(f"{'RSS at rest (3 sidecars)':<34} " + ", ".join(f"{v:.1f} MB" for v in rss))
        print(f"{'CPU at rest (3 sidecars)':<34} " + ", ".join(f"{v * 100:.2f} %" for v in cpu))
    finally:
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
