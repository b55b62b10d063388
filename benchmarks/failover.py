"""Failover and handover times of real sidecar processes, per backend.

    .venv/bin/python -m benchmarks.failover --runs 20 [--backend postgres lease both]

Starts its own PostgreSQL (or uses SINGLETON_TEST_DSN) and, for the lease and both
backends, the test bed's etcd + kube-apiserver. Each group is 3 sidecars, each playing
a pod object (as in a cluster) with the backend's default timings. Measures:
- graceful handover without a gated app: SIGTERM to the leader -> another sidecar's /readyz 200;
- graceful handover of an exec-gated app (tests/data/acting_app.py, acting every 10 ms and
  writing each act to a log) that exits at once on SIGTERM, and of one that goes on acting
  for 0.8 s after SIGTERM, each asked two ways: SIGTERM to the leader's sidecar (a drain, as
  at a pod deletion) and ``POST /step-down`` on its control port (what ``singletonctl
  handover`` asks for, through the pod's annotation). Per run: the request -> another
  sidecar's /readyz 200, the request -> the new app's first act, the time without an actor
  (the old app's last act -> the new app's first) and whether two apps acted at once (the act
  log judged by singleton_testbed.ledger.judge_acts);
- SIGKILL failover: SIGKILL of the leader -> another sidecar's /readyz 200, without a gated
  app, and with one (the whole "pod" killed: sidecar, keeper and app; a takeover then waits
  until the dead holder's app is surely stopped: its stop bound, or the lease);
- start to campaigning: process start -> /leader answers;
- at rest: RSS and CPU of each sidecar (scraped once a second, as by Prometheus), and API
  requests per second for the whole group (counted in the API server's audit log over --rest-seconds).
Prints medians and p99 (nearest rank) over the runs, and every run's figures.
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
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from singleton_election.core.timings import BACKEND_DEFAULTS
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.harness.kubehelpers import create_pod
from singleton_testbed.harness.sidecars import SidecarProcess, one_leader, wait_for, wait_serving
from singleton_testbed.ledger import ActingReport, judge_acts, percentile
from singleton_testbed.postgres import PostgresServer

ACTING_APP = Path(__file__).resolve().parent.parent / "tests" / "data" / "acting_app.py"
SLOW_FINISH = 0.8
"""Seconds the slow app goes on acting after SIGTERM."""
SCENARIOS = ("graceful", "app", "slow-app", "kill", "kill-app", "start", "rest")


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


PORT_TAKEN = "address already in use"
START_ATTEMPTS = 3


Starter = Callable[[int], SidecarProcess]
"""Starts member ``index`` of one group."""


@contextmanager
def running(new_group: Callable[[], Starter], count: int) -> Iterator[list[SidecarProcess]]:
    """A group of ``count`` members, once all serve (``new_group()`` names a new group and
    returns what starts its members); every one stopped on exit. A group whose member could not
    bind the port it was given (``free_port`` hands out a port that is free when asked, which
    another process may take before the member binds it) is stopped and replaced by a new group,
    with new ports, a new lock and a new act log, up to ``START_ATTEMPTS`` times."""
    members: list[SidecarProcess] = []
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            start = new_group()
            members = []
            for index in range(count):
                members.append(start(index))
            try:
                wait_serving(members, 15)
                break
            except AssertionError:
                if attempt == START_ATTEMPTS or not any(PORT_TAKEN in m.log() for m in members if not m.alive()):
                    raise
                print(f"  a member's port was taken ({PORT_TAKEN}): starting a new group", flush=True)
                for member in members:
                    member.stop()
        yield members
    finally:
        for member in members:
            member.stop()


@dataclass(frozen=True)
class GatedApp:
    """``tests/data/acting_app.py`` behind the exec gate: it acts (appends ``<token> <pid>
    <monotonic>`` to the group's act log) every ``interval`` seconds and, after SIGTERM, for
    ``finish`` seconds more before it exits."""

    finish: float = 0.0
    interval: float = 0.01


def judge_act_log(path: Path) -> ActingReport:
    """The act log of ``acting_app.py`` judged by the ledger's acting rules
    (``singleton_testbed.ledger.judge_acts``): each line is an act of no duration, by the
    actor of its token. Times stay on the monotonic clock (as datetimes from its zero)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], start=1):
        token, pid, at = line.split()
        when = datetime.fromtimestamp(float(at), UTC)
        rows.append({"id": number, "token": int(token), "identity": "acting_app", "pid": int(pid),
                     "began_at": when, "ended_at": when, "max_seconds": 0.0})
    return judge_acts(rows)


def tokens_acting(path: Path) -> int:
    """How many tokens have acted so far in the act log."""
    return len({line.split(maxsplit=1)[0] for line in path.read_text().splitlines()}) if path.exists() else 0


@dataclass
class Handover:
    """One handover (or failover) of a gated app, in seconds from the request (or signal)."""

    ready: float
    """To another sidecar's /readyz 200."""
    first_act: float
    """To the new app's first act."""
    idle: float
    """The old app's last act to the new app's first (negative: both acted at once)."""
    overlaps: int
    """Pairs of tokens acting in intersecting time (``ActingReport.overlaps``)."""
    late_acts: int
    """Acts the old app began once the new one was acting."""
    log: str
    """The act log of the run."""


@dataclass
class Bench:
    backend: str
    dsn: str
    workdir: Path
    control_plane: ControlPlane | None
    namespace: str = "bench"
    app: GatedApp | None = None
    """Run this app behind each sidecar's exec gate (None: no gate, the sidecars alone)."""

    def group(self, count: int) -> AbstractContextManager[list[SidecarProcess]]:
        return running(self._new_group, count)

    def _new_group(self) -> Starter:
        group = "bench-" + uuid.uuid4().hex[:8]
        command: list[str] = []
        app_env: dict[str, str] = {}
        if self.app is not None:
            command = [sys.executable, str(ACTING_APP)]
            app_env = {"ACT_LOG": str(self.workdir / f"{group}.acts"), "ACT_FINISH": f"{self.app.finish:g}",
                       "ACT_INTERVAL": f"{self.app.interval:g}"}

        def start(index: int) -> SidecarProcess:
            env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": self.backend,
                   "SINGLETON_IDENTITY": f"b{index}-{uuid.uuid4().hex[:6]}", **app_env}
            if self.backend != "lease":
                env["SINGLETON_POSTGRES_DSN"] = self.dsn
            if self.control_plane is not None:
                name = f"{group}-{index}"
                pod = create_pod(self.control_plane, self.namespace, name)
                env.update({"KUBECONFIG": str(self.control_plane.info.kubeconfig),
                            "SINGLETON_NAMESPACE": self.namespace, "SINGLETON_POD_NAME": name,
                            "SINGLETON_POD_UID": pod["metadata"]["uid"]})
            return SidecarProcess(f"b{index}", env, self.workdir / f"{group}-{index}.log", command=command).start()

        return start

    def takeover(self, signum: int) -> float:
        with self.group(3) as members:
            leader = one_leader(members, timeout=20)
            others = [m for m in members if m is not leader]
            time.sleep(0.3)
            started = time.monotonic()
            leader.signal(signum)
            wait_for(lambda: any(m.ready() for m in others), 30, "a new ready leader", interval=0.001)
            return time.monotonic() - started

    def handover(self, how: str) -> Handover:
        """Ask the leader to hand over (``sigterm``: SIGTERM to its sidecar, as a pod deletion
        does; ``step-down``: ``POST /step-down``; ``sigkill``: SIGKILL of its whole "pod") once
        its app acts, and measure the new app's start from the act log (needs ``app``)."""
        assert self.app is not None
        with self.group(3) as members:
            leader = one_leader(members, timeout=20)
            log = Path(leader.env["ACT_LOG"])
            others = [m for m in members if m is not leader]
            wait_for(lambda: tokens_acting(log) >= 1, 15, "the leader's app to act")
            time.sleep(0.3)
            started = time.monotonic()
            if how == "step-down":
                status, body = leader.control("POST", "/step-down?reason=benchmark")
                assert status == 202, (status, body)
            elif how == "sigterm":
                leader.signal_sidecar_only(signal.SIGTERM)
            else:
                leader.signal(signal.SIGKILL)
            wait_for(lambda: any(m.ready() for m in others), 30, "a new ready leader", interval=0.001)
            ready = time.monotonic() - started
            wait_for(lambda: tokens_acting(log) >= 2, 30, "the new leader's app to act", interval=0.005)
            time.sleep(0.2)  # an old app still acting (it must not) would show by now
            report = judge_act_log(log)
        first = report.actors[1].first.timestamp() if len(report.actors) > 1 else float("nan")
        idle = report.handovers[0].seconds if report.handovers else float("nan")
        return Handover(ready=ready, first_act=first - started, idle=idle, overlaps=len(report.overlaps),
                        late_acts=sum(o.late_acts for o in report.overlaps), log=str(log))

    def start(self) -> float:
        """The sidecar process's start -> its ``/leader`` answering (creating its pod object, for
        the Lease backends, comes before and is not counted)."""
        with self.group(1) as members:
            wait_for(lambda: members[0].leader_doc() is not None, 15, "the sidecar to answer", interval=0.005)
            return time.monotonic() - members[0].started_at

    def rest(self, seconds: float) -> tuple[list[float], list[float], float | None]:
        with self.group(3) as members:
            one_leader(members, timeout=20)
            time.sleep(2)
            pids = [m.popen.pid for m in members if m.popen is not None]
            before = [cpu_seconds(p) for p in pids]
            audit_from = self._audit_size()
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # scraped once a second, as by Prometheus
                for member in members:
                    kind = member.scrape()[0]
                    assert kind.startswith("application/openmetrics-text;"), kind
                time.sleep(max(0.0, min(1.0, end - time.monotonic())))
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


@dataclass
class BackendResult:
    """Every run's figures for one backend (seconds)."""

    backend: str
    graceful: list[float] = field(default_factory=list)
    """No gated app: SIGTERM to the leader -> another sidecar ready."""
    kill: list[float] = field(default_factory=list)
    """No gated app: SIGKILL of the leader -> another sidecar ready."""
    handovers: dict[str, list[Handover]] = field(default_factory=dict)
    """By scenario (``HANDOVER_LABELS``'s keys): gated apps handing over or killed."""
    start: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    requests: float | None = None


HANDOVER_LABELS = {
    "app sigterm": "app exiting at once, SIGTERM to the sidecar",
    "app step-down": "app exiting at once, POST /step-down",
    "slow-app sigterm": f"app acting {SLOW_FINISH:g} s after SIGTERM, SIGTERM to the sidecar",
    "slow-app step-down": f"app acting {SLOW_FINISH:g} s after SIGTERM, POST /step-down",
    "app sigkill": "SIGKILL of the pod (sidecar, keeper, app)",
}


def print_handovers(name: str, runs: list[Handover]) -> None:
    print(f"{HANDOVER_LABELS[name]}:")
    print("  " + summary("request -> new leader ready", [h.ready for h in runs]))
    print("  " + summary("request -> new app's first act", [h.first_act for h in runs]))
    print("  " + summary("without an actor (last -> first act)", [h.idle for h in runs]))
    overlapping = [h for h in runs if h.overlaps]
    print(f"  {'runs with two apps acting at once':<34} {len(overlapping)} of {len(runs)}"
          + "".join(f"\n    overlap ({h.overlaps}, {h.late_acts} late acts): {h.log}" for h in overlapping))
    print("  runs (ready / first act / without an actor, ms): " + ", ".join(
        f"{h.ready * 1000:.1f}/{h.first_act * 1000:.1f}/{h.idle * 1000:.1f}" for h in runs))


def run_backend(bench: Bench, runs: int, rest_seconds: float, scenarios: list[str]) -> BackendResult:
    """Measure one backend and print its figures (each scenario's as soon as it is done)."""
    result = BackendResult(bench.backend)
    quick, slow = replace(bench, app=GatedApp()), replace(bench, app=GatedApp(finish=SLOW_FINISH))

    def done(name: str, values: list[float]) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {bench.backend}: {summary(name, values)}", flush=True)

    if "graceful" in scenarios:
        result.graceful = [bench.takeover(signal.SIGTERM) for _ in range(runs)]
        done("graceful handover (SIGTERM), no app", result.graceful)

    def handovers(name: str, variant: Bench, how: str) -> None:
        result.handovers[name] = [variant.handover(how) for _ in range(runs)]
        done(f"{name}: -> ready", [h.ready for h in result.handovers[name]])

    for scenario, variant in (("app", quick), ("slow-app", slow)):
        if scenario in scenarios:
            handovers(f"{scenario} sigterm", variant, "sigterm")
            handovers(f"{scenario} step-down", variant, "step-down")
    if "kill" in scenarios:
        result.kill = [bench.takeover(signal.SIGKILL) for _ in range(runs)]
        done("SIGKILL failover, no app", result.kill)
    if "kill-app" in scenarios:
        handovers("app sigkill", quick, "sigkill")
    if "start" in scenarios:
        result.start = [bench.start() for _ in range(min(runs, 10))]
    if "rest" in scenarios:
        result.rss, result.cpu, result.requests = bench.rest(rest_seconds)
    print_backend(result, rest_seconds)
    return result


def print_backend(result: BackendResult, rest_seconds: float) -> None:
    timings = BACKEND_DEFAULTS[result.backend]
    print(f"\n{result.backend} backend, 3 sidecars, timings lease {timings.lease_duration:g} s / renew deadline "
          f"{timings.renew_deadline:g} s / retry {timings.retry_period:g} s, {os.cpu_count()} CPUs")
    if result.graceful:
        print(summary("graceful handover (SIGTERM), no app", result.graceful))
    for name, handovers in result.handovers.items():
        print_handovers(name, handovers)
    if result.kill:
        print(summary("SIGKILL failover, no app", result.kill))
    if result.start:
        print(summary("start to answering /leader", result.start))
    if result.rss:
        print(f"{'RSS at rest (3 sidecars)':<34} " + ", ".join(f"{v:.1f} MB" for v in result.rss))
        print(f"{'CPU at rest (3 sidecars)':<34} " + ", ".join(f"{v * 100:.2f} %" for v in result.cpu))
    if result.requests is not None:
        print(f"{'API requests/s at rest (group)':<34} {result.requests:.3f} over {rest_seconds:g} s")
    sys.stdout.flush()


def print_table(results: list[BackendResult]) -> None:
    """The handover figures of every backend as one Markdown table (median / p99)."""
    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values) * 1000:.1f} / {percentile(values, 0.99) * 1000:.1f} ms"

    print("\n| figure, median / p99 | " + " | ".join(r.backend for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| graceful handover, no app: SIGTERM → new leader ready | "
          + " | ".join(cell(r.graceful) for r in results) + " |")
    for name, label in HANDOVER_LABELS.items():
        if not any(name in r.handovers for r in results):
            continue
        for what, attr in (("→ new leader ready", "ready"), ("→ new app's first act", "first_act"),
                           ("time without an actor", "idle")):
            print(f"| {label}: {what} | " + " | ".join(
                cell([getattr(h, attr) for h in r.handovers.get(name, [])]) for r in results) + " |")
        print(f"| {label}: runs with two apps acting at once | " + " | ".join(
            f"{sum(1 for h in r.handovers[name] if h.overlaps)} of {len(r.handovers[name])}"
            if name in r.handovers else "-" for r in results) + " |")
    print("| SIGKILL failover, no app: → new leader ready | " + " | ".join(cell(r.kill) for r in results) + " |")
    sys.stdout.flush()


def plot_backends(measured: list[BackendResult], folder: Path) -> None:
    """``backends-graceful.png`` and ``backends-sigkill.png``: per backend, without a gated app
    and with the app that exits at once (graceful: SIGTERM to the sidecar; SIGKILL: the pod)."""
    from benchmarks.compare_clientgo import PeerResult, plot  # matplotlib only when asked

    def triple(backend: str) -> tuple[float, float, float]:
        t = BACKEND_DEFAULTS[backend]
        return t.lease_duration, t.renew_deadline, t.retry_period

    results = []
    for r in measured:
        results.append(PeerResult(r.backend, f"{r.backend}\nno app", "singleton-sidecar", triple(r.backend),
                                  r.graceful, r.kill))
        app = PeerResult(f"{r.backend}-app", f"{r.backend}\ngated app", "singleton-sidecar", triple(r.backend),
                         [h.ready for h in r.handovers.get("app sigterm", [])],
                         [h.ready for h in r.handovers.get("app sigkill", [])])
        if app.graceful or app.kill:
            results.append(app)
    for path in plot(results, folder, prefix="backends"):
        print(f"plot: {path}")


def load(path: Path) -> list[BackendResult]:
    """A ``--json`` file's results."""
    results = []
    for saved in json.loads(path.read_text()):
        handovers = {name: [Handover(**h) for h in runs] for name, runs in saved.pop("handovers").items()}
        results.append(BackendResult(**saved, handovers=handovers))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario (default 20)")
    parser.add_argument("--backend", nargs="+", choices=["postgres", "lease", "both"],
                        default=["postgres", "lease", "both"], help="backends to measure (default: all)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="what to measure (default: all): graceful and kill without a gated app, app and "
                             "slow-app handovers (SIGTERM and step-down), kill-app, start, rest")
    parser.add_argument("--rest-seconds", type=float, default=300.0,
                        help="how long to watch an idle group (default 300: at least the sidecars' watch "
                             "timeouts, so the re-opened watches are counted)")
    parser.add_argument("--plots", type=Path, default=None, metavar="DIR",
                        help="also draw the failover-time distributions per backend into DIR (needs matplotlib)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every run's figures here")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="only print the table and draw the plots (--plots DIR) of a --json file")
    args = parser.parse_args()
    if args.replot is not None:
        measured = load(args.replot)
    else:
        measured = []
        with bench_servers("singleton-bench-") as (dsn, control_plane, workdir):
            print(f"logs and act logs in {workdir}", flush=True)
            for backend in args.backend:
                # postgres runs as it would on a VM: no API server involved at all.
                plane = None if backend == "postgres" else control_plane
                measured.append(run_backend(Bench(backend, dsn, workdir, plane), args.runs, args.rest_seconds,
                                            args.scenarios))
    print_table(measured)
    if args.json is not None and args.replot is None:
        args.json.write_text(json.dumps([asdict(r) for r in measured], indent=1))
    if args.plots is not None:
        plot_backends(measured, args.plots)
    return 0


@contextmanager
def bench_servers(prefix: str, *, advertise_address: str | None = None) -> Iterator[tuple[str, ControlPlane, Path]]:
    """PostgreSQL (or SINGLETON_TEST_DSN's), etcd + kube-apiserver with a ``bench`` namespace,
    and a work folder: (dsn, control plane, folder). Stopped on exit. ``advertise_address``:
    the ``kubernetes`` Service's endpoint (a real node's IP, for pods to reach the API server)."""
    server, control_plane = None, None
    dsn = os.environ.get("SINGLETON_TEST_DSN")
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        if not dsn:
            server = PostgresServer()
            dsn = server.start().dsn
        binaries = find_all()
        add_to_path(binaries)
        control_plane = ControlPlane(binaries, advertise_address=advertise_address)
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
