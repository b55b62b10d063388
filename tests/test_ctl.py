"""singletonctl against the real API server, with real sidecar processes playing the pods of
a group (lease backend, the sidecar's own service account)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from singleton_testbed.controlplane import ADMIN_USER
from tests.conftest import Cluster
from tests.kubehelpers import get_json, grant, service_account_kubeconfig
from tests.sidecars import one_leader, wait_for
from tests.test_sidecar_kube import Factory, PodSidecar, group, pod_sidecars, sidecar_kubeconfig  # noqa: F401

SLOW = {"SINGLETON_LEASE_DURATION": "4", "SINGLETON_RENEW_DEADLINE": "3", "SINGLETON_RETRY_PERIOD": "1"}


def ctl(cluster: Cluster, *args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "singleton_ctl.cli", "--kubeconfig",
                           str(kubeconfig or cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)


@pytest.fixture
def members(cluster: Cluster, singleton_crd: Path, namespace: str, group: str,  # noqa: F811
            pod_sidecars: Factory) -> list[PodSidecar]:  # noqa: F811
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    started = pod_sidecars("lease", 3, extra=SLOW)
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    for sidecar in started:  # as a kubelet would: the pods have no kubelet here
        cluster.kubectl("patch", "pod", sidecar.pod, "-n", namespace, "--subresource=status", "--type=strategic",
                        "-p", json.dumps(ready))
    leader = one_leader(started)
    wait_for(lambda: role_of(cluster, leader) == "leader", 10, "the leader's annotation", 0.1)
    return started


def role_of(cluster: Cluster, sidecar: PodSidecar) -> str | None:
    pod = get_json(cluster, "pod", sidecar.pod, "-n", sidecar.namespace)
    role: str | None = (pod["metadata"].get("annotations") or {}).get("singleton.dev/role")
    return role


def test_status_shows_the_leader_and_standbys(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                              members: list[PodSidecar]) -> None:
    leader = one_leader(members)
    wait_for(lambda: all(role_of(cluster, m) for m in members), 10, "every pod annotated", 0.1)
    result = ctl(cluster, "status", group, "-n", namespace, "-o", "json")
    assert result.returncode == 0, result.stderr
    (view,) = json.loads(result.stdout)
    roles = {m["pod"]: m["role"] for m in view["members"]}
    assert roles == {m.pod: "leader" if m is leader else "standby" for m in members}
    table = ctl(cluster, "status", group, "-n", namespace).stdout
    assert "POD" in table and leader.pod in table and "standby" in table
    listing = ctl(cluster, "status", "-A", "-o", "yaml")
    assert listing.returncode == 0 and f"name: {group}" in listing.stdout


def test_handover_to_a_chosen_standby(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                      members: list[PodSidecar]) -> None:
    leader = one_leader(members)
    target = next(m for m in members if m is not leader)
    result = ctl(cluster, "handover", group, "-n", namespace, "--to", target.pod)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{target.pod} leads group")
    assert one_leader(members) is target
    reasons = {e["reason"] for e in get_json(cluster, "events", "-n", namespace, "--field-selector",
                                             f"involvedObject.name={group}")["items"]}
    assert {"HandoverRequested", "HandoverDone"} <= reasons
    # A second time, to the remaining standby: the hold of the first request is over.
    last = next(m for m in members if m not in (leader, target))
    result = ctl(cluster, "handover", group, "-n", namespace, "--to", last.pod)
    assert result.returncode == 0, result.stderr
    assert one_leader(members) is last
    history = ctl(cluster, "history", group, "-n", namespace, "-o", "json")
    assert history.returncode == 0
    assert sum(r["reason"] == "HandoverDone" for r in json.loads(history.stdout)) == 2


def test_handover_refuses_a_pod_that_is_not_a_ready_standby(cluster: Cluster, namespace: str,
                                                            group: str, members: list[PodSidecar]) -> None:  # noqa: F811
    leader = one_leader(members)
    result = ctl(cluster, "handover", group, "-n", namespace, "--to", leader.pod)
    assert result.returncode == 1 and "already leads" in result.stderr
    result = ctl(cluster, "handover", group, "-n", namespace, "--to", "nope-0")
    assert result.returncode == 1 and "is not a ready standby" in result.stderr


def test_release_clears_the_lock_and_records_who(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                                 members: list[PodSidecar]) -> None:
    leader = one_leader(members)
    unconfirmed = ctl(cluster, "release", group, "-n", namespace)
    assert unconfirmed.returncode == 1 and "--yes" in unconfirmed.stderr
    result = ctl(cluster, "release", group, "-n", namespace, "--yes")
    assert result.returncode == 0, result.stderr
    assert "cleared Lease holder" in result.stdout
    # The old leader sees its Lease taken from it and stops; someone leads again.
    wait_for(lambda: not leader.ready(), 3, "the old leader to stop", 0.02)
    one_leader(members, timeout=10)
    events: list[dict[str, Any]] = get_json(cluster, "events", "-n", namespace, "--field-selector",
                                            f"involvedObject.name={group}")["items"]
    released = [e["message"] for e in events if e["reason"] == "LockReleased"]
    who = "" if cluster.control_plane is None else ADMIN_USER
    assert released and f"{who} force-released the lock" in released[0], released


@pytest.mark.usefixtures("singleton_crd")
def test_release_of_a_postgres_group_ends_the_holders_session(
        cluster: Cluster, namespace: str, group: str, pg_dsn: str, pod_sidecars: Factory) -> None:  # noqa: F811
    """The holder's row is found under the group's namespace-qualified key."""
    cluster.kubectl("create", "secret", "generic", "pg", "-n", namespace, f"--from-literal=dsn={pg_dsn}")
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"backend": "postgres", "postgres": {"secretRef": {"name": "pg"}},
                     "template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    members = pod_sidecars("postgres", 2, extra=SLOW)
    leader = one_leader(members)
    result = ctl(cluster, "release", group, "-n", namespace, "--yes")
    assert result.returncode == 0, result.stderr
    assert "ended the PostgreSQL session of holder" in result.stdout, result.stdout
    wait_for(lambda: not leader.ready(), 3, "the old leader to stop", 0.02)
    one_leader(members, timeout=10)


def test_errors_are_one_clear_line(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    unknown = ctl(cluster, "status", "nope", "-n", namespace)
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (f"singletonctl: error: no SingletonService 'nope' in namespace "
                                      f"'{namespace}' (list them with: singletonctl status -n {namespace})")
    grant(cluster, namespace, "nobody", [])
    kubeconfig = service_account_kubeconfig(cluster, namespace, "nobody", tmp_path / "nobody.kubeconfig")
    denied = ctl(cluster, "status", "-n", namespace, kubeconfig=kubeconfig)
    assert denied.returncode == 1 and denied.stderr.startswith("singletonctl: error: forbidden:"), denied.stderr
    config = (tmp_path / "nobody.kubeconfig").read_text()
    server = next(line.split("server:")[1].strip() for line in config.splitlines() if "server:" in line)
    (tmp_path / "dead.kubeconfig").write_text(config.replace(server, "https://127.0.0.1:1"))
    dead = ctl(cluster, "status", kubeconfig=tmp_path / "dead.kubeconfig")
    assert dead.returncode == 1 and "cannot reach the API server" in dead.stderr, dead.stderr
    assert len(dead.stderr.strip().splitlines()) == 1
