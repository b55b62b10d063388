"""The registry of ``make figures``: README's rows, the benchmark runs (steps) they come from, and
how each step's ``--json`` output becomes figures.

Every figure is measured by an existing benchmark module, run as ``python -m benchmarks.<module>
... --json PATH`` (``benchmarks/figures.py`` runs them); nothing here measures. A step's arguments
differ by mode: ``full`` (README's figures; every step's run counts chosen so that the whole run
fits ``BUDGET_SECONDS`` on the 2-core development machine) and ``quick`` (n of 1 or 2 and small
sizes: a check that every step runs and parses, not figures to quote).

The estimates (``Step.estimate_seconds``) come from the steps' own earlier runs on that machine
(benchmarks/README.md and the lab log: per-run times of each scenario plus the servers' start),
not from a timed run of ``make figures``: each run records every step's real duration beside its
estimate (``StepRun``), which is where they should be corrected from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.campaign_bed import LEASE, RENEW, RETRY
from benchmarks.figures_model import CLIENT_GO, FLOOR, FULL, HOST, NODE, Counterpart, Fact, Figure, Setup, Stats
from singleton_election.core.timings import BACKEND_DEFAULTS

BACKENDS = ("postgres", "lease", "both")
BUDGET_SECONDS = 40 * 60
"""The whole full run on the 2-core machine (issue 35)."""
CLIENTGO_GO_MOD = Path(__file__).resolve().parent / "clientgo" / "go.mod"


def clientgo_setup(go_mod: Path = CLIENTGO_GO_MOD) -> str:
    """client-go's elector as the benchmark builds it: the version its go.mod requires."""
    found = re.search(r"^\s*k8s\.io/client-go (\S+)", go_mod.read_text(), re.MULTILINE)
    version = found.group(1) if found else "(version not found in benchmarks/clientgo/go.mod)"
    return (f"client-go {version} tools/leaderelection (LeaseLock, ReleaseOnCancel), at its defaults 15/10/2 s; "
            "the same script, fault and machine")


def floor_setup(in_flight: int) -> str:
    return ("the floor: a stand-in that makes only the writes a new group needs (its five objects and its status), "
            f"as the chart's ServiceAccount, {in_flight} groups in flight; the same run")

Parser = Callable[[Any, Sequence[str]], list[Figure]]
"""A step's ``--json`` document and the arguments it ran with -> its figures."""


@dataclass(frozen=True)
class Step:
    """One run of an existing benchmark module."""

    id: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    estimate_seconds: int
    """Full mode, on the 2-core machine (quick: ``quick_estimate_seconds``)."""
    quick_estimate_seconds: int
    parse: Parser
    needs_node: bool = False
    """Root and the test bed's real node, for the whole step."""
    without_node: tuple[str, ...] | None = None
    """Arguments that let the step run without the node, leaving out ``node_rows``."""
    node_rows: tuple[str, ...] = ()

    def arguments(self, mode: str) -> tuple[str, ...]:
        return self.full if mode == FULL else self.quick

    def estimate(self, mode: str) -> int:
        return self.estimate_seconds if mode == FULL else self.quick_estimate_seconds


@dataclass(frozen=True)
class Row:
    """A row of README's Figures table, or one of the paragraphs under it."""

    id: str
    steps: tuple[str, ...]
    label: str
    """What the row measures, in README's words."""
    limits: str
    """What its setup leaves out or holds fixed, stated beside its figures."""
    columns: tuple[str, ...] = ()
    """The table's cells the row fills: backends, ``vs-clientgo`` (a paragraph: none)."""
    cells: str = "latency"
    """How its cells read: ``latency`` (p99 (median)), ``rate``, ``memory``, ``both-leading``."""

    @property
    def paragraph(self) -> bool:
        return not self.columns


def timings_of(backend: str) -> str:
    t = BACKEND_DEFAULTS[backend]
    return f"{t.lease_duration:g}/{t.renew_deadline:g}/{t.retry_period:g} s"


def option(arguments: Sequence[str], name: str, default: str) -> str:
    """The value of the last ``name VALUE`` in ``arguments`` (argparse's rule), or ``default``."""
    value = default
    for index, argument in enumerate(arguments[:-1]):
        if argument == name:
            value = arguments[index + 1]
    return value


# --- benchmarks/failover.py: host processes, per backend --------------------------------------------

HOST_DETAILS = ("3 sidecar processes on one machine (no kubelet), each playing a pod object for lease and both; "
                "PostgreSQL and etcd + kube-apiserver on loopback; /readyz polled every 1 ms")


def parse_host(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.failover --json``: a list of backends' results."""
    figures = []
    for result in data:
        backend = result["backend"]
        setup = Setup(HOST, "exec", backend, timings_of(backend), HOST_DETAILS)
        handovers = result["handovers"]
        if runs := handovers.get("app sigterm"):
            figures.append(Figure(
                f"handover.{backend}", "handover",
                "SIGTERM to the leader's sidecar (a drain, as at a pod deletion) -> another sidecar's /readyz 200; its "
                "app (tests/data/acting_app.py behind the exec gate, exiting at once on SIGTERM) stopped first",
                setup, Stats.of([r["ready"] for r in runs], "s"), _acting_facts(runs)))
        if runs := handovers.get("app sigkill"):
            figures.append(Figure(
                f"sigkill.{backend}", "sigkill",
                "SIGKILL of the leader's sidecar, keeper and app at once (a crashed pod) -> another sidecar's /readyz "
                "200; a takeover waits until the dead holder's app is surely stopped (its stop bound, or the lease)",
                setup, Stats.of([r["ready"] for r in runs], "s"), _acting_facts(runs)))
    return figures


def _acting_facts(runs: Sequence[Mapping[str, Any]]) -> dict[str, Fact]:
    return {"runs_two_apps_acting": sum(1 for r in runs if r["overlaps"]),
            "new_app_first_act_p99": Stats.of([r["first_act"] for r in runs], "s").p99}


# --- benchmarks/compare_clientgo.py: ours against client-go, same script ----------------------------

COMPARE_DETAILS = ("benchmarks/compare_clientgo.py: groups of 3 on one API server, each peer in turn; ours the "
                   "sidecar (lease backend, playing a pod object, no gated app); the fault at a random phase of "
                   "the peer's retry cycle; /readyz polled every 1 ms")


def parse_clientgo(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.compare_clientgo --json``: a list of peers' results (``ours``, ``clientgo-defaults``)."""
    peers = {peer["key"]: peer for peer in data}
    ours, theirs = peers.get("ours"), peers.get("clientgo-defaults")
    if ours is None or theirs is None:
        return []
    setup = Setup(HOST, "none", "lease", timings_of("lease"), COMPARE_DETAILS)
    theirs_setup = clientgo_setup()
    figures = []
    for row, attribute, scenario in (
            ("handover", "graceful", "SIGTERM to the leader, no gated app -> another member's /readyz 200"),
            ("sigkill", "kill", "SIGKILL of the leader, no gated app -> another member's /readyz 200")):
        if ours[attribute] and theirs[attribute]:
            theirs_stats = Stats.of(theirs[attribute], "s")
            figures.append(Figure(f"{row}.vs-clientgo", row, scenario, setup, Stats.of(ours[attribute], "s"),
                                  counterpart=Counterpart(CLIENT_GO, theirs_setup, theirs_stats)))
    if ours["partition"] and theirs["partition"]:
        figures.append(_partition_figure(ours, theirs, theirs_setup))
    if ours["rest"] and theirs["rest"]:
        window = float(option(arguments, "--rest-seconds", "300"))
        figures.append(Figure(
            "requests.vs-clientgo", "requests", "API requests/s of a group of 3 at rest (the API server's audit log, "
            "distinct auditIDs by user agent)", Setup(HOST, "none", "lease", timings_of("lease"),
                                                    f"{COMPARE_DETAILS}; one window of {window:g} s"),
            Stats.single(ours["rest"]["requests"], "requests/s"), {"window_seconds": window},
            Counterpart(CLIENT_GO, theirs_setup, Stats.single(theirs["rest"]["requests"], "requests/s"))))
    return figures


def _partition_figure(ours: Mapping[str, Any], theirs: Mapping[str, Any], theirs_setup: str) -> Figure:
    def facts(peer: Mapping[str, Any]) -> dict[str, Fact]:
        margins = peer["partition_margin"]
        return {"runs_both_leading": sum(1 for m in margins if m < 0), "margin_min_seconds": min(margins)}

    setup = Setup(NODE, "none", "lease", timings_of("lease"),
                  "benchmarks/compare_partition.py: groups of 3 pods bound to the test bed's real node, ours from the "
                  "project's image; the leader's pod cut off from the API server's ClusterIP (iptables drop in its "
                  "network namespace) at a random phase of the retry cycle until another member led for 1 s; "
                  "/readyz polled every 10 ms")
    return Figure("partition-api.vs-clientgo", "partition-api",
                  "the leader's pod cut off from the API server -> another member's first /readyz 200 with a newer "
                  "term; both leading at once when the new leader's first ready answer came before the old one's "
                  "last (margin < 0)", setup, Stats.of(ours["partition"], "s"), facts(ours),
                  Counterpart(CLIENT_GO, theirs_setup, Stats.of(theirs["partition"], "s"), facts(theirs)))


# --- benchmarks/node_failover.py: the real node, pods of the image made by the operator -------------

def node_details(arguments: Sequence[str]) -> str:
    poll = option(arguments, "--poll-ms", "3")
    return (f"pods of the project's image on the test bed's real node (containerd, runc, kubelet, kube-proxy), made "
            f"by the operator: 3 replicas of a busybox app that gate.sh starts on the leader only; every pod's "
            f"/readyz polled from the host every {poll} ms while a new leader is awaited")


def parse_node(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.node_failover --json``: every run, every pod's footprint, every group at rest."""
    gate = option(arguments, "--gating", "cooperative")
    details = node_details(arguments)
    runs = data["runs"]
    figures = []
    for backend in BACKENDS:
        setup = Setup(NODE, gate, backend, timings_of(backend), details)
        mine = [r for r in runs if r["backend"] == backend]
        figures += _node_faults(backend, setup, mine)
        figures += _node_rest(backend, setup, data)
    return figures


NODE_SCENARIOS = {
    "delete": ("delete-pod", "DELETE of the leader pod (graceful) -> the new leader's app prints its first line "
                             "(the time containerd stamped on it)"),
    "evict": ("evict-pod", "the Eviction API's accepted POST for the leader pod -> the new leader's app prints its "
                           "first line (the time containerd stamped on it)"),
    "sidecar-kill": ("sidecar-kill", "SIGKILL of every process of the leader's sidecar container, its first crash "
                                     "(the kubelet restarts it in the same pod) -> a sidecar leads with a newer token"),
    "sidecar-kill-again": ("sidecar-kill-again", "SIGKILL of the leader's sidecar container that crashed before "
                                                 "(a crash loop: the kubelet's back-off, capped at 1 s on the test "
                                                 "bed, included) -> a sidecar leads with a newer token"),
    "pod-kill": ("pod-kill", "SIGKILL of every process of the leader pod, its app and sidecar containers at once, "
                             "their first crash (the kubelet restarts both in the same pod) -> a sidecar leads with a "
                             "newer token"),
    "partition-pg": ("partition", "the leader's pod cut off from PostgreSQL (iptables drop of its port in the pod's "
                                  "network namespace) -> another pod's /readyz 200"),
}


def _node_faults(backend: str, setup: Setup, runs: Sequence[Mapping[str, Any]]) -> list[Figure]:
    figures = []
    for row, (fault, scenario) in NODE_SCENARIOS.items():
        if row == "partition-pg" and backend != "postgres":
            continue
        values, facts = _node_values(row, [r for r in runs if r["fault"] == fault])
        if values:
            figures.append(Figure(f"{row}.{backend}", row, scenario, setup, Stats.of(values, "s"), facts))
    return figures


def _node_values(row: str, runs: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, Fact]]:
    """The figure's values among a fault's runs, and its facts."""
    if row in ("delete", "evict"):
        acting = [r["phases"]["new app acting"] for r in runs if r.get("phases") and "new app acting" in r["phases"]]
        return acting, {"runs": len(runs), "runs_without_app_line": len(runs) - len(acting)}
    if row in ("sidecar-kill", "pod-kill"):
        first = [r for r in runs if r["restarts_before"] == 0]
        return [r["seconds"] for r in first], {"same_pod_leads_again": sum(1 for r in first if r["new"] == r["old"])}
    if row == "sidecar-kill-again":
        again = [r for r in runs if r["restarts_before"] >= 1]
        return [r["seconds"] for r in again], {"runs_on_a_first_crash_left_out": len(runs) - len(again)}
    return [r["seconds"] for r in runs], {}


def _node_rest(backend: str, setup: Setup, data: Mapping[str, Any]) -> list[Figure]:
    figures = []
    for group in data.get("at_rest", []):
        if group["backend"] == backend:
            window = group["seconds"]
            figures.append(Figure(
                f"requests.{backend}", "requests", "API requests/s of the group of 3 pods at rest, every sidecar "
                "scraped once a second (the API server's audit log: user agent singleton-sidecar, distinct auditIDs)",
                setup, Stats.single(group["requests"] / window, "requests/s"),
                {"window_seconds": window, "requests": group["requests"]}))
    pods = [f for f in data.get("footprints", []) if f["backend"] == backend]
    if pods:
        starts = [f["start_seconds"] for f in pods if f["start_seconds"] is not None]
        figures.append(Figure(
            f"rss.{backend}", "rss",
            "VmRSS of each pod's sidecar process after the rest, in the image, read on the node",
            setup, Stats.of([f["rss_mb"] for f in pods], "MB"),
            {"start_to_first_log_max_seconds": max(starts)} if starts else {}))
    return figures


# --- benchmarks/campaign.py --------------------------------------------------------------------------

def parse_campaign(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.campaign --json``: the verdict's totals and every fault's failover (none when
    no fault was followed by a new leader: a campaign without faults has no figure)."""
    totals, caught = data["totals"], data["caught_mid_act"]
    failovers = [v for b in data["backends"] for stats in b["stats"].values() for v in stats["failovers"]]
    if not failovers:
        return []
    kinds = sorted({kind for b in data["backends"] for kind in b["stats"] if kind != "warm-up"})
    facts: dict[str, Fact] = {
        "faults": totals["faults"], "verdict_ok": int(totals["verdict_ok"]),
        "acting_overlaps": totals["acting_overlaps"],
        "inflight_through_freeze": totals["inflight_through_freeze"], "caught_mid_act": caught["acts"],
        "caught_latest_after_successor_seconds": caught["latest_after_successor"], "freezes": caught["freezes"],
        "caught_refused": totals["caught_refused"], "caught_written": totals["caught_written"],
        "fenced_overlaps": totals["fenced_overlaps"], "regressions": totals["regressions"],
        "stale_accepted": totals["stale_accepted"], "unrecovered": totals["unrecovered"], "seed": data["seed"],
        "kinds": " ".join(kinds), "seconds": data["seconds"]}
    setup = Setup(NODE, "exec and file", " ".join(b["backend"] for b in data["backends"]),
                  f"{LEASE:g}/{RENEW:g}/{RETRY:g} s",
                  "benchmarks/campaign.py: groups of 3 pods on the real node, segments taking the variants in turn "
                  "(exec or file gate, fenced or unfenced worker), every app detaching a worker; seeded faults")
    return [Figure("campaign.all", "campaign", "seeded faults, each followed by a ready leader; every act any app "
                   "began judged from the act log, the fenced ledger judged in the fenced segments",
                   setup, Stats.of(failovers, "s"), facts)]


# --- benchmarks/burst_floor.py: the operator's burst against its floor ------------------------------

def parse_burst(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.burst_floor --operator --json``: every group's create -> status, per contender and size."""
    by = {(f["contender"], f["groups"]): f["create_to_leader"] for f in data["figures"]}
    figures = []
    for size in sorted({groups for _, groups in by}):
        operator, floor = by.get(("operator", size)), by.get(("stand-in", size))
        if not operator or not floor:
            continue
        ours, least = Stats.of(operator, "s"), Stats.of(floor, "s")
        setup = Setup(HOST, "-", "lease", "-",
                      f"etcd + kube-apiserver and one operator process (the chart's ServiceAccount and RBAC), no node; "
                      f"{size} SingletonServices created at once ({data['parallel']} creates in flight), their pods "
                      f"made Ready beforehand by the benchmark; {data['runs']} run(s), each on a fresh control plane")
        figures.append(Figure(f"burst.{size}", "burst", "each group's create -> a watch showing status.leader with "
                              "its generation applied", setup, ours,
                              {"ratio_p99": ours.p99 / least.p99, "runs": data["runs"]},
                              Counterpart(FLOOR, floor_setup(data['in_flight']), least)))
    return figures


# --- benchmarks/operator_scale.py: the operator at rest ---------------------------------------------

def parse_operator(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.operator_scale --json``: one run's phases (the burst, one more, at rest, changes)."""
    run = data[0]
    window = float(option(arguments, "--rest-seconds", "60"))
    setup = Setup(HOST, "-", "lease", "-",
                  f"etcd + kube-apiserver and one operator process (the chart's ServiceAccount and RBAC), no node; "
                  f"{run['groups']} groups created at once, their pods made Ready beforehand by the benchmark")
    rest = f"the operator carrying {run['groups']} groups at rest, one window of {window:g} s:"
    facts: dict[str, Fact] = {"window_seconds": window, "groups": run["groups"]}
    figures = [
        Figure("operator-rest.requests", "operator-rest", f"{rest} its API requests/s (audit log)", setup,
               Stats.single(run["requests_per_second"], "requests/s"), facts),
        Figure("operator-rest.cpu", "operator-rest", f"{rest} its CPU, % of one core", setup,
               Stats.single(run["cpu_percent"], "%"), facts),
        Figure("operator-rest.rss", "operator-rest", f"{rest} its RSS", setup, Stats.single(run["rss_mb"], "MB"),
               facts)]
    if run["create_one_more"]:
        figures.append(Figure("operator-rest.one-more", "operator-rest", "one more group created beside them, one at "
                              "a time: create -> status with its leader", setup, Stats.of(run["create_one_more"], "s")))
    if run["notice_change"]:
        figures.append(Figure("operator-rest.change", "operator-rest", "a leader change on one group (the pods' "
                              "annotations patched as sidecars would) -> the status naming the new pod", setup,
                              Stats.of(run["notice_change"], "s")))
    return figures


# --- benchmarks/pooled_postgres.py -------------------------------------------------------------------

def parse_pooled(data: Any, arguments: Sequence[str]) -> list[Figure]:
    """``benchmarks.pooled_postgres --json``: every run's renewals, crash failovers and counts."""
    runs = data["figures"]
    setup = Setup(HOST, "-", "postgres", timings_of("postgres"),
                  f"{data['groups']} groups x {data['replicas']} candidates (the sidecar's backend and election core, "
                  f"not its process) in {data['workers']} worker processes, through PgBouncer (transaction mode, "
                  f"{data['pool_size']} server connections) to one PostgreSQL with max_connections 100; "
                  f"{data['runs']} run(s)")
    facts: dict[str, Fact] = {
        "groups": data["groups"], "leaderless_groups": sum(r["orphaned_groups"] for r in runs),
        "killed_leaders": sum(r["killed_leaders"] for r in runs),
        "renew_failures": sum(r["renew_failures"] for r in runs),
        "acting_overlaps": sum(r["overlaps"] for r in runs), "ledger_safe": int(all(r["ledger_safe"] for r in runs)),
        "peak_server_connections": max(r["peak_server_connections"] for r in runs),
        "candidates_cpu_share": max(r["candidates_cpu_share"] for r in runs), "cores": data["cores"],
        "rest_seconds": data["rest"], "replicas": data["replicas"], "workers": data["workers"],
        "pool_size": data["pool_size"], "runs": data["runs"]}
    renewals = [ms / 1000 for r in runs for ms in r["renew_ms"]]
    failovers = [s for r in runs for s in r["failover_s"]]
    figures = []
    if renewals:
        figures.append(Figure("pooled.renew", "pooled", f"every renewal at rest ({data['rest']:g} s per run): request "
                              "-> answer, the worker's event loop included", setup, Stats.of(renewals, "s"), facts))
    if failovers:
        figures.append(Figure("pooled.failover", "pooled", "one worker process SIGKILLed (its leaders crash without "
                              "a release) -> a surviving candidate of each of their groups acts", setup,
                              Stats.of(failovers, "s"), facts))
    return figures


# --- the registry ------------------------------------------------------------------------------------

STEPS: tuple[Step, ...] = (
    # 3 backends x (14 gated handovers at ~2.5 s, a group started each time) + 7 SIGKILLs of the whole
    # "pod" (postgres ~3 s; lease and both wait out the 9 s lease: ~11 s) + the servers' start.
    Step("host", "benchmarks.failover",
         full=("--backend", "postgres", "lease", "both", "--scenarios", "app", "kill-app", "--runs", "7"),
         quick=("--backend", "postgres", "lease", "both", "--scenarios", "app", "kill-app", "--runs", "1"),
         estimate_seconds=290, quick_estimate_seconds=50, parse=parse_host),
    # Ours and client-go at 15/10/2 s: 6 handovers each (~3 s and ~6 s), 6 SIGKILLs of ours (~12.5 s)
    # and 4 of client-go's (~21 s), 45 s at rest each; then, on the real node, 3 partitions per
    # peer (about 27 s each with the node's start: the lab log's 30 in 14 min).
    Step("clientgo", "benchmarks.compare_clientgo",
         full=("--peers", "ours", "clientgo-defaults", "--runs", "6", "--slow-runs", "4", "--rest-seconds", "45",
               "--sigstop-runs", "0", "--partition-runs", "3", "--seed", "1", "--no-plots"),
         quick=("--peers", "ours", "clientgo-defaults", "--runs", "1", "--slow-runs", "1", "--rest-seconds", "10",
                "--sigstop-runs", "0", "--partition-runs", "1", "--seed", "1", "--no-plots"),
         estimate_seconds=530, quick_estimate_seconds=190, parse=parse_clientgo,
         without_node=("--partition-runs", "0"), node_rows=("partition-api",)),
    # The node and the operator (~60 s warm), then per backend: the group settles (~30 s), 30 s at
    # rest, 5 deletions and 5 evictions (~4.8 s each: the lab log's 80 in 6-7 min), 3 first crashes
    # (~15 s: the leader's pod is replaced first when its sidecar restarted before), 3 repeated
    # ones (~5 s), 2 whole-pod kills (~15 s, and lease and both wait out the lease), and for
    # postgres 4 partitions (~13 s: the 6 s lease, then the group settles).
    Step("node", "benchmarks.node_failover",
         full=("--backend", "postgres", "lease", "both",
               "--fault", "delete-pod", "evict-pod", "sidecar-kill", "sidecar-kill-again", "pod-kill", "partition",
               "--gating", "file", "--poll-ms", "25", "--rest-seconds", "30", "--runs", "5",
               "--runs-per-fault", "sidecar-kill=3", "sidecar-kill-again=3", "pod-kill=2", "partition=0",
               "postgres/partition=4"),
         quick=("--backend", "postgres", "lease", "both",
                "--fault", "delete-pod", "evict-pod", "sidecar-kill", "sidecar-kill-again", "pod-kill", "partition",
                "--gating", "file", "--poll-ms", "25", "--rest-seconds", "10", "--runs", "1",
                "--runs-per-fault", "sidecar-kill-again=2", "partition=0", "postgres/partition=1"),
         estimate_seconds=750, quick_estimate_seconds=360, parse=parse_node, needs_node=True),
    # Its own servers and node (~60 s), 6 segments of 4 faults (a group's setup ~20 s, a fault ~2.4 s:
    # the lab log's medium run, 100 faults in 477 s).
    Step("campaign", "benchmarks.campaign",
         full=("--faults", "24", "--segment-faults", "4", "--seed", "20261201"),
         quick=("--faults", "3", "--segment-faults", "1", "--seed", "1"),
         estimate_seconds=240, quick_estimate_seconds=130, parse=parse_campaign, needs_node=True),
    # Per size a fresh control plane, 2 pods per group made Ready, then the burst: the stand-in
    # ~18-32 s a run (100 to 500), the real operator ~38-54 s (its start, a 10 s settle, short phases).
    Step("burst", "benchmarks.burst_floor",
         full=("--groups", "100", "200", "300", "400", "500", "--runs", "1", "--operator"),
         quick=("--groups", "20", "50", "--runs", "1", "--operator"),
         estimate_seconds=350, quick_estimate_seconds=90, parse=parse_burst),
    # 500 groups' burst (~45 s with the servers), 5 more one at a time, 60 s at rest, 5 leader changes.
    Step("operator", "benchmarks.operator_scale",
         full=("--groups", "500", "--rest-seconds", "60", "--changes", "5", "--one-more", "5"),
         quick=("--groups", "20", "--rest-seconds", "10", "--changes", "1", "--one-more", "1"),
         estimate_seconds=150, quick_estimate_seconds=45, parse=parse_operator),
    # One run: candidates started over 15 s, a warm-up of the lease + 5 s, 30 s at rest, one worker
    # killed and the lease + retry + 8 s to see its groups' new leaders.
    Step("pooled", "benchmarks.pooled_postgres",
         full=("--runs", "1", "--logs", "{workdir}"),
         quick=("--groups", "30", "--workers", "2", "--runs", "1", "--spread", "2", "--rest", "5",
                "--ledger-groups", "2", "--logs", "{workdir}"),
         estimate_seconds=85, quick_estimate_seconds=40, parse=parse_pooled),
)

COMPARED = (*BACKENDS, "vs-clientgo")
ROWS: tuple[Row, ...] = (
    Row("handover", ("host", "clientgo"), "planned handover: SIGTERM to the leader → new leader ready",
        "host processes; exec gate, the old app stopped first; client-go: both peers without an app",
        columns=COMPARED),
    Row("sigkill", ("host", "clientgo"), "leader SIGKILLed → new leader ready",
        "host processes; exec gate: sidecar, keeper and app killed at once, as in a crashed pod; client-go: "
        "both peers without an app", columns=COMPARED),
    Row("delete", ("node",), "pod deletion → the new leader's app acting",
        "real node, file gate; to the new app's first log line as containerd stamped it", columns=BACKENDS),
    Row("evict", ("node",), "pod eviction → the new leader's app acting",
        "real node, file gate; from the Eviction API's accepted request", columns=BACKENDS),
    Row("sidecar-kill", ("node",), "the leader's sidecar container SIGKILLed, its first crash → a sidecar leads",
        "real node, file gate; a container that never crashed before, which the kubelet restarts at once",
        columns=BACKENDS),
    Row("sidecar-kill-again", ("node",), "the same, a repeated crash → a sidecar leads",
        "real node, file gate; the kubelet's crash-loop back-off included, which the test bed caps at 1 s "
        "against 10 s doubling up to 5 min by default", columns=BACKENDS),
    Row("pod-kill", ("node",), "the leader pod SIGKILLed, app and sidecar at once → a sidecar leads",
        "real node, file gate; the pod's first crash; the other pods wait out the dead leader's term, its own "
        "restarted sidecar may lead sooner", columns=BACKENDS),
    Row("partition-api", ("clientgo",), "leader's pod cut off from the API server: runs with both leading at once",
        "real node; ours from the image, lease backend, no gated app; failover p99 in brackets",
        columns=("lease", "vs-clientgo"), cells="both-leading"),
    Row("partition-pg", ("node",), "leader's pod cut off from PostgreSQL → new leader ready",
        "real node, file gate", columns=("postgres",)),
    Row("requests", ("node", "clientgo"), "API requests/s at rest, group of 3",
        "pods on the real node; the sidecars re-open each watch every 290 s, so a shorter window counts a share "
        "of those; client-go: host processes, ours the sidecar playing a pod object", columns=COMPARED, cells="rate"),
    Row("rss", ("node",), "sidecar RSS at rest, in the image", "real node, every pod of the group; max in brackets",
        columns=BACKENDS, cells="memory"),
    Row("pooled", ("pooled",), "pooled mode at 1,000 groups", ""),
    Row("burst", ("burst",), "the operator's burst against its floor", ""),
    Row("operator-rest", ("operator",), "the operator at rest", ""),
    Row("campaign", ("campaign",), "the fault campaign", ""),
)


def step(step_id: str) -> Step:
    return next(s for s in STEPS if s.id == step_id)


def row(row_id: str) -> Row:
    return next(r for r in ROWS if r.id == row_id)


def steps_for(rows: Sequence[str]) -> list[Step]:
    """The steps the rows come from, in the registry's order."""
    wanted = {s for r in rows for s in row(r).steps}
    return [s for s in STEPS if s.id in wanted]


def estimate(rows: Sequence[str], mode: str) -> int:
    return sum(s.estimate(mode) for s in steps_for(rows))
