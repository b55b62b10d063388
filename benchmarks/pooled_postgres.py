"""A thousand groups on one default-sized PostgreSQL: the pooled mode through PgBouncer, and
how far the session mode goes on the same server.

    .venv/bin/python -m benchmarks.pooled_postgres --runs 3 --plot          # 1,000 groups x 3, pooled
    .venv/bin/python -m benchmarks.pooled_postgres --session-capacity       # the session mode's limit

Starts its own PostgreSQL (``max_connections = 100``, ``superuser_reserved_connections`` 3:
the defaults) and a PgBouncer in transaction mode in front of it (a pool of ``--pool-size``
server connections for every client). 3,000 sidecar processes do not fit on a 2-core
machine, so the candidates run as the real thing minus the process: each is a
``PooledPostgresBackend`` and an ``Elector`` (the sidecar's own election core, default
postgres timings 6/4/2 s), ``--workers`` processes holding ``groups x replicas / workers``
of them each. A group's replicas live in different processes.

Per run:
- every candidate starts within ``--spread`` seconds; after a warm-up, ``--rest`` seconds at
  rest, during which every renewal's latency is recorded (the elector's own measure: request
  to answer, with the worker's event loop in it);
- then one worker process is SIGKILLed: its leaders (about a third of the groups) crash
  without releasing, as their pods would; the crash failover of each is the time from the
  kill to another candidate beginning to act (read from the survivors' records; all on one
  machine, one monotonic clock);
- ``--ledger-groups`` groups run an app with each candidate: while its elector says it may
  act, it logs each act (``singleton_testbed.actlog``) and writes a fenced ledger row; the
  ledger checker (``singleton_testbed.ledger.check_ledger``) then judges overlaps of acts and
  of fenced writes. Besides, the survivors' acting intervals of every group are checked for
  overlaps;
- the server connections in use (``pg_stat_activity``) are sampled every second;
- the CPU the worker processes (the candidates themselves) used during the rest, as a share of
  the machine (every core).

``--session-capacity`` adds groups of 3 session-mode candidates (``PostgresBackend``, direct
connections) one at a time until one cannot connect, and reports the connections per group
and the largest number of groups the server carried.

Prints each run's figures, then medians over the runs and p99 (nearest rank) over every sample;
``--json`` writes every run's figures (``RunFigures``, every sample included) and the settings;
``--plot`` draws each run's distributions (renewals, crash failovers) with the goals into
``benchmarks/plots/pooled-postgres.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg

from benchmarks.failover import cpu_seconds
from singleton_election.backends.postgres.connection import ensure_schema
from singleton_election.backends.postgres.pooled_mode import PooledPostgresBackend
from singleton_election.backends.postgres.session_mode import PostgresBackend
from singleton_election.backends.postgres.sql import Statements
from singleton_election.core.elector import Elector
from singleton_election.core.lock import Identity
from singleton_election.core.status import ElectionStatus, Role
from singleton_election.core.timings import Timings
from singleton_sdk.asyncpg import StaleToken, fence
from singleton_testbed.actlog import FAILED, REFUSED, WRITTEN, ActLog, create_tables
from singleton_testbed.ledger import check_ledger, percentile
from singleton_testbed.pgbouncer import PgBouncer
from singleton_testbed.postgres import PostgresServer

TIMINGS = Timings(lease_duration=6.0, renew_deadline=4.0, retry_period=2.0)  # the postgres defaults
RENEW_GOAL_MS = 50.0  # issue 15: renew p99 at 1,000 groups
PLOT = Path(__file__).resolve().parent / "plots" / "pooled-postgres.png"
ACT_MAX_SECONDS = 0.5  # an act never ended (its worker was killed mid-act) counts this long


# --- a worker process: many candidates ----------------------------------------------------------


@dataclass
class Candidate:
    group: str
    identity: str
    elector: Elector
    backend: PooledPostgresBackend
    acting: list[list[float | int | None]] = field(default_factory=list)  # [token, began, ended]
    deadline: float = 0.0  # the term's deadline as the gates are told it (0: none)


async def ledger_app(candidate: Candidate, dsn: str, stop: asyncio.Event) -> None:
    """Acts while its elector says it may (the gate's rule), each act logged, each write fenced."""
    act_conn = await asyncpg.connect(dsn, statement_cache_size=0)
    write_conn = await asyncpg.connect(dsn, statement_cache_size=0)
    log = ActLog(act_conn, candidate.group, candidate.identity, 0, ACT_MAX_SECONDS)
    item = 0
    try:
        while not stop.is_set():
            term = candidate.elector.acting_term()
            if term is None:
                await asyncio.sleep(0.01)
                continue
            decided = time.time()
            for phase in ("start", "done"):
                act = await log.begin(item, phase, token=term.token, decided=decided)
                outcome = WRITTEN
                try:
                    async with write_conn.transaction():
                        await fence(write_conn, key=candidate.group, token=term.token)
                        await write_conn.execute(
                            "INSERT INTO ledger (group_name, identity, token, item, phase) VALUES ($1, $2, $3, $4, $5)",
                            candidate.group, candidate.identity, term.token, item, phase)
                except StaleToken:
                    outcome = REFUSED
                except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    outcome = FAILED
                await log.end_quietly(act, time.time(), outcome)
                decided = time.time()
                if candidate.elector.acting_term() is None:
                    break
            item += 1
            await asyncio.sleep(0.05)
    finally:
        await act_conn.close()
        await write_conn.close()


async def worker(config: dict[str, Any]) -> dict[str, Any]:
    renewals: list[tuple[float, float, bool]] = []
    candidates: list[Candidate] = []
    for group, identity in config["candidates"]:
        backend = PooledPostgresBackend(group=group, dsn=config["dsn"], timings=TIMINGS)
        elector = Elector(group=group, identity=Identity(identity), backend=backend, timings=TIMINGS,
                          wall_clock=time.time,
                          on_renew=lambda seconds, ok: renewals.append((time.monotonic(), seconds, ok)))
        candidate = Candidate(group, identity, elector, backend)

        def follow(status: ElectionStatus, candidate: Candidate = candidate) -> None:
            acting = status.role in (Role.LEADER, Role.DRAINING)
            open_span = candidate.acting and candidate.acting[-1][2] is None
            if acting and not open_span and status.term is not None:
                candidate.acting.append([status.term.token, time.monotonic(), None])
            elif not acting and open_span:
                # A gate stops at the term's deadline even when the loop that publishes the
                # step-down runs late (a busy worker): acting ends at the earlier of the two.
                candidate.acting[-1][2] = min(time.monotonic(), candidate.deadline or float("inf"))

        def track(deadline: float, candidate: Candidate = candidate) -> None:
            if deadline > 0:
                candidate.deadline = deadline

        elector.add_listener(follow)
        elector.add_deadline_listener(track)
        candidates.append(candidate)
    # In a random order, so that which worker leads a group is left to chance, as with pods
    # started by a Deployment: the killed worker then leads about its share of the groups.
    random.shuffle(candidates)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    step = config["spread"] / max(len(candidates), 1)
    for candidate in candidates:
        tasks.append(asyncio.create_task(candidate.elector.run()))
        if candidate.group in config["ledger_groups"]:
            tasks.append(asyncio.create_task(ledger_app(candidate, config["dsn"], stop)))
        await asyncio.sleep(step)
    await asyncio.sleep(max(config["end_at"] - time.monotonic(), 0))
    stop.set()
    for candidate in candidates:
        candidate.elector.request_drain()
    await asyncio.wait(tasks, timeout=30)
    await asyncio.gather(*(candidate.backend.close() for candidate in candidates))
    for candidate in candidates:  # still leading when the run ended: acting until its deadline at most
        if candidate.acting and candidate.acting[-1][2] is None:
            candidate.acting[-1][2] = min(time.monotonic(), candidate.deadline or float("inf"))
    return {
        "renewals": renewals,
        "acting": {f"{c.group} {c.identity}": c.acting for c in candidates},
        "pooler_connections": sum(1 for c in candidates if c.backend.through_pooler),
    }


# --- the pooled run --------------------------------------------------------------------------------


@dataclass
class RunFigures:
    renew_ms: list[float]
    renew_failures: int
    failover_s: list[float]
    orphaned_groups: int
    peak_server_connections: int
    overlaps: int
    ledger_acts: int
    ledger_safe: bool
    killed_leaders: int
    pooler_connections: int
    candidates_cpu_share: float
    """CPU seconds the worker processes used during the rest, over the rest's seconds times the
    machine's cores: the share of the whole machine the candidates themselves took."""


async def sample_connections(admin_dsn: str, peaks: list[int], stop: asyncio.Event) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        while not stop.is_set():
            count = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE usename = 'singleton'")
            peaks.append(int(count))
            await asyncio.sleep(1.0)
    finally:
        await conn.close()


async def pooled_run(args: argparse.Namespace, number: int, bouncer: PgBouncer, admin_dsn: str, app_dsn: str
                     ) -> RunFigures:
    groups = [f"run{number}-{index:04d}" for index in range(args.groups)]
    ledger_groups = groups[:: max(args.groups // max(args.ledger_groups, 1), 1)][: args.ledger_groups]
    setup = await asyncpg.connect(app_dsn)
    try:
        await create_tables(setup)
        # The lease table exists, as it does once a database has had its first group: 3,000
        # candidates finding it missing at once would all queue for the schema's lock.
        await ensure_schema(setup, Statements.build("public", "singleton_leases"), "setup")
    finally:
        await setup.close()
    start = time.monotonic()
    warm_until = start + args.spread + TIMINGS.lease_duration + 5
    kill_at = warm_until + args.rest
    end_at = kill_at + TIMINGS.lease_duration + TIMINGS.retry_period + 8
    shares: list[list[tuple[str, str]]] = [[] for _ in range(args.workers)]
    for index, group in enumerate(groups):
        for replica in range(args.replicas):
            shares[(index + replica) % args.workers].append((group, f"{group}/r{replica}"))
    processes: list[asyncio.subprocess.Process] = []
    for share in shares:
        config = {"dsn": bouncer.dsn, "candidates": share, "ledger_groups": ledger_groups,
                  "spread": args.spread, "end_at": end_at}
        with open_log(f"{args.logs}/run{number}-worker{len(processes)}.log") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.pooled_postgres", "--worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log_file)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(config).encode())
        proc.stdin.close()
        processes.append(proc)
    outputs = [asyncio.create_task(proc.communicate()) for proc in processes]
    peaks: list[int] = []
    sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_connections(admin_dsn, peaks, sampling))
    await asyncio.sleep(warm_until - time.monotonic())
    cpu_from = sum(cpu_seconds(proc.pid) for proc in processes)
    await asyncio.sleep(kill_at - time.monotonic())
    cpu_share = (sum(cpu_seconds(proc.pid) for proc in processes) - cpu_from) / (args.rest * (os.cpu_count() or 1))
    victim = processes[number % len(processes)]
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    results = []
    for proc, output in zip(processes, outputs, strict=True):
        stdout, _ = await output
        if proc is not victim:
            if proc.returncode != 0:
                raise RuntimeError(f"a worker failed with status {proc.returncode}: see {args.logs}")
            results.append(json.loads(stdout))
    sampling.set()
    await sampler
    renewals = [(at, s * 1000, ok) for result in results for at, s, ok in result["renewals"] if at >= warm_until]
    spans: dict[str, list[tuple[int, float, float]]] = {}
    for result in results:
        for key, acting in result["acting"].items():
            spans.setdefault(key.split(" ", 1)[0], []).extend(
                (int(t), float(b), float(e) if e is not None else end_at) for t, b, e in acting)
    terms = judge_terms(groups, spans, killed_at)
    acts, ledger_safe = 0, True
    for group in ledger_groups:
        report = await check_ledger(admin_dsn, group)
        ledger_safe = ledger_safe and report.safe
        acts += len(report.acting.actors) if report.acting is not None else 0
    return RunFigures(renew_ms=[ms for at, ms, ok in renewals if ok and at < kill_at],
                      renew_failures=sum(1 for _at, _ms, ok in renewals if not ok),
                      failover_s=terms.failover, orphaned_groups=terms.orphaned,
                      peak_server_connections=max(peaks, default=0), overlaps=terms.overlaps, ledger_acts=acts,
                      ledger_safe=ledger_safe, killed_leaders=terms.killed_leaders,
                      pooler_connections=sum(r["pooler_connections"] for r in results),
                      candidates_cpu_share=cpu_share)


def open_log(path: str) -> BinaryIO:
    return open(path, "wb")  # closed by the caller's with


@dataclass
class Terms:
    overlaps: int = 0
    """Two survivors' acting spans of one group that intersect."""
    killed_leaders: int = 0
    """Groups no survivor led when the worker was killed: the killed worker led them."""
    failover: list[float] = field(default_factory=list)
    """Per killed leader: seconds from the kill until a survivor began acting."""
    orphaned: int = 0
    """Killed leaders whose group got no new leader before the run ended."""


def judge_terms(groups: Sequence[str], spans: dict[str, list[tuple[int, float, float]]], killed_at: float) -> Terms:
    terms = Terms()
    for group in groups:
        # A term whose deadline passed before it was published (its acquisition's answer came
        # late) never acted: its gate's check fails at once. Such spans are empty.
        ordered = sorted((span for span in spans.get(group, []) if span[2] > span[1]), key=lambda span: span[1])
        reach: tuple[int, float] | None = None  # (token, end) of the span that reaches furthest so far
        for token, began, ended in ordered:
            if reach is not None and began < reach[1] and token != reach[0]:
                terms.overlaps += 1
                print(f"acting overlap in {group}: token {token} began {reach[1] - began:.3f}s before token "
                      f"{reach[0]} stopped; spans {ordered}", file=sys.stderr, flush=True)
            if reach is None or ended > reach[1]:
                reach = (token, ended)
        if any(began <= killed_at < ended for _token, began, ended in ordered):
            continue
        terms.killed_leaders += 1
        after = [began for _token, began, _ended in ordered if began > killed_at]
        if after:
            terms.failover.append(min(after) - killed_at)
        else:
            terms.orphaned += 1
    return terms


def show(label: str, values: Sequence[float], unit: str) -> str:
    if not values:
        return f"{label}: none"
    return (f"{label}: p50 {statistics.median(values):.1f} {unit}, p99 {percentile(values, 0.99):.1f} {unit}, "
            f"max {max(values):.1f} {unit} ({len(values)} samples)")


async def pooled(args: argparse.Namespace) -> None:
    server = PostgresServer(max_connections=100)
    info = server.start()
    try:
        settings = {"default_pool_size": str(args.pool_size), "max_db_connections": str(args.pool_size),
                    "max_client_conn": "6000"}
        with PgBouncer(info, pool_mode="transaction", settings=settings) as bouncer:
            figures = []
            for number in range(args.runs):
                run = await pooled_run(args, number, bouncer, info.admin_dsn, info.dsn)
                figures.append(run)
                print(f"run {number + 1}: {show('renew', run.renew_ms, 'ms')}; renew failures {run.renew_failures}; "
                      f"{show('crash failover', run.failover_s, 's')} of {run.killed_leaders} killed leaders, "
                      f"{run.orphaned_groups} without a new leader; peak server connections "
                      f"{run.peak_server_connections}; acting overlaps {run.overlaps}; ledger groups safe "
                      f"{run.ledger_safe} ({run.ledger_acts} terms acted); surviving candidates behind the pooler "
                      f"{run.pooler_connections}; the candidates' CPU at rest "
                      f"{100 * run.candidates_cpu_share:.1f} % of {os.cpu_count()} cores", flush=True)
            print(f"\n{args.groups} groups x {args.replicas}, {args.workers} worker processes, pool {args.pool_size}, "
                  f"{args.runs} runs:")
            p50s = [statistics.median(f.renew_ms) for f in figures if f.renew_ms]
            p99s = [percentile(f.renew_ms, 0.99) for f in figures if f.renew_ms]
            if p50s:
                print(f"  renew, median of the runs' p50: {statistics.median(p50s):.1f} ms, "
                      f"of their p99: {statistics.median(p99s):.1f} ms")
            print(" ", show("renew, all runs", [v for f in figures for v in f.renew_ms], "ms"))
            print(" ", show("crash failover, all runs", [v for f in figures for v in f.failover_s], "s"))
            print("  renew failures:", sum(f.renew_failures for f in figures),
                  "; groups left without a leader:", sum(f.orphaned_groups for f in figures),
                  "; acting overlaps:", sum(f.overlaps for f in figures),
                  "; ledger safe in every run:", all(f.ledger_safe for f in figures),
                  "; peak server connections:", max(f.peak_server_connections for f in figures))
            if args.plot is not None:
                print("  plot:", plot(figures, args))
            if args.json is not None:
                args.json.write_text(json.dumps(to_json(figures, args), indent=1))
    finally:
        server.cleanup()


def to_json(figures: Sequence[RunFigures], args: argparse.Namespace) -> dict[str, Any]:
    """Every run's figures and what they were measured with."""
    settings = {name: getattr(args, name) for name in ("groups", "replicas", "workers", "pool_size", "runs", "spread",
                                                        "rest", "ledger_groups")}
    return {**settings, "cores": os.cpu_count(), "timings": asdict(TIMINGS), "renew_goal_ms": RENEW_GOAL_MS,
            "figures": [asdict(f) for f in figures]}


def plot(figures: Sequence[RunFigures], args: argparse.Namespace) -> Path:
    """Each run's renewal latencies and crash failovers as distributions, with the goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (renew_ax, failover_ax) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    for number, run in enumerate(figures, start=1):
        for ax, values in ((renew_ax, run.renew_ms), (failover_ax, run.failover_s)):
            if values:
                ordered = sorted(values)
                ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                        label=f"run {number} ({len(ordered)})")
    renew_ax.axvline(RENEW_GOAL_MS, color="red", linestyle="--", label=f"goal: p99 ≤ {RENEW_GOAL_MS:g} ms")
    renew_ax.set_xscale("log")
    renew_ax.set_xlabel("renewal: request → answer (ms, log scale)")
    renew_ax.set_title("Renewals at rest", fontsize=10)
    bound = TIMINGS.lease_duration + TIMINGS.retry_period
    failover_ax.axvline(bound, color="red", linestyle="--", label=f"goal: ≤ lease + retry ({bound:g} s)")
    failover_ax.set_xlabel("worker SIGKILLed → a survivor acts (s)")
    failover_ax.set_title("Crash failover of the killed leaders", fontsize=10)
    for ax in (renew_ax, failover_ax):
        ax.set_ylabel("fraction of samples")
        ax.axhline(0.99, color="grey", linewidth=0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Pooled mode: {args.groups} groups x {args.replicas} through PgBouncer (pool {args.pool_size}), "
                 f"PostgreSQL max_connections 100, {os.cpu_count()} CPUs", fontsize=10)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot)
    plt.close(fig)
    path: Path = args.plot
    return path


# --- the session mode's capacity ---------------------------------------------------------------------


async def session_capacity(args: argparse.Namespace) -> None:
    server = PostgresServer(max_connections=100)
    info = server.start()
    electors: list[tuple[Elector, PostgresBackend]] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        reserved = int(server.psql("SHOW superuser_reserved_connections").strip())
        carried = 0
        for index in range(args.session_max_groups):
            group = f"session-{index:03d}"
            added = []
            for replica in range(args.replicas):
                backend = PostgresBackend(group=group, dsn=info.dsn, timings=TIMINGS)
                elector = Elector(group=group, identity=Identity(f"{group}/r{replica}"), backend=backend,
                                  timings=TIMINGS, wall_clock=time.time)
                added.append((elector, backend))
                tasks.append(asyncio.create_task(elector.run()))
            electors.extend(added)
            await asyncio.sleep(1.0)
            failing = [e for e, _b in added if "unavailable" in e.status.reason]
            leaders = sum(1 for e, _b in added if e.is_ready_leader())
            if failing or leaders != 1:
                print(f"group {index + 1}: {len(failing)} of its candidates cannot connect "
                      f"({failing[0].status.reason[:160] if failing else 'no leader'})")
                break
            carried = index + 1
        count = int(server.psql("SELECT count(*) FROM pg_stat_activity WHERE usename = 'singleton'").strip())
        print(f"session mode, max_connections 100, superuser_reserved_connections {reserved}: carried {carried} "
              f"groups of {args.replicas}; {count} server connections in use with {carried + 1} groups started "
              f"({count / (carried + 1):.2f} per group)")
    finally:
        for elector, _backend in electors:
            elector.request_drain()
        await asyncio.wait(tasks, timeout=30)
        await asyncio.gather(*(backend.close() for _elector, backend in electors))
        server.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--workers", type=int, default=6, help="processes holding the candidates")
    parser.add_argument("--pool-size", type=int, default=30, help="PgBouncer's server connections")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spread", type=float, default=15.0, help="seconds over which the candidates start")
    parser.add_argument("--rest", type=float, default=30.0, help="seconds at rest, renewals measured")
    parser.add_argument("--ledger-groups", type=int, default=10)
    parser.add_argument("--session-capacity", action="store_true", help="measure the session mode's limit instead")
    parser.add_argument("--session-max-groups", type=int, default=60)
    parser.add_argument("--logs", default="/tmp", help="folder for the worker processes' logs (stderr)")
    parser.add_argument("--plot", type=Path, nargs="?", const=PLOT, default=None, metavar="PNG",
                        help=f"draw the runs' distributions into PNG (without a value: {PLOT})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every run's figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'")
    if args.worker:
        result = asyncio.run(worker(json.loads(sys.stdin.read())))
        sys.stdout.write(json.dumps(result))
        return
    if args.session_capacity:
        asyncio.run(session_capacity(args))
    else:
        asyncio.run(pooled(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
