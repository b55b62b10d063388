"""What each of the operator's requests for a new group costs the API server, in CPU.

    .venv/bin/python -m benchmarks.api_costs [--groups 500] [--runs 3] [--as-admin]

Starts the test bed's etcd and kube-apiserver (no controllers, no node, no operator), creates
``--groups`` SingletonServices and a pod for each, then sends, kind after kind, the requests the
operator makes for a group (built by the operator's own code: its objects, its status, its
Event), one per group and 16 in flight as the operator sends them (as the operator's
ServiceAccount with the chart's RBAC, or with ``--as-admin`` as the test bed's admin), and reads
the CPU seconds the API server used for each kind (``/proc/<pid>/stat``). Prints, per kind, the
median over runs of the API server's CPU milliseconds per request.

It says where the floor of a burst of new groups is: what the operator cannot leave out
(benchmarks/README.md, "The operator with 500 groups").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.failover import cpu_seconds
from benchmarks.operator_scale import (
    CR_PATH,
    NAMESPACE,
    bounded,
    chart_account,
    control_plane,
    cr_body,
    group_name,
    make_pod,
    pod_annotations,
)
from singleton_election.kube import KubeClient, load_kube_config
from singleton_operator import reconcile
from singleton_operator.model import resources
from singleton_operator.model.spec import GroupSpec, read_spec
from singleton_operator.model.status import compute_status
from singleton_testbed.controlplane import ControlPlane

PARALLEL = 16
"""Requests in flight: the operator's REFRESH_PARALLEL, and its RECONCILE_PARALLEL when the
README's figures were measured."""


def request_kinds(client: KubeClient, specs: dict[str, GroupSpec]) -> list[tuple[str, Callable[[str], Awaitable[Any]]]]:
    """(label, one request for the group of that name), in the order a new group's are made."""

    def apply(build: Callable[[GroupSpec], dict[str, Any] | None]) -> Callable[[str], Awaitable[Any]]:
        async def one(name: str) -> Any:
            obj = build(specs[name])
            assert obj is not None
            return await reconcile.apply(client, obj)
        return one

    async def status(name: str) -> Any:
        spec, pod = specs[name], f"{name}-a"
        leader = {"metadata": {"name": pod, "annotations": pod_annotations(pod, "leader", 1)},
                  "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        observed = reconcile.observed_from([leader], None, None, spec.generation)
        return await client.request("PATCH", reconcile.cr_path(NAMESPACE, name) + "/status",
                                    body={"status": compute_status(spec, observed, {})},
                                    content_type="application/merge-patch+json", timeout=30)

    pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
    return [
        ("apply ServiceAccount (create)", apply(resources.service_account)),
        ("apply Role (create)", apply(resources.role)),
        ("apply RoleBinding (create)", apply(resources.role_binding)),
        ("apply Deployment (create)", apply(resources.deployment)),
        ("apply PodDisruptionBudget (create)", apply(resources.pod_disruption_budget)),
        ("apply Deployment (unchanged)", apply(resources.deployment)),
        ("GET SingletonService", lambda n: client.request("GET", f"{CR_PATH}/{n}", timeout=30)),
        ("LIST its pods", lambda n: client.request("GET", pods, params={"labelSelector": f"singleton.dev/group={n}"},
                                                   timeout=30)),
        ("GET Deployment", lambda n: reconcile.get_or_none(client, reconcile.workload_path(specs[n]))),
        ("PATCH status", status),
        ("POST Event", lambda n: reconcile.post_event(client, specs[n], "LeaderChanged", f"pod {n}-a leads")),
        ("PATCH an annotation (kopf's old record)",
         lambda n: client.request("PATCH", f"{CR_PATH}/{n}", body={"metadata": {"annotations": {
             "example.dev/record": "x" * 400}}}, content_type="application/merge-patch+json", timeout=30)),
    ]


async def run_once(plane: ControlPlane, groups: int, as_admin: bool = False) -> dict[str, float]:
    """API server CPU milliseconds per request, by kind."""
    assert plane.apiserver is not None
    names = [group_name(i) for i in range(groups)]
    costs: dict[str, float] = {}
    async with KubeClient(load_kube_config(str(plane.info.kubeconfig)), user_agent="api-costs") as admin:
        await bounded(50, [admin.request("POST", CR_PATH, body=cr_body(n), timeout=30) for n in names])
        await bounded(50, [make_pod(admin, n, "a", "leader", 1) for n in names])
        specs = {n: read_spec(await admin.request("GET", f"{CR_PATH}/{n}", timeout=30),
                              default_sidecar_image="example.invalid/sidecar:1") for n in names}
    kubeconfig = plane.info.kubeconfig if as_admin else chart_account(plane, plane.workdir)
    async with KubeClient(load_kube_config(str(kubeconfig)), user_agent="api-costs") as client:
        for label, one in request_kinds(client, specs):
            before = cpu_seconds(plane.apiserver.pid)
            await bounded(PARALLEL, [one(n) for n in names])
            costs[label] = 1000 * (cpu_seconds(plane.apiserver.pid) - before) / groups
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=500, help="SingletonServices, one request of each kind "
                        "per group (default 500)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each on a fresh control plane (default 3)")
    parser.add_argument("--as-admin", action="store_true",
                        help="send them as the test bed's admin, whose requests skip RBAC and its escalation "
                        "checks (default: the operator's ServiceAccount with the chart's RBAC)")
    args = parser.parse_args(argv)
    if args.groups < 1 or args.runs < 1:
        parser.error("--groups and --runs must be at least 1")
    runs = []
    for run in range(args.runs):
        print(f"run {run + 1}/{args.runs}", flush=True)
        with control_plane() as plane:
            runs.append(asyncio.run(run_once(plane, args.groups, args.as_admin)))
    whom = "the admin user" if args.as_admin else "the operator's ServiceAccount, the chart's RBAC"
    print(f"\nAPI server CPU per request, ms ({args.groups} of each, {PARALLEL} in flight, as {whom}; median, "
          f"min, max of {args.runs} run(s)):")
    for label in runs[0]:
        values = [r[label] for r in runs]
        print(f"  {label:<42} {statistics.median(values):6.2f}  ({min(values):.2f}..{max(values):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
