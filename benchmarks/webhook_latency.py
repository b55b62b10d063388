"""How long the pod webhook takes per admission, on the test bed's API server.

    .venv/bin/python -m benchmarks.webhook_latency --runs 3 --pods 200

Starts etcd + kube-apiserver (``failover.bench_servers``), the CRD, an operator process serving
the webhook over TLS (its own certificate), a MutatingWebhookConfiguration pointing at it, and
a SingletonService adopting a Deployment. Then, per run, creates ``--pods`` pods with
``dryRun=All`` (the API server admits them, webhooks included, and stores nothing), half with
the group label (the webhook injects the sidecar) and half without (it is not called),
interleaved. Prints, per run and over all runs, median and p99 of:

- the webhook's own time per admission (its log: read the group, build the patch);
- the API server's whole create with the webhook, without it, and the difference of the medians.

The goal (issue 13): p99 ≤ 20 ms per pod admission.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

from benchmarks.failover import bench_servers
from singleton_election import contract
from singleton_election.kube import KubeClient, load_kube_config
from singleton_testbed.controlplane import wait_established
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.ledger import percentile
from singleton_testbed.procs import free_port

CRD = Path(__file__).resolve().parent.parent / "crds" / "singleton.dev_singletonservices.yaml"
NAMESPACE = "bench"
GROUP = "poller"
ADMISSION_LINE = re.compile(r"pod admission .* patched=True duration_seconds=(\S+)")  # the operator's text log


def pod(labelled: bool) -> dict[str, object]:
    labels = {"app": "poller", **({contract.LABEL_GROUP: GROUP} if labelled else {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p-{uuid.uuid4().hex[:10]}", "labels": labels},
            "spec": {"containers": [{"name": "poller", "image": "vendor/poller:1", "command": ["/poll"]}]}}


async def create_pods(kubeconfig: Path, count: int) -> tuple[list[float], list[float]]:
    """Seconds per dry-run create: (with the webhook, without)."""
    with_hook: list[float] = []
    without: list[float] = []
    async with KubeClient(load_kube_config(str(kubeconfig)), user_agent="webhook-bench") as client:
        for index in range(count):
            labelled = index % 2 == 0
            started = time.perf_counter()
            created = await client.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body=pod(labelled),
                                           params={"dryRun": "All"}, timeout=10)
            elapsed = time.perf_counter() - started
            injected = any(c["name"] == "singleton-sidecar" for c in created["spec"].get("initContainers") or [])
            if injected != labelled:
                raise SystemExit(f"pod {index}: injected={injected}, labelled={labelled}: the webhook misbehaves")
            (with_hook if labelled else without).append(elapsed)
    return with_hook, without


def webhook_seconds(log: str, skip: int) -> list[float]:
    return [float(m.group(1)) for m in ADMISSION_LINE.finditer(log)][skip:]


def line(name: str, values: list[float]) -> str:
    return (f"{name:<36} n={len(values):<4} median={statistics.median(values) * 1000:7.2f} ms  "
            f"p99={percentile(values, 0.99) * 1000:7.2f} ms  max={max(values) * 1000:7.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pods", type=int, default=200, help="dry-run pod creates per run (half labelled)")
    args = parser.parse_args()
    if args.runs < 1 or args.pods < 2:
        parser.error("--runs must be at least 1 and --pods at least 2")
    with bench_servers("singleton-webhook-bench-") as (_dsn, control_plane, workdir):
        kubeconfig = control_plane.info.kubeconfig
        control_plane.kubectl("apply", "-f", str(CRD))
        wait_established(control_plane.kubectl, "crd/singletonservices.singleton.dev")
        port = free_port()
        configuration = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "singleton-bench"},
            "webhooks": [{"name": "pods.singleton.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": "Fail", "timeoutSeconds": 5,
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                     "resources": ["pods"], "scope": "Namespaced"}],
                          "objectSelector": {"matchExpressions": [{"key": contract.LABEL_GROUP,
                                                                   "operator": "Exists"}]},
                          "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate-pods"}}]}
        control_plane.kubectl("apply", "-f", "-", input_text=json.dumps(configuration))
        group = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": GROUP},
                 "spec": {"workloadRef": {"kind": "Deployment", "name": GROUP}, "gating": {"mode": "file"}}}
        control_plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input_text=json.dumps(group))
        operator = OperatorProcess(kubeconfig, NAMESPACE, workdir / "operator.log", name="bench",
                                   extra_args=["--namespace", NAMESPACE, "--webhook-listen", f"127.0.0.1:{port}",
                                               "--webhook-extra-name", "127.0.0.1",
                                               "--webhook-config", "singleton-bench", "--log-level", "info"])
        operator.start()
        try:
            deadline = time.monotonic() + 30
            while "pod webhook serving" not in operator.log():
                if time.monotonic() > deadline or not operator.alive():
                    raise SystemExit(f"the operator did not serve the webhook:\n{operator.log()[-2000:]}")
                time.sleep(0.2)
            asyncio.run(create_pods(kubeconfig, 10))  # warm-up: connections, the caBundle in place
            all_hook: list[float] = []
            all_with: list[float] = []
            all_without: list[float] = []
            for run in range(args.runs):
                seen = len(webhook_seconds(operator.log(), 0))
                with_hook, without = asyncio.run(create_pods(kubeconfig, args.pods))
                time.sleep(0.5)  # the last log lines
                hook = webhook_seconds(operator.log(), seen)
                print(f"run {run + 1}:")
                print("  " + line("webhook's own time", hook))
                print("  " + line("API create with the webhook", with_hook))
                print("  " + line("API create without it", without))
                all_hook += hook
                all_with += with_hook
                all_without += without
            print(f"all {args.runs} runs:")
            print("  " + line("webhook's own time", all_hook))
            print("  " + line("API create with the webhook", all_with))
            print("  " + line("API create without it", all_without))
            added = statistics.median(all_with) - statistics.median(all_without)
            print(f"  the webhook adds {added * 1000:.2f} ms to a pod create (difference of medians); "
                  f"goal: p99 <= 20 ms per admission")
        finally:
            operator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
