"""The floor of a burst of new groups: the fastest any operator could give 500 new
SingletonServices their status, on this machine, if it made the same objects.

    .venv/bin/python -m benchmarks.burst_floor [--groups 500 ...] [--runs 2] [--status-only] [--as-admin]
        [--operator] [--foreign 0 20000] [--plot [PNG]] [--json PATH]

``benchmarks/operator_scale.py`` times the real operator. This times a stand-in that does only
what no operator making a group's objects can leave out, with none of an operator's own work:
no kopf, no reads, no Events, no access reviews, no retries, no refreshes. For each
SingletonService its watch shows as ADDED, it applies the group's objects (built by the
operator's own code, ``desired_objects``, in the operator's order: the RoleBinding needs its
Role) and then patches the status naming the leader, which it knows beforehand (the pods are
made by this script, as in operator_scale). ``--in-flight`` groups at once (the operator's
``RECONCILE_PARALLEL``), as the operator's ServiceAccount with the chart's RBAC (or
``--as-admin``). ``--status-only`` leaves the objects out too: the status write alone.

The SingletonServices are created as operator_scale's default burst creates them (all at once,
``--parallel`` in flight) and timed the same way: the create's answer -> the watch showing
``status.leader`` with the generation applied. Prints medians and p99 over the runs, and the CPU
seconds the API server, etcd and this process (creates, watches and the stand-in) used. With
``--operator``, the real operator's burst (operator_scale's) is timed at each size too, and
``--plot`` draws both against the size. ``--json`` writes every group's latency, per contender
and size (``to_json``).

``--foreign N ...`` makes N pods of no group and N Deployments in a namespace of their own
before each run (operator_scale's ``make_foreign``) and runs every contender once per count:
what foreign objects cost the API server shows in the stand-in, what they cost the operator
in the ratio of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import operator_scale
from benchmarks.failover import cpu_seconds
from benchmarks.operator_scale import (
    ALL_CRS_PATH,
    CALL_TIMEOUT,
    CR_PATH,
    bounded,
    chart_account,
    control_plane,
    cr_body,
    group_name,
    line,
    make_foreign,
    make_pod,
    pod_annotations,
    watching,
)
from singleton_election import contract
from singleton_election.kube import KubeClient, KubeError, KubeGone, load_kube_config
from singleton_operator import groups as operator_groups
from singleton_operator.model.spec import SpecError, read_spec
from singleton_operator.model.status import compute_status
from singleton_operator.reconcile import apply, cr_path, desired_objects, observed_from
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.ledger import percentile

GOAL_SECONDS = 5.0
"""Issue 15's goal for 500 groups: create -> status with a leader, p99."""
PLOT = Path(__file__).resolve().parent / "plots" / "burst-floor.png"


class Contender(NamedTuple):
    """Who was timed (``stand-in`` or ``operator``) beside how many foreign objects."""

    label: str
    contender: str
    foreign: int


class LeastOperator:
    """Per new SingletonService: its objects, then its status. Nothing else."""

    def __init__(self, client: KubeClient, in_flight: int, *, objects: bool) -> None:
        self.client = client
        self.objects = objects
        self.gate = asyncio.Semaphore(in_flight)
        self.tasks: set[asyncio.Task[None]] = set()
        self.failures: list[str] = []
        self.failed = asyncio.Event()
        """Set at the first failure: its group's status never comes, so the run ends at once."""

    async def run(self) -> None:
        version = None
        while True:
            try:
                if version is None:
                    version = (await self.client.request("GET", ALL_CRS_PATH, params={"limit": "1"},
                                                         timeout=CALL_TIMEOUT))["metadata"]["resourceVersion"]
                async with contextlib.aclosing(self.client.watch(
                        ALL_CRS_PATH, params={"resourceVersion": version}, timeout=600)) as events:
                    async for kind, body in events:
                        version = body["metadata"]["resourceVersion"]
                        if kind == "ADDED":
                            task = asyncio.create_task(self.handle(body))
                            self.tasks.add(task)
                            task.add_done_callback(self.tasks.discard)
            except KubeError as exc:  # the custom resource's storage may still be starting
                print(f"  (stand-in's watch: {exc}; watching again)", file=sys.stderr)
                if isinstance(exc, KubeGone):  # that version is gone: every group from now on is new
                    version = None
                await asyncio.sleep(0.2)

    async def handle(self, body: dict[str, Any]) -> None:
        async with self.gate:
            try:
                spec = read_spec(body, default_sidecar_image="example.invalid/sidecar:1")
                if self.objects:
                    for obj in desired_objects(spec):
                        await apply(self.client, obj)
                leader = f"{spec.name}-a"
                pod = {"metadata": {"name": leader, "annotations": pod_annotations(leader, contract.ROLE_LEADER, 1)},
                       "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
                observed = observed_from([pod], None, None, spec.generation)
                await self.client.request("PATCH", cr_path(spec.namespace, spec.name) + "/status",
                                          body={"status": compute_status(spec, observed, {})},
                                          content_type="application/merge-patch+json", timeout=CALL_TIMEOUT)
            except (KubeError, SpecError) as exc:  # reported by run_once, not left to a timeout
                self.failures.append(f"{body['metadata']['name']}: {exc!r}")
                self.failed.set()


async def run_once(plane: ControlPlane, *, groups: int, parallel: int, in_flight: int, objects: bool,
                   as_admin: bool, workdir: Path, foreign: int = 0) -> tuple[list[float], float, dict[str, float]]:
    """Per group create -> status with a leader; the first create -> the last one done; CPU seconds."""
    assert plane.apiserver is not None and plane.etcd is not None
    names = [group_name(i) for i in range(groups)]
    async with KubeClient(load_kube_config(str(plane.info.kubeconfig)), user_agent="bench") as client:
        if foreign:
            seconds = await make_foreign(client, foreign, parallel)
            print(f"  {foreign} foreign pods and Deployments made in {seconds:.0f} s", flush=True)
        await bounded(parallel, [make_pod(client, n, s, role, token) for n in names
                                 for s, role, token in (("a", contract.ROLE_LEADER, 1),
                                                        ("b", contract.ROLE_STANDBY, None))])
        account = plane.info.kubeconfig if as_admin else chart_account(plane, workdir)
        async with KubeClient(load_kube_config(str(account)), user_agent="least-operator") as operator_client, \
                watching(client) as watch:
            least = LeastOperator(operator_client, in_flight, objects=objects)
            stand_in = asyncio.create_task(least.run())
            await asyncio.sleep(1)  # both watches are open
            pids = {"kube-apiserver": plane.apiserver.pid, "etcd": plane.etcd.pid, "this process": os.getpid()}
            cpu_from = {k: cpu_seconds(pid) for k, pid in pids.items()}
            futures = [watch.expect(n, f"{n}-a") for n in names]
            created: dict[str, float] = {}

            async def create(name: str) -> None:
                await client.request("POST", CR_PATH, body=cr_body(name), timeout=CALL_TIMEOUT)
                created[name] = time.monotonic()

            first = time.monotonic()
            await bounded(parallel, [create(n) for n in names])
            all_seen: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*futures))
            failed: asyncio.Future[Any] = asyncio.ensure_future(least.failed.wait())
            try:
                await asyncio.wait([all_seen, failed], timeout=600, return_when=asyncio.FIRST_COMPLETED)
                if not all_seen.done() and not least.failures:
                    raise TimeoutError(f"{len(watch.waiting)} groups had no status after 600 s")
            finally:
                failed.cancel()
                if not all_seen.done():
                    all_seen.cancel()
                stand_in.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stand_in
                # The watch may show a status before its PATCH's answer has come back.
                await asyncio.gather(*least.tasks, return_exceptions=True)
            if least.failures:
                raise RuntimeError(f"{len(least.failures)} groups failed, the first: {least.failures[0]}")
            seen = all_seen.result()
            cpu = {k: cpu_seconds(pid) - cpu_from[k] for k, pid in pids.items()}
    latencies = [at - created[n] for n, at in zip(names, seen, strict=True)]
    return latencies, max(seen) - first, cpu


def timed_runs(args: argparse.Namespace, groups: int, who: str,
               one_run: Callable[[ControlPlane, Path], list[float]]) -> list[float]:
    """``--runs`` runs of ``one_run``, each on a fresh control plane; every group's latency."""
    latencies: list[float] = []
    for run in range(args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="burst-floor-"))
        print(f"{groups} groups, {who}, run {run + 1}/{args.runs} (work folder {workdir})", flush=True)
        with control_plane() as plane:
            latencies += one_run(plane, workdir)
    return latencies


def stand_in_run(args: argparse.Namespace, groups: int, foreign: int) -> Callable[[ControlPlane, Path], list[float]]:
    def one_run(plane: ControlPlane, workdir: Path) -> list[float]:
        latencies, last, cpu = asyncio.run(run_once(
            plane, groups=groups, parallel=args.parallel, in_flight=args.in_flight,
            objects=not args.status_only, as_admin=args.as_admin, workdir=workdir, foreign=foreign))
        print(f"  every status names its leader {last:.1f} s after the first create; CPU seconds "
              + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()), flush=True)
        return latencies
    return one_run


def operator_run(args: argparse.Namespace, groups: int, foreign: int) -> Callable[[ControlPlane, Path], list[float]]:
    """The real operator's burst, as ``operator_scale`` times it (its other phases kept short)."""
    def one_run(plane: ControlPlane, workdir: Path) -> list[float]:
        return asyncio.run(operator_scale.run_once(
            plane, groups=groups, parallel=args.parallel, rest_seconds=1, changes=1, one_more=1,
            workdir=workdir, as_admin=args.as_admin, foreign=foreign)).create_to_leader
    return one_run


def plot(path: Path, sizes: list[int], figures: dict[Contender, dict[int, list[float]]], title: str) -> None:
    """p99 and median against the burst's size, per contender, with the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:gray")
    for (who, by_size), color in zip(figures.items(), colors, strict=False):
        ax.plot(sizes, [percentile(by_size[n], 0.99) for n in sizes], "o-", color=color, label=f"{who.label}: p99")
        ax.plot(sizes, [statistics.median(by_size[n]) for n in sizes], "o--", color=color,
                label=f"{who.label}: median")
    ax.axhline(GOAL_SECONDS, color="red", linestyle=":", label=f"goal: p99 ≤ {GOAL_SECONDS:g} s")
    ax.set_xlabel("SingletonServices created at once")
    ax.set_ylabel("create → status with a leader (s)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def to_json(args: argparse.Namespace, figures: dict[Contender, dict[int, list[float]]]) -> dict[str, Any]:
    """Every group's create -> status with a leader (seconds), per contender, foreign objects and
    size, with the settings they were measured with. ``contender`` is ``stand-in`` or ``operator``."""
    return {"runs": args.runs, "parallel": args.parallel, "in_flight": args.in_flight,
            "status_only": args.status_only, "as_admin": args.as_admin,
            "figures": [{"contender": who.contender, "label": who.label, "foreign": who.foreign, "groups": groups,
                         "create_to_leader": latencies}
                        for who, by_size in figures.items() for groups, latencies in sorted(by_size.items())]}


def measure(args: argparse.Namespace, sizes: list[int], counts: list[int],
            what: str) -> dict[Contender, dict[int, list[float]]]:
    """Every contender at every foreign count and size, one after another."""
    figures: dict[Contender, dict[int, list[float]]] = {}
    for foreign in counts:
        beside = f", {foreign} foreign" if counts != [0] else ""
        stand_in = Contender(f"stand-in ({what}){beside}", "stand-in", foreign)
        operator = Contender(f"operator{beside}", "operator", foreign)
        for groups in sizes:
            figures.setdefault(stand_in, {})[groups] = timed_runs(
                args, groups, stand_in.label, stand_in_run(args, groups, foreign))
            if args.operator:
                figures.setdefault(operator, {})[groups] = timed_runs(
                    args, groups, operator.label, operator_run(args, groups, foreign))
    return figures


def compare_foreign(figures: dict[Contender, dict[int, list[float]]], counts: list[int], sizes: list[int]) -> None:
    """Per size and foreign count: each contender's p99 against its own at the first count, and
    the operator's against the stand-in's beside the same foreign objects."""
    print(f"\np99 against the same contender's at {counts[0]} foreign, and operator / stand-in:")
    for groups in sizes:
        p99 = {(who.contender, who.foreign): percentile(by_size[groups], 0.99) for who, by_size in figures.items()}
        for foreign in counts:
            own, floor = p99[("operator", foreign)], p99[("stand-in", foreign)]
            own0, floor0 = p99[("operator", counts[0])], p99[("stand-in", counts[0])]
            print(f"  {groups} groups, {foreign} foreign: operator {own:.2f} s ({own / own0:.2f}),"
                  f" stand-in {floor:.2f} s ({floor / floor0:.2f}), "
                  f"operator / stand-in {own / floor:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[500], metavar="N",
                        help="SingletonServices created at once; several sizes are run one after another "
                        "(default 500)")
    parser.add_argument("--runs", type=int, default=2, help="runs per size, each on a fresh control plane "
                        "(default 2)")
    parser.add_argument("--parallel", type=int, default=50, help="create requests in flight (default 50, "
                        "as operator_scale's burst)")
    parser.add_argument("--in-flight", type=int, default=operator_groups.RECONCILE_PARALLEL,
                        help="groups the stand-in handles at once (default "
                        f"{operator_groups.RECONCILE_PARALLEL}, the operator's RECONCILE_PARALLEL)")
    parser.add_argument("--status-only", action="store_true",
                        help="write the status only, without the group's objects")
    parser.add_argument("--as-admin", action="store_true",
                        help="send the stand-in's (and the operator's) requests as the test bed's admin, whose "
                        "requests skip RBAC and its escalation checks (default: the chart's ServiceAccount and RBAC)")
    parser.add_argument("--operator", action="store_true",
                        help="also time the real operator's burst at each size (operator_scale's), beside the "
                        "stand-in's")
    parser.add_argument("--foreign", type=int, nargs="+", default=[0], metavar="N",
                        help="make N foreign pods and N Deployments before each run; several counts are run "
                        "one after another, every contender at each (default 0)")
    parser.add_argument("--plot", type=Path, nargs="?", const=PLOT, default=None, metavar="PNG",
                        help=f"draw p99 and median against the size into PNG (without a value: {PLOT}; "
                        "needs matplotlib: .venv/bin/pip install -e '.[bench]')")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every group's latency, per contender and size, here")
    args = parser.parse_args(argv)
    if min(*args.groups, args.runs, args.parallel, args.in_flight) < 1:
        parser.error("--groups, --runs, --parallel and --in-flight must be at least 1")
    if min(args.foreign) < 0:
        parser.error("--foreign counts must be 0 or more")
    if args.operator and args.status_only:
        parser.error("--status-only is the stand-in's alone: the operator always makes the group's objects")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'")
    sizes = sorted(set(args.groups))
    what = "the status only" if args.status_only else "the objects and the status"
    counts = list(dict.fromkeys(args.foreign))
    figures = measure(args, sizes, counts, what)
    whom = "the admin" if args.as_admin else "the chart's ServiceAccount"
    print(f"\nCreated at once, create -> status with a leader ({args.in_flight} groups in flight in the stand-in, "
          f"as {whom}; {args.runs} run(s) per size):")
    for who, by_size in figures.items():
        for groups in sizes:
            print(line(f"{who.label}, {groups} groups", by_size[groups]))
    if args.operator and len(counts) > 1:
        compare_foreign(figures, counts, sizes)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(args, figures), indent=1))
    if args.plot is not None:
        plot(args.plot, sizes, figures, f"SingletonServices created at once, {os.cpu_count()} cores, as {whom}, "
             f"{args.runs} run(s) each")
        print(f"  plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
