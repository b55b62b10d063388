"""Failover and handover times of real sidecar processes, per backend.

    .venv/bin/python -m benchmarks.failover --runs 20 [--backend postgres lease both]

Starts its own PostgreSQL (or uses SINGLETON_TEST_DSN) and, for the lease and both
backends, the test bed's etcd + kube-apiserver. Each group is 3 sidecars, each playing
a pod object (as in a cluster) with the backend's default timings. Measures:
- graceful handover: SIGTERM to the leader -> another sidecar's /readyz answers 200;
- SIGKILL failover: SIGKILL of the leader -> another sidecar's /readyz answers 200;
- start to campaigning: process start -> /leader answers;
- at rest: RSS and CPU of each sidecar, and API requests per second for the whole group
  (counted in the API server's audit log over --rest-seconds).
Prints medians and p99 (nearest rank) over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.kubehelpers import create_pod
from tests.sidecars import SidecarProcess, one_leader, wait_for, wait_serving

from singleton_sidecar.core.timings import BACKEND_DEFAULTS
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.postgres import PostgresServer


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


@contextmanager
def running(start: Callable[[int], SidecarProcess], count: int) -> Iterator[list[SidecarProcess]]:
    """``count`` members, ``start(index)`` each, once all serve; every one stopped on exit."""
    members: list[SidecarProcess] = []
    try:
        for index in range(count):
            members.append(start(index))
        wait_serving(members, 15)
        yield members
    finally:
        for member in members:
            member.stop()


@dataclass
class Bench:
    backend: str
    dsn: str
    workdir: Path
    control_plane: ControlPlane | None
    namespace: str = "bench"

    def group(self, count: int) -> AbstractContextManager[list[SidecarProcess]]:
        group = "bench-" + uuid.uuid4().hex[:8]

        def start(index: int) -> SidecarProcess:
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": self.backend,
                   "SINGLETON_IDENTITY": f"b{index}-{uuid.uuid4().hex[:6]}"}
            if self.backend != "lease":
                env["SINGLETON_POSTGRES_DSN"] = self.dsn
            if self.control_plane is not None:
                name = f"{group}-{index}"
                pod = create_pod(self.control_plane, self.namespace, name)
                env.update({"KUBECONFIG": str(self.control_plane.info.kubeconfig),
                            "SINGLETON_NAMESPACE": self.namespace, "SINGLETON_POD_NAME": name,
                            "SINGLETON_POD_UID": pod["metadata"]["uid"]})
            return SidecarProcess(f"b{index}", env, self.workdir / f"{group}-{index}.log").start()

        return running(start, count)

    def takeover(self, signum: int) -> float:
        with self.group(3) as members:
            leader = one_leader(members, timeout=20)
            others = [m for m in members if m is not leader]
            time.sleep(0.3)
            started = time.monotonic()
            leader.signal(signum)
            wait_for(lambda: any(m.ready() for m in others), 30, "a new ready leader", interval=0.001)
            return time.monotonic() - started

    def start(self) -> float:
        started = time.monotonic()
        with self.group(1) as members:
            wait_for(lambda: members[0].leader_doc() is not None, 15, "the sidecar to answer", interval=0.005)
            return time.monotonic() - started

    def rest(self, seconds: float) -> tuple[list[float], list[float], float | None]:
        with self.group(3) as members:
            one_leader(members, timeout=20)
            time.sleep(2)
            pids = [m.popen.pid for m in members if m.popen is not None]
            before = [cpu_seconds(p) for p in pids]
            audit_from = self._audit_size()
            time.sleep(seconds)
            cpu = [(cpu_seconds(p) - b) / seconds for p, b in zip(pids, before, strict=True)]
            requests = self._sidecar_requests(audit_from) / seconds if self.control_plane is not None else None
            return [rss_mb(p) for p in pids], cpu, requests

    def _audit_path(self) -> Path | None:
        return None if self.control_plane is None else self.control_plane.workdir / "audit.log"

    def _audit_size(self) -> int:
        path = self._audit_path()
        return path.stat().st_size if path is not None and path.exists() else 0

    def _sidecar_requests(self, offset: int) -> int:
        """Requests the sidecars made (Lease, own pod, events), each counted once by auditID."""
        path = self._audit_path()
        assert path is not None
        with path.open("rb") as audit:
            audit.seek(offset)
            entries = [entry for entry in map(json.loads, audit.read().splitlines())
                       if entry.get("userAgent", "").startswith("singleton-sidecar")]
        kinds: dict[str, set[str]] = {}
        for entry in entries:
            ref = entry.get("objectRef", {})
            kinds.setdefault(f"{entry['verb']} {ref.get('resource')}/{ref.get('subresource', '')}", set()).add(
                entry["auditID"])
            if os.environ.get("BENCH_DEBUG"):
                print(entry["requestReceivedTimestamp"], entry["verb"], ref.get("name"), entry["user"]["username"])
        print("  sidecar API requests at rest: " + ", ".join(f"{k}: {len(v)}" for k, v in sorted(kinds.items())))
        return len({entry["auditID"] for entry in entries})


def run_backend(bench: Bench, runs: int, rest_seconds: float) -> tuple[list[float], list[float]]:
    """Measure one backend and print its figures; returns (graceful, SIGKILL) times."""
    timings = BACKEND_DEFAULTS[bench.backend]
    graceful = [bench.takeover(signal.SIGTERM) for _ in range(runs)]
    kill = [bench.takeover(signal.SIGKILL) for _ in range(runs)]
    start = [bench.start() for _ in range(min(runs, 10))]
    rss, cpu, requests = bench.rest(rest_seconds)
    print(f"\n{bench.backend} backend, 3 sidecars, timings lease {timings.lease_duration:g} s / renew deadline "
          f"{timings.renew_deadline:g} s / retry {timings.retry_period:g} s, {os.cpu_count()} CPUs")
    print(summary("graceful handover (SIGTERM)", graceful))
    print(summary("SIGKILL failover", kill))
    print(summary("start to answering /leader", start))
    print(f"{'RSS at rest (3 sidecars)':<34} " + ", ".join(f"{v:.1f} MB" for v in rss))
    print(f"{'CPU at rest (3 sidecars)':<34} " + ", ".join(f"{v * 100:.2f} %" for v in cpu))
    if requests is not None:
        print(f"{'API requests/s at rest (group)':<34} {requests:.3f} over {rest_seconds:g} s")
    sys.stdout.flush()
    return graceful, kill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario (default 20)")
    parser.add_argument("--backend", nargs="+", choices=["postgres", "lease", "both"],
                        default=["postgres", "lease", "both"], help="backends to measure (default: all)")
    parser.add_argument("--rest-seconds", type=float, default=300.0,
                        help="how long to watch an idle group (default 300: at least the sidecars' watch "
                             "timeouts, so the re-opened watches are counted)")
    parser.add_argument("--plots", type=Path, default=None, metavar="DIR",
                        help="also draw the failover-time distributions per backend into DIR (needs matplotlib)")
    args = parser.parse_args()
    measured = []
    with bench_servers("singleton-bench-") as (dsn, control_plane, workdir):
        for backend in args.backend:
            # postgres runs as it would on a VM: no API server involved at all.
            plane = None if backend == "postgres" else control_plane
            graceful, kill = run_backend(Bench(backend, dsn, workdir, plane), args.runs, args.rest_seconds)
            measured.append((backend, graceful, kill))
    if args.plots is not None:
        from benchmarks.compare_clientgo import PeerResult, plot  # matplotlib only when asked

        def triple(backend: str) -> tuple[float, float, float]:
            t = BACKEND_DEFAULTS[backend]
            return t.lease_duration, t.renew_deadline, t.retry_period

        results = [PeerResult(backend, f"{backend} backend", "singleton-sidecar", triple(backend), graceful, kill)
                   for backend, graceful, kill in measured]
        for path in plot(results, args.plots, prefix="backends"):
            print(f"plot: {path}")
    return 0


@contextmanager
def bench_servers(prefix: str) -> Iterator[tuple[str, ControlPlane, Path]]:
    """PostgreSQL (or SINGLETON_TEST_DSN's), etcd + kube-apiserver with a ``bench`` namespace,
    and a work folder: (dsn, control plane, folder). Stopped on exit."""
    server, control_plane = None, None
    dsn = os.environ.get("SINGLETON_TEST_DSN")
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        if not dsn:
            server = PostgresServer()
            dsn = server.start().dsn
        binaries = find_all()
        add_to_path(binaries)
        control_plane = ControlPlane(binaries)
        control_plane.start()
        control_plane.kubectl("create", "namespace", "bench")
        control_plane.kubectl("create", "serviceaccount", "default", "-n", "bench")  # no controller-manager here
        yield dsn, control_plane, workdir
    finally:
        if control_plane is not None:
            control_plane.stop()
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
