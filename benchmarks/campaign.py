"""A seeded fault-injection campaign against groups of 3 sidecar pods, judged by what the apps
did (the act log) and by the fenced ledger.

    .venv/bin/python -m benchmarks.campaign [--backend postgres lease both] [--faults N | --duration S]
                                            [--seed S] [--quick] [--kinds K ...] [--segment-faults N] [--nodes 2]
                                            [--variants exec/fenced file/unfenced ...] [--fence off]
                                            [--worker-env NAME=VALUE ...] [--json PATH] [--workdir DIR] [--keep]

Needs root and the test bed's binaries, and a machine that can run the real node
(``singleton_testbed.node``: containerd, runc, the CNI plugins, buildah for the images). It
starts its own PostgreSQL, etcd + kube-apiserver (with the SingletonService CRD) and controllers,
and the real node with the project's image and the test-apps image (it restarts the servers),
then, for each backend in turn, runs groups of 3 pods one after the other, a **segment** each
(``--segment-faults`` faults, then a new group of the next variant): exec gate or file gate (the
operator's pod for ``gating: {mode: file}``), the ledger worker fenced or not, each pod's app
finishing in 0..1 s after SIGTERM with 0..2 children and one worker it detaches (``setsid``,
``Popen(start_new_session=True)`` or a daemon's double fork: out of the app's process group, so
that only the gate's reach stops it), one slow pod whose drain timeout is shorter than its app's
finishing time (``campaign_bed``). It injects faults of the kinds that apply to the
backend (``campaign_faults``) in a seeded random order (every kind once per round, as the leaders
allow) at seeded random moments. Before each fault the group must have settled (every pod
answering, one ready leader, its worker writing), bounded at 45 s. After each segment the checker
(``singleton_testbed.ledger``) reads the act log (every act any worker began, refused by the fence
or not) and the fenced ledger.

Prints, per backend, its segments and a table per fault kind (acting overlaps that are failures,
acts in flight through a freeze, idle gap without an acting app p50/p99/max, fenced overlaps,
regressions, stale writes accepted, failover p50/p99/max, how much of it was a server's own
restart, how often a new term began, the largest ledger gap and how many exceeded the promised
bound, the longest wait from a new leader's first ready answer to its worker's first row, items
lost in flight), a table per path (how the old term ended) over all backends, a line on the
liveness goals, a line on the acts a whole-pod freeze caught mid-act that finished after the
successor began (how many, the latest how long after, and the rule: only a fence refuses those),
and a verdict (``campaign_report``): PASS needs 0 acting overlaps other than acts
in flight through a freeze, 0 fenced overlaps, 0 regressions, 0 stale writes accepted (fenced
segments), an act log to judge, every fault followed by a ready leader, and nothing lost at a
graceful deletion. The exit status is 0 on PASS.

``--quick`` (CI): as many faults per backend as kinds apply to it, in two segments (exec gate and
file gate on every backend, fenced and unfenced on every gate): each kind dealt once per backend
it applies to, but the API server and etcd restarts once per run (``QUICK_ONCE``: 13, 13 and 17
faults); a kind whose leader never came (``drain-timeout`` needs the slow pod to lead) is dealt in
further faults, up to twice the count.
``--faults N`` is the total over the backends, ``--duration S`` the total seconds of injecting;
with both, whichever ends first. ``--variants`` limits the segments to these variants (``exec`` or
``file``, ``/fenced`` or ``/unfenced``); ``--fence off`` runs every segment unfenced.
``--worker-env`` passes options to every worker (``LEDGER_TX_SECONDS``: work inside each fenced
transaction; ``LEDGER_DEADLINE_CHECK=off``: workers that cannot check their deadline, which a
frozen pod's thaw then catches acting: deliberately unsafe). The Python API is
``run_campaign(CampaignOptions(...))``, called from the main thread; the logs stay in the work
folder unless it passed. The seed fixes the variants' pods, the order of the faults, the moments and
the hold times; which pod leads when is up to the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import asyncpg

from benchmarks.campaign_bed import CHILD_ITEMS, DETACHED_CHILD, VARIANTS, Bed, Borrowed, CampaignError, Group, Variant
from benchmarks.campaign_faults import ALL_KINDS, APPLIES, NODE_KINDS, Deck, Injector
from benchmarks.campaign_poll import Poller
from benchmarks.campaign_report import BackendResult, CampaignResult, LoggedAct, Segment
from singleton_testbed.images import ImageBuildError
from singleton_testbed.ledger import check_ledger
from singleton_testbed.node import NodeError

BACKENDS = ("postgres", "lease", "both")
QUICK_SEGMENTS = 2
"""Quick mode: every kind that applies to a backend once, over this many groups."""
QUICK_ONCE = ("apiserver-restart", "etcd-restart")
"""Quick mode deals these once per run, not once per backend: the longest faults (the restart
itself, 8 to 16 s on 2 cores, and the kubelet's status sync after it), of servers the backends
share; each goes to one backend it applies to, in turn (lease, then both). So the quick run keeps
its time bound with the Lease faults of issue 31 added."""
DEFAULT_FAULTS_PER_BACKEND = 10
DEFAULT_SEGMENT_FAULTS = 25
SETTLE_TIMEOUT = 45.0


def parse_variant(text: str) -> Variant:
    """``exec/fenced``, ``file/unfenced``..."""
    gate, _, fence = text.partition("/")
    if gate not in ("exec", "file") or fence not in ("fenced", "unfenced"):
        raise ValueError(f"a variant is exec or file, then /fenced or /unfenced: got {text!r}")
    return Variant(gate, fence == "fenced")


def variant_for(backend_index: int, segment: int, variants: tuple[Variant, ...]) -> Variant:
    """Segments take the variants in turn, each backend two further on (with all four, a
    backend's first two segments are one exec and one file gate, one fenced and one not)."""
    return variants[(2 * backend_index + segment) % len(variants)]


@dataclass
class CampaignOptions:
    backends: tuple[str, ...] = BACKENDS
    faults: int | None = None
    """Total over the backends."""
    duration: float | None = None
    """Total seconds of injecting over the backends."""
    seed: int | None = None
    quick: bool = False
    fence: bool = True
    """False: every segment unfenced, whatever ``variants`` say."""
    variants: tuple[Variant, ...] = VARIANTS
    segment_faults: int | None = None
    """Faults per segment (group); default half the backend's faults in quick mode, else 25."""
    kinds: tuple[str, ...] | None = None
    """Only these fault types (where they apply)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the ledger worker (``tests/data/ledger_worker.py``'s options)."""
    workdir: Path | None = None
    keep: bool = False
    log: Callable[[str], None] = print
    borrowed: Borrowed | None = None
    """A test session's control plane and node to run on, instead of starting its own."""
    nodes: int = 1
    """2: the groups' pods spread over two real nodes, and the whole-node faults (``NODE_KINDS``)."""


def run_campaign(options: CampaignOptions) -> CampaignResult:
    """Run it from the main thread (the servers it restarts die with the thread that started them)."""
    seed = options.seed if options.seed is not None else random.randrange(1, 2**31)
    backends = options.backends
    per_backend = options.faults / len(backends) if options.faults is not None else None
    quick_counts = options.quick and per_backend is None and options.duration is None
    if per_backend is None and options.duration is None and not options.quick:
        per_backend = DEFAULT_FAULTS_PER_BACKEND
    counts: list[int | None] = [None] * len(backends)
    if quick_counts:
        counts = [len(_kinds(backend, options)) for backend in backends]
    elif per_backend is not None:
        counts = _fault_counts(options.faults, per_backend, backends)
    durations: list[float | None] = [None] * len(backends)
    if options.duration is not None:
        durations = [options.duration / len(backends)] * len(backends)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="singleton-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = CampaignResult(seed=seed, quick=options.quick)
    options.log(f"campaign seed {seed}, backends {' '.join(backends)}, workdir {workdir}")
    started = time.monotonic()
    bed = Bed(workdir, options.borrowed, two_nodes=options.nodes == 2)
    poller = Poller()
    try:
        bed.start()
        poller.start()
        options.log(f"test bed up in {time.monotonic() - started:.1f} s")
        for index, (backend, count, duration) in enumerate(zip(backends, counts, durations, strict=True)):
            result.backends.append(run_backend(bed, poller, backend, count=count, duration=duration, seed=seed,
                                               options=options, backend_index=index))
            poller.forget_all()
    finally:
        poller.stop()
        bed.stop()
    result.seconds = time.monotonic() - started
    if result.verdict_ok and not options.keep and options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        (workdir / "report.md").write_text(result.render() + "\n")
        options.log(f"logs kept in {workdir} (report.md, and pods' logs under pods/<namespace>/)")
    return result


def _kinds(backend: str, options: CampaignOptions) -> tuple[str, ...]:
    """The fault kinds that apply to ``backend``, limited to ``--kinds``; in quick mode each of
    ``QUICK_ONCE`` only on one of the run's backends it applies to, in turn."""
    def applies(kind: str, to: str) -> bool:
        where = (*APPLIES[to], *(NODE_KINDS if options.nodes == 2 else ()))
        return kind in where and (options.kinds is None or kind in options.kinds)

    def dealt_here(kind: str) -> bool:
        if not options.quick or kind not in QUICK_ONCE:
            return True
        takers = [b for b in options.backends if applies(kind, b)]
        return takers[QUICK_ONCE.index(kind) % len(takers)] == backend

    return tuple(k for k in (*APPLIES[backend], *NODE_KINDS) if applies(k, backend) and dealt_here(k))


def _fault_counts(total: int | None, per_backend: float, backends: tuple[str, ...]) -> list[int | None]:
    if total is None:
        return [round(per_backend)] * len(backends)
    base, extra = divmod(total, len(backends))
    return [base + (index < extra) for index in range(len(backends))]


def run_backend(bed: Bed, poller: Poller, backend: str, *, count: int | None, duration: float | None, seed: int,
                options: CampaignOptions, backend_index: int = 0) -> BackendResult:
    """The backend's segments, one group after the other, until ``count`` faults or ``duration``."""
    rng = random.Random(f"{seed}/{backend}")
    kinds = _kinds(backend, options)
    quick_segment = -(-(count or len(kinds)) // QUICK_SEGMENTS)  # ceil: the faults over QUICK_SEGMENTS groups
    per_segment = options.segment_faults or (quick_segment if options.quick else DEFAULT_SEGMENT_FAULTS)
    result = BackendResult(backend)
    deck = Deck(kinds, rng)
    started = time.monotonic()
    deadline = None if duration is None else started + duration
    done = 0

    def wanted() -> int | None:
        """Faults still to inject; quick mode goes on (up to twice its count) until every kind
        was dealt, since who leads, which decides what may be dealt, is up to the run."""
        if count is None:
            return None
        if options.quick and options.faults is None and deck.undealt and done < 2 * count:
            return max(count - done, len(deck.undealt))
        return count - done

    while kinds:
        left = wanted()
        if (left is not None and left <= 0) or (deadline is not None and time.monotonic() >= deadline):
            break
        variant = variant_for(backend_index, len(result.segments), options.variants)
        if not options.fence:
            variant = Variant(variant.gate, False)
        faults = per_segment if left is None else min(per_segment, left)
        segment = run_segment(bed, poller, backend, variant, len(result.segments), faults=faults, deadline=deadline,
                              rng=rng, deck=deck, seed=seed, options=options, total=count, before=done)
        result.segments.append(segment)
        done += len(segment.faults)
        if segment.aborted:
            break
    result.attribute()
    return result


def run_segment(bed: Bed, poller: Poller, backend: str, variant: Variant, index: int, *, faults: int,
                deadline: float | None, rng: random.Random, deck: Deck, seed: int, options: CampaignOptions,
                total: int | None, before: int) -> Segment:
    group = Group(bed, backend, poller, variant=variant, rng=random.Random(f"{seed}/{backend}/{index}"),
                  worker_env=dict(options.worker_env))
    segment = Segment(index, group.name, variant)
    started = time.monotonic()
    log = options.log
    idle = (0.2, 1.0) if options.quick else (0.3, 2.0)
    of = "" if total is None else f"/{total}"
    log(f"[{backend:<8}] segment {index + 1}: group {group.name}, {variant}")
    try:
        group.setup()
        group.wait_settled(60)
        injector = Injector(bed, group, poller, rng, index)
        while len(segment.faults) < faults and (deadline is None or time.monotonic() < deadline):
            time.sleep(rng.uniform(*idle))
            leader = group.wait_settled(SETTLE_TIMEOUT)
            kind = deck.deal(group.slow(leader.pod), group.on_second_node(leader.pod))
            record = injector.inject(kind, before + len(segment.faults), leader)
            segment.faults.append(record)
            log(f"[{backend:<8} {before + len(segment.faults):>3}{of}] {record.describe()}")
            group.wait_settled(SETTLE_TIMEOUT, since=time.time())
    except CampaignError as exc:
        segment.aborted = str(exc)
        log(f"[{backend}] aborted: {exc}")
    finally:
        segment.seconds = time.monotonic() - started
        segment.profiles = dict(group.profiles)
        group.teardown()
        try:
            segment.report = asyncio.run(check_ledger(bed.pg.info.admin_dsn, group.name))
            tokens = sorted({o.earlier for o in segment.report.acting_overlaps})
            segment.acts, segment.detached_acts, segment.detached_processes = asyncio.run(
                read_segment_acts(bed.pg.info.admin_dsn, group.name, tokens))
        except (OSError, asyncpg.PostgresError) as exc:
            segment.aborted = segment.aborted or f"ledger unreadable: {exc}"
    log(f"[{backend}] segment {index + 1} ({variant}): {len(segment.faults)} faults in {segment.seconds:.0f} s; "
        f"{segment.report.summary() if segment.report else '-'}")
    return segment


async def read_segment_acts(dsn: str, group: str, tokens: list[int]) -> tuple[list[LoggedAct], int, int]:
    """The acts of ``tokens`` (the earlier terms of the segment's acting overlaps: what
    ``campaign_report.caught_mid_act`` counts), and how many acts the detached workers logged, from
    how many processes."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT id, identity, token, pid, item, began_at, ended_at, max_seconds, decided_at, outcome FROM acts "
            "WHERE group_name = $1 AND token = ANY($2::bigint[]) ORDER BY id", group, tokens) if tokens else []
        detached = await conn.fetchrow(
            "SELECT count(*) AS acts, count(DISTINCT pid) AS pids FROM acts WHERE group_name = $1 "
            "AND item >= $2 AND item < $3", group, DETACHED_CHILD * CHILD_ITEMS, (DETACHED_CHILD + 1) * CHILD_ITEMS)
    except asyncpg.UndefinedTableError:
        return [], 0, 0  # no act log: the report says so
    finally:
        await conn.close()
    assert detached is not None  # an aggregate has one row
    return [LoggedAct.of(row) for row in rows], int(detached["acts"]), int(detached["pids"])


def to_json(result: CampaignResult) -> dict[str, object]:
    return {
        "seed": result.seed, "quick": result.quick, "seconds": result.seconds, "verdict": result.verdict(),
        "totals": {"faults": result.total_faults, "verdict_ok": result.verdict_ok,
                   "acting_overlaps": result.total_acting_failures, "inflight_through_freeze": result.total_inflight,
                   "fenced_overlaps": result.total_overlaps, "regressions": result.total_regressions,
                   "stale_accepted": result.total_stale, "unrecovered": len(result.unrecovered),
                   "caught_refused": sum(s.caught_refused for b in result.backends for s in b.stats.values()),
                   "caught_written": sum(s.caught_written for b in result.backends for s in b.stats.values())},
        "caught_mid_act": {"acts": result.total_caught, "latest_after_successor": result.caught_longest,
                           "freezes": result.freezes, "rule": result.caught_line()},
        "backends": [{
            "backend": b.backend, "seconds": b.seconds,
            "stats": {k: asdict(v) for k, v in b.stats.items()},
            "paths": {k: asdict(v) for k, v in b.paths.items()},
            "segments": [{
                "group": s.group, "gate": s.variant.gate, "fence": s.variant.fence, "seconds": s.seconds,
                "aborted": s.aborted, "profiles": {pod: asdict(p) for pod, p in s.profiles.items()},
                "ledger": s.report.summary() if s.report else None,
                "detached_acts": s.detached_acts, "detached_processes": s.detached_processes,
                "findings": s.findings,
                "acting_overlaps": [{"text": str(o), **asdict(o)} for o in (s.report.acting_overlaps
                                                                          if s.report else [])],
                "idle_gaps": [{"before": g.before, "after": g.after, "start": g.start.timestamp(),
                               "end": g.end.timestamp(), "seconds": g.seconds}
                              for g in (s.report.idle_gaps if s.report else [])],
                "gaps": [{"before": g.before, "after": g.after, "start": g.start.timestamp(),
                          "end": g.end.timestamp(), "seconds": g.seconds} for g in (s.report.gaps if s.report else [])],
                "faults": [asdict(f) for f in s.faults]} for s in b.segments]} for b in result.backends],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends, in this order (default: all three)")
    parser.add_argument("--faults", type=int, help="total faults over the backends")
    parser.add_argument("--duration", type=float, help="total seconds of injecting over the backends")
    parser.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    parser.add_argument("--quick", action="store_true",
                        help=f"CI: every kind that applies to a backend once (the API server and etcd restarts "
                             f"once per run), over {QUICK_SEGMENTS} groups")
    parser.add_argument("--kinds", nargs="+", choices=(*ALL_KINDS, *NODE_KINDS), help="only these fault types")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: spread each group's pods over two real nodes and add the whole-node faults "
                             f"({', '.join(NODE_KINDS)}), dealt while the leader runs on the second node")
    parser.add_argument("--fence", choices=["on", "off"], default="on",
                        help="off: every segment's workers write without their token")
    parser.add_argument("--variants", nargs="+", metavar="GATE/FENCE",
                        help="segments take these in turn (default: exec/fenced file/unfenced file/fenced "
                             "exec/unfenced)")
    parser.add_argument("--segment-faults", type=int,
                        help=f"faults per group before the next variant (default {DEFAULT_SEGMENT_FAULTS}; "
                             f"quick: half the backend's)")
    parser.add_argument("--worker-env", nargs="+", default=[], metavar="NAME=VALUE",
                        help="options of the ledger worker, e.g. LEDGER_TX_SECONDS=0.02")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the logs even when the campaign passes")
    parser.add_argument("--json", type=Path, help="also write the results (every fault) as JSON here")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        variants = tuple(parse_variant(v) for v in args.variants) if args.variants else VARIANTS
    except ValueError as exc:
        parser.error(str(exc))
    options = CampaignOptions(backends=tuple(args.backend), faults=args.faults, duration=args.duration,
                              seed=args.seed, quick=args.quick, fence=args.fence == "on", variants=variants,
                              segment_faults=args.segment_faults,
                              kinds=tuple(args.kinds) if args.kinds else None,
                              worker_env=dict(item.split("=", 1) for item in args.worker_env), workdir=args.workdir,
                              keep=args.keep, log=log, nodes=args.nodes)
    try:
        result = run_campaign(options)
    except (NodeError, ImageBuildError) as exc:
        print(f"campaign: error: {exc}", file=sys.stderr)
        return 2
    result.command = shlex.join(["python", "-m", "benchmarks.campaign", *(argv or sys.argv[1:])])
    print()
    print(result.render())
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(result), indent=2, default=str))
    return 0 if result.verdict_ok else 1


if __name__ == "__main__":
    sys.exit(main())
