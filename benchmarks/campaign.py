"""A seeded fault-injection campaign against groups of 3 sidecar pods, judged by a fenced ledger.

    .venv/bin/python -m benchmarks.campaign [--backend postgres lease both] [--faults N | --duration S]
                                            [--seed S] [--quick] [--kinds K ...] [--fence off]
                                            [--worker-env NAME=VALUE ...] [--json PATH] [--workdir DIR] [--keep]

Needs root and ``ip netns`` (the pods run on the test bed's stand-in kubelet, each in its own
network namespace) and the test bed's binaries. It starts its own PostgreSQL, etcd +
kube-apiserver and stand-in kubelet (it restarts them), then, for each backend in turn, runs a
group of 3 pods (``campaign_bed``: sidecar + exec-gated ledger worker, a ServiceAccount with
only the sidecar's rules, lease 2 s / renew deadline 1.5 s / retry 0.5 s) and injects faults of
the types that apply to the backend (``campaign_faults``) in a seeded random order (every type
once per round) at seeded random moments. Before each fault the group must have settled (every
pod answering, one ready leader, its worker writing), bounded at 45 s. Afterwards the ledger
checker (``singleton_testbed.ledger``) reads what every acting leader wrote, and the unfenced
log of every act the workers began, refused by the fence or not.

Prints a table per backend and fault type (count, overlaps, regressions, stale writes accepted,
acting overlaps, failover p50/p99/max, how much of it was a server's own restart, how often a new term began,
the largest gap without a writing leader and how many exceeded the promised bound, the longest
wait from a new leader's first ready answer to its worker's first row, items lost in flight),
a line on the liveness goals, and a verdict: PASS needs 0
overlaps, 0 regressions, 0 stale writes accepted, 0 acting overlaps (and an act log to judge),
every fault followed by a ready leader, and nothing lost at a graceful deletion. The exit status
is 0 on PASS.

``--quick`` (CI): 10 faults per backend, every type at least once. ``--faults N`` is the total
over the backends, ``--duration S`` the total seconds of injecting; with both, whichever ends
first. ``--fence off`` runs the workers without fencing (deliberately unsafe, for showing that
the campaign can fail); ``--worker-env`` passes options to the worker (``LEDGER_TX_SECONDS``:
work inside each fenced transaction). The Python API is ``run_campaign(CampaignOptions(...))``,
called from the main thread; the logs stay in the work folder unless it passed. The seed fixes
the order of the faults, the moments and the hold times; which pod leads when is up to the run.
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

from benchmarks.campaign_bed import Bed, CampaignError, Group
from benchmarks.campaign_faults import ALL_KINDS, APPLIES, Deck, Injector
from benchmarks.campaign_poll import Poller
from benchmarks.campaign_report import BackendResult, CampaignResult
from singleton_testbed.ledger import check_ledger

BACKENDS = ("postgres", "lease", "both")
QUICK_FAULTS_PER_BACKEND = 10
DEFAULT_FAULTS_PER_BACKEND = 10
SETTLE_TIMEOUT = 45.0


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
    kinds: tuple[str, ...] | None = None
    """Only these fault types (where they apply)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the ledger worker (``tests/data/ledger_worker.py``'s options)."""
    workdir: Path | None = None
    keep: bool = False
    log: Callable[[str], None] = print


def run_campaign(options: CampaignOptions) -> CampaignResult:
    """Run it from the main thread (the servers it restarts die with the thread that started them)."""
    seed = options.seed if options.seed is not None else random.randrange(1, 2**31)
    backends = options.backends
    per_backend = options.faults / len(backends) if options.faults is not None else None
    if per_backend is None and options.duration is None:
        per_backend = QUICK_FAULTS_PER_BACKEND if options.quick else DEFAULT_FAULTS_PER_BACKEND
    counts: list[int | None] = [None] * len(backends)
    if per_backend is not None:
        counts = _fault_counts(options.faults, per_backend, backends)
    durations: list[float | None] = [None] * len(backends)
    if options.duration is not None:
        durations = [options.duration / len(backends)] * len(backends)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="singleton-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = CampaignResult(seed=seed, quick=options.quick)
    options.log(f"campaign seed {seed}, backends {' '.join(backends)}, workdir {workdir}")
    started = time.monotonic()
    bed = Bed(workdir)
    poller = Poller()
    try:
        bed.start()
        poller.start()
        options.log(f"test bed up in {time.monotonic() - started:.1f} s")
        for backend, count, duration in zip(backends, counts, durations, strict=True):
            result.backends.append(run_backend(bed, poller, backend, count=count, duration=duration, seed=seed,
                                               options=options))
            poller.forget_all()
    finally:
        poller.stop()
        bed.stop()
    result.seconds = time.monotonic() - started
    if result.verdict_ok and not options.keep and options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        options.log(f"logs kept in {workdir} (pods' logs under standin/pods/)")
    return result


def _fault_counts(total: int | None, per_backend: float, backends: tuple[str, ...]) -> list[int | None]:
    if total is None:
        return [round(per_backend)] * len(backends)
    base, extra = divmod(total, len(backends))
    return [base + (index < extra) for index in range(len(backends))]


def run_backend(bed: Bed, poller: Poller, backend: str, *, count: int | None, duration: float | None, seed: int,
                options: CampaignOptions) -> BackendResult:
    rng = random.Random(f"{seed}/{backend}")
    kinds = tuple(k for k in APPLIES[backend] if options.kinds is None or k in options.kinds)
    group = Group(bed, backend, poller, fence=options.fence, worker_env=dict(options.worker_env))
    result = BackendResult(backend, group.name, options.fence)
    started = time.monotonic()
    deadline = None if duration is None else started + duration
    log = options.log
    idle = (0.2, 1.0) if options.quick else (0.3, 2.0)
    try:
        group.setup()
        group.wait_settled(60)
        injector = Injector(bed, group, poller, rng)
        deck = Deck(kinds, rng)
        total = "" if count is None else f"/{count}"
        while kinds and (count is None or len(result.faults) < count) and (
                deadline is None or time.monotonic() < deadline):
            time.sleep(rng.uniform(*idle))
            leader = group.wait_settled(SETTLE_TIMEOUT)
            record = injector.inject(deck.deal(), len(result.faults), leader)
            result.faults.append(record)
            log(f"[{backend:<8} {len(result.faults):>3}{total}] {record.describe()}")
            group.wait_settled(SETTLE_TIMEOUT, since=time.time())
    except CampaignError as exc:
        result.aborted = str(exc)
        log(f"[{backend}] aborted: {exc}")
    finally:
        result.seconds = time.monotonic() - started
        group.teardown()
        try:
            result.report = asyncio.run(check_ledger(bed.pg.info.admin_dsn, group.name))
        except OSError as exc:
            result.aborted = result.aborted or f"ledger unreadable: {exc}"
    result.attribute()
    log(f"[{backend}] {len(result.faults)} faults in {result.seconds:.0f} s; ledger: "
        f"{result.report.summary() if result.report else '-'}")
    return result


def to_json(result: CampaignResult) -> dict[str, object]:
    return {
        "seed": result.seed, "quick": result.quick, "seconds": result.seconds, "verdict": result.verdict(),
        "backends": [{"backend": b.backend, "group": b.group, "fence": b.fence, "seconds": b.seconds,
                      "aborted": b.aborted, "ledger": b.report.summary() if b.report else None,
                      "acting_overlaps": [str(o) for o in (b.report.acting_overlaps if b.report else [])],
                      "stats": {k: asdict(v) for k, v in b.stats.items()},
                      "gaps": [{"before": g.before, "after": g.after, "start": g.start.timestamp(),
                                "end": g.end.timestamp(), "seconds": g.seconds}
                               for g in (b.report.gaps if b.report else [])],
                      "faults": [asdict(f) for f in b.faults]} for b in result.backends],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends, in this order (default: all three)")
    parser.add_argument("--faults", type=int, help="total faults over the backends")
    parser.add_argument("--duration", type=float, help="total seconds of injecting over the backends")
    parser.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    parser.add_argument("--quick", action="store_true", help=f"CI: {QUICK_FAULTS_PER_BACKEND} faults per backend")
    parser.add_argument("--kinds", nargs="+", choices=ALL_KINDS, help="only these fault types")
    parser.add_argument("--fence", choices=["on", "off"], default="on",
                        help="off: workers write without their token (deliberately unsafe)")
    parser.add_argument("--worker-env", nargs="+", default=[], metavar="NAME=VALUE",
                        help="options of the ledger worker, e.g. LEDGER_TX_SECONDS=0.02")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the logs even when the campaign passes")
    parser.add_argument("--json", type=Path, help="also write the results (every fault) as JSON here")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    options = CampaignOptions(backends=tuple(args.backend), faults=args.faults, duration=args.duration,
                              seed=args.seed, quick=args.quick, fence=args.fence == "on",
                              kinds=tuple(args.kinds) if args.kinds else None,
                              worker_env=dict(item.split("=", 1) for item in args.worker_env), workdir=args.workdir,
                              keep=args.keep, log=log)
    result = run_campaign(options)
    result.command = shlex.join(["python", "-m", "benchmarks.campaign", *(argv or sys.argv[1:])])
    print()
    print(result.render())
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(result), indent=2, default=str))
    return 0 if result.verdict_ok else 1


if __name__ == "__main__":
    sys.exit(main())
