"""Whole-node faults on two real nodes: time to a new leader acting, per fault.

    sudo .venv/bin/python -m benchmarks.node_faults --runs 10 [--fault cut-off power-off kubelet-stop drain]
        [--lease-seconds 2] [--evict-after 5] [--json F] [--keep-logs DIR]

Root only. It starts its own control plane and controllers (the node lifecycle controller
among them, grace period 20 s), two real nodes (``FIRST_NODE`` on the host's network,
``SECOND_NODE`` in a network namespace of its own), the project's image and the test apps
image (built from the Dockerfile, cached) and the operator. One group of two pods, one per
node, on Leases (``--lease-seconds``, renew deadline 3/4 of it, retry 1/4), tolerating a lost
node for ``--evict-after`` seconds, the file gate, each pod's app
recording every act in one file (``singleton_testbed.harness.node_faults``). Per run, the
leader is moved to the second node, the fault hits that node, and the figures are from the
fault's instant: the new leader's first act, the group's status naming it, and the leader
Service's ready endpoints being it alone; then the node comes back and the group settles.

Prints medians, p99 (nearest rank) and max per fault, and each run's figures; and how many
runs had the old leader's app act after the new one began (must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.failover import summary
from singleton_testbed import images
from singleton_testbed.apps_image import build_test_apps_image
from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane, wait_established
from singleton_testbed.harness.kubehelpers import save_pod_logs
from singleton_testbed.harness.node_faults import (
    EVICT_AFTER,
    FAULTS,
    LEASE_SECONDS,
    FaultRun,
    TwoNodeGroup,
    group_manifest,
)
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.node import Node
from singleton_testbed.node_config import FIRST_NODE, SECOND_NODE

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "singleton.dev_singletonservices.yaml"
NAMESPACE = "bench"
GROUP = "spread"


class Bed:
    """Everything the benchmark starts, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        binaries = find_all()
        add_to_path(binaries)
        self.control_plane = ControlPlane(binaries, advertise_address=FIRST_NODE.node_ip)
        self.first = Node(self.control_plane, binaries, layout=FIRST_NODE)
        self.second = Node(self.control_plane, binaries, layout=SECOND_NODE)
        self.operator: OperatorProcess | None = None

    def start(self) -> str:
        """Start everything; returns the test apps image's reference."""
        info = self.control_plane.start()
        self.control_plane.start_controllers()
        self.control_plane.start_node_lifecycle()
        print("[bench] building (or finding) the project's image and the test apps image", file=sys.stderr, flush=True)
        project_archive, project = images.build_project_image()
        apps_archive, apps = build_test_apps_image()
        for node in (self.first, self.second):
            node.start()
            node.import_image(project_archive)
            node.import_image(apps_archive)
        kubectl = self.control_plane.kubectl
        kubectl("apply", "--server-side", "-f", str(CRD))
        wait_established(kubectl, "crd/singletonservices.singleton.dev")
        kubectl("create", "namespace", NAMESPACE)
        kubectl("create", "serviceaccount", "default", "-n", NAMESPACE, check=False)
        self.operator = OperatorProcess(info.kubeconfig, NAMESPACE, self.workdir / "operator.log",
                                        extra_args=["--namespace", NAMESPACE, "--sidecar-image", project]).start()
        return apps

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.second.stop()
        self.first.stop()
        self.control_plane.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node_faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per fault (default 10)")
    parser.add_argument("--fault", nargs="+", choices=FAULTS, default=list(FAULTS), help="the faults, in this order")
    parser.add_argument("--lease-seconds", type=float, default=LEASE_SECONDS,
                        help=f"the group's lease duration (default {LEASE_SECONDS:g})")
    parser.add_argument("--evict-after", type=int, default=EVICT_AFTER,
                        help=f"seconds the pods tolerate a NotReady node (default {EVICT_AFTER})")
    parser.add_argument("--json", type=Path, help="write every run's figures to this file")
    parser.add_argument("--keep-logs", type=Path, help="save the pods' logs and the operator's here at the end")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.lease_seconds < 1 or args.evict_after < 0:
        parser.error("--lease-seconds must be at least 1 and --evict-after 0 or more")
    if os.geteuid() != 0:
        parser.error("the real nodes need root")
    return args


def print_runs(faults: list[str], runs: list[FaultRun]) -> None:
    print("\nWhole-node faults, from the fault's instant (seconds):")
    for fault in faults:
        mine = [r for r in runs if r.fault == fault]
        if not mine:
            continue
        print(f"  {fault}")
        for name, values in (("new leader's app acting", [r.new_acting for r in mine]),
                             ("status names the new leader", [r.status_followed for r in mine]),
                             ("leader Service: the new leader alone", [r.service_followed for r in mine])):
            print("    " + summary(name, values, unit="s", scale=1.0))
        overlaps = [r for r in mine if r.overlap >= 0]
        print(f"    old leader acted after the new one began: {len(overlaps)} of {len(mine)} runs")


def main() -> int:
    args = parse_args()
    runs: list[FaultRun] = []
    with tempfile.TemporaryDirectory(prefix="node-faults-") as folder:
        workdir = Path(folder)
        bed = Bed(workdir)
        acts = workdir / ("acts-" + secrets.token_hex(3))
        acts.mkdir()
        os.chmod(acts, 0o777)  # the app runs as the image's non-root user
        began = time.monotonic()
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
        try:
            image = bed.start()
            manifest = group_manifest(GROUP, image, acts, [FIRST_NODE.name, SECOND_NODE.name], [],
                                      lease_seconds=args.lease_seconds, evict_after=args.evict_after)
            bed.control_plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input_text=json.dumps(manifest))
            group = TwoNodeGroup(bed.control_plane, NAMESPACE, GROUP, acts, first=bed.first, second=bed.second,
                                 lease_seconds=args.lease_seconds)
            for fault in args.fault:
                for index in range(args.runs):
                    old_log = args.keep_logs / f"{fault}-{index + 1}-old-leader.log" if args.keep_logs else None
                    run = group.run(fault, old_log=old_log)
                    runs.append(run)
                    print(f"[{fault:12} {index + 1:2}/{args.runs}] {run.old_pod} -> {run.new_pod}: acting "
                          f"{run.new_acting:.2f} s, status {run.status_followed:.2f} s, Service "
                          f"{run.service_followed:.2f} s, old leader's last act {-run.overlap:.2f} s before",
                          flush=True)
        finally:
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(Exception):
                    save_pod_logs(bed.control_plane, NAMESPACE, args.keep_logs)
                    shutil.copy(workdir / "operator.log", args.keep_logs / "operator.log")
            with contextlib.suppress(Exception):
                bed.stop()
    print_runs(args.fault, runs)
    print(f"\n{len(runs)} runs in {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=1))
    return 0 if all(r.overlap < 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
