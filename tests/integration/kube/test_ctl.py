"""kubectl singleton (the `kubectl-singleton` plugin: the official client's kubeconfig loader,
the project's request client) against the real API server, with real sidecar processes
playing the pods of a group (the sidecar's own service account) and, for `release`, a real
operator process carrying the request out."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from singleton_operator.release_request import RELEASE_REQUEST, RELEASE_RESULT
from singleton_testbed.controlplane import ADMIN_USER
from singleton_testbed.harness.kubehelpers import get_json, grant, service_account_kubeconfig
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import one_leader, wait_for
from tests.conftest import Cluster
from tests.integration.kube.test_sidecar_kube import Factory, PodSidecar, group, pod_sidecars, sidecar_kubeconfig  # noqa: F401

SLOW = {"SINGLETON_LEASE_DURATION": "4", "SINGLETON_RENEW_DEADLINE": "3", "SINGLETON_RETRY_PERIOD": "1"}
BIN = Path(sys.executable).parent
PLUGIN = BIN / "kubectl-singleton"


def ctl(cluster: Cluster, *args: str, kubeconfig: Path | None = None, env: dict[str, str] | None = None,
        program: Path = PLUGIN) -> subprocess.CompletedProcess[str]:
    """Run the plugin as kubectl would: the console script, found on PATH under its plugin name."""
    return subprocess.run([str(program), "--kubeconfig", str(kubeconfig or cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=90, check=False, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def operator(cluster: Cluster, singleton_crd: Path, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator, watching the test's namespace: it carries release requests out."""
    op = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "op.log",
                         extra_args=["--namespace", namespace]).start()
    try:
        wait_for(lambda: op.role() == "leader", 30, "the operator to lead", 0.1)
        yield op
    finally:
        op.stop()


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


@pytest.mark.usefixtures("singleton_crd")
def test_a_handover_that_no_standby_takes_says_the_old_leader_leads_again(
        cluster: Cluster, namespace: str, group: str, pod_sidecars: Factory) -> None:  # noqa: F811
    """The chosen standby is frozen (SIGSTOP): the leader steps down, stands aside a lease
    duration and takes the lock back. The plugin says so at once, not after its timeout."""
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    started = pod_sidecars("lease", 2, extra=SLOW)
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    for sidecar in started:
        cluster.kubectl("patch", "pod", sidecar.pod, "-n", namespace, "--subresource=status", "--type=strategic",
                        "-p", json.dumps(ready))
    leader = one_leader(started)
    target = next(m for m in started if m is not leader)
    wait_for(lambda: role_of(cluster, leader) == "leader" and role_of(cluster, target) == "standby", 10,
             "both pods annotated", 0.1)
    assert target.popen is not None
    target.popen.send_signal(signal.SIGSTOP)
    try:
        result = ctl(cluster, "handover", group, "-n", namespace, "--to", target.pod, "--timeout", "40")
    finally:
        target.popen.send_signal(signal.SIGCONT)
    assert result.returncode == 1
    assert f"{leader.pod} stepped down but no other replica of group {namespace}/{group} took the lock, " \
           "and it leads again" in result.stderr, result.stderr
    assert role_of(cluster, leader) == "leader"


def test_release_is_carried_out_by_the_operator(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                                members: list[PodSidecar], operator: OperatorProcess) -> None:
    leader = one_leader(members)
    unconfirmed = ctl(cluster, "release", group, "-n", namespace)
    assert unconfirmed.returncode == 1 and "--yes" in unconfirmed.stderr
    asked_at = time.monotonic()
    result = ctl(cluster, "release", group, "-n", namespace, "--yes")
    assert result.returncode == 0, result.stderr + operator.log()
    assert result.stdout.startswith(f"cleared Lease holder {leader.pod}/"), result.stdout
    # The old leader sees its Lease taken from it and stops; someone leads again, but only once
    # the cleared term has expired (lease 4 s after a renewal at most 1 s before the release).
    wait_for(lambda: not leader.ready(), 3, "the old leader to stop", 0.02)
    one_leader(members, timeout=10)
    assert time.monotonic() - asked_at >= 2.5, "a standby took the force-released Lease before its term expired"
    events: list[dict[str, Any]] = get_json(cluster, "events", "-n", namespace, "--field-selector",
                                            f"involvedObject.name={group}")["items"]
    released = [e for e in events if e["reason"] == "LockReleased"]
    who = "" if cluster.control_plane is None else ADMIN_USER
    assert len(released) == 1 and f"{who} force-released the lock" in released[0]["message"], released
    assert released[0]["reportingComponent"] == "singleton.dev/singleton-operator", released[0]
    # The answer is on the object, under the request's id, naming the requester.
    annotations = get_json(cluster, "singletonservice", group, "-n", namespace)["metadata"]["annotations"]
    request, answer = json.loads(annotations[RELEASE_REQUEST]), json.loads(annotations[RELEASE_RESULT])
    assert answer["id"] == request["id"] and answer["by"] == request["by"] and answer["error"] is None
    # -o json: the same answer, machine-readable; a second request is a new one.
    again = ctl(cluster, "release", group, "-n", namespace, "--yes", "-o", "json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["done"][0].startswith("cleared Lease holder"), again.stdout
    history = ctl(cluster, "history", group, "-n", namespace, "-o", "yaml")
    assert sum(r["reason"] == "LockReleased" for r in yaml.safe_load(history.stdout)) == 2


def test_release_without_an_operator_times_out_and_withdraws(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                                             members: list[PodSidecar]) -> None:
    leader = one_leader(members)
    result = ctl(cluster, "release", group, "-n", namespace, "--yes", "--timeout", "1.5")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kubectl singleton: error: no operator answered the release request for group {namespace}/{group} "
        f"within 1.5s; it was withdrawn (is the operator running and watching namespace {namespace}?)")
    annotations = get_json(cluster, "singletonservice", group, "-n", namespace)["metadata"].get("annotations") or {}
    assert RELEASE_REQUEST not in annotations, annotations
    assert leader.ready(), "nothing was released"


@pytest.mark.usefixtures("singleton_crd")
async def test_release_of_a_postgres_group_ends_the_holders_session(  # noqa: PLR0917
        cluster: Cluster, namespace: str, group: str, pg_dsn: str, pod_sidecars: Factory,  # noqa: F811
        operator: OperatorProcess) -> None:
    """The operator finds the holder's row under the group's namespace-qualified key and
    ends its session with the DSN from the group's Secret; the plugin never connects."""
    cluster.kubectl("create", "secret", "generic", "pg", "-n", namespace, f"--from-literal=dsn={pg_dsn}")
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"backend": "postgres", "postgres": {"secretRef": {"name": "pg"}},
                     "template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    members = pod_sidecars("postgres", 2, extra=SLOW)
    leader = one_leader(members)
    conn = await asyncpg.connect(pg_dsn)
    try:
        pid = await conn.fetchval("SELECT holder_pid FROM singleton_leases WHERE group_name = $1",
                                  f"{namespace}/{group}")
        assert pid is not None
        result = ctl(cluster, "release", group, "-n", namespace, "--yes")
        assert result.returncode == 0, result.stderr + operator.log()
        assert result.stdout.startswith(f"ended the PostgreSQL session of holder {leader.pod}/"), result.stdout
        # The holder's session really ended.
        assert not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid)
    finally:
        await conn.close()
    wait_for(lambda: not leader.ready(), 3, "the old leader to stop", 0.02)
    one_leader(members, timeout=10)


@pytest.mark.usefixtures("singleton_crd")
def test_release_of_a_pooled_group_says_the_row_frees_at_its_expiry(  # noqa: PLR0917
        cluster: Cluster, namespace: str, group: str, pg_dsn: str, pod_sidecars: Factory,  # noqa: F811
        operator: OperatorProcess) -> None:
    """A pooled term is a row held by no session: the operator says so instead of reporting a
    release it did not carry out, and the leader keeps its term."""
    cluster.kubectl("create", "secret", "generic", "pg", "-n", namespace, f"--from-literal=dsn={pg_dsn}")
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"backend": "postgres", "postgres": {"secretRef": {"name": "pg"}, "mode": "pooled"},
                     "template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    members = pod_sidecars("postgres", 2, extra={**SLOW, "SINGLETON_POSTGRES_MODE": "pooled"})
    leader = one_leader(members)
    token = (leader.leader_doc() or {})["token"]
    result = ctl(cluster, "release", group, "-n", namespace, "--yes")
    assert result.returncode == 0, result.stderr + operator.log()
    assert result.stdout.startswith(f"PostgreSQL holder {leader.pod}/"), result.stdout
    assert "(pooled mode: no session to end) keeps its row until it expires, in " in result.stdout
    assert leader.ready() and (leader.leader_doc() or {})["token"] == token


@pytest.mark.usefixtures("singleton_crd")
def test_the_charts_operator_role_is_enough_to_release(  # noqa: PLR0917
        cluster: Cluster, namespace: str, group: str, pg_dsn: str, pod_sidecars: Factory,  # noqa: F811
        tmp_path: Path) -> None:
    """No permission was added for release: the operator running as the chart's
    ServiceAccount, with exactly its ClusterRole and Role, carries out a postgres release
    (the group's Secret read by name, the CR annotated, the Event recorded)."""
    from singleton_testbed.harness.kubehelpers import bound_token, token_kubeconfig
    from tests.integration.kube.test_rbac import helm_template

    release = "rel-" + secrets.token_hex(2)
    objects = helm_template(release, namespace, "--show-only=templates/serviceaccount.yaml",
                            "--show-only=templates/clusterrole.yaml", "--show-only=templates/role.yaml")
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    cluster_scoped = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects
                      if o["kind"].startswith("Cluster")]
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, bound_token(cluster, namespace, account), namespace,
                                  tmp_path / "op.kubeconfig")
    op = OperatorProcess(kubeconfig, namespace, tmp_path / "op.log", extra_args=["--namespace", namespace]).start()
    try:
        wait_for(lambda: op.role() == "leader", 30, "the operator to lead", 0.1)
        cluster.kubectl("create", "secret", "generic", "pg", "-n", namespace, f"--from-literal=dsn={pg_dsn}")
        body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
                "spec": {"backend": "postgres", "postgres": {"secretRef": {"name": "pg"}},
                         "template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
        cluster.apply(json.dumps(body), namespace=namespace)
        members = pod_sidecars("postgres", 2, extra=SLOW)
        leader = one_leader(members)
        result = ctl(cluster, "release", group, "-n", namespace, "--yes")
        assert result.returncode == 0, result.stderr + op.log()[-3000:]
        assert result.stdout.startswith(f"ended the PostgreSQL session of holder {leader.pod}/"), result.stdout
        assert "forbidden" not in op.log().lower(), op.log()[-3000:]
    finally:
        op.stop()
        cluster.kubectl("delete", *cluster_scoped, "--ignore-not-found", check=False)


@pytest.mark.usefixtures("singleton_crd")
def test_a_release_the_operator_cannot_carry_out_is_reported(cluster: Cluster, namespace: str, group: str,  # noqa: F811
                                                             operator: OperatorProcess) -> None:
    cluster.kubectl("create", "secret", "generic", "pg", "-n", namespace,
                    "--from-literal=dsn=postgresql://nobody@127.0.0.1:1/none")
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": group},
            "spec": {"backend": "postgres", "postgres": {"secretRef": {"name": "pg"}},
                     "template": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}
    cluster.apply(json.dumps(body), namespace=namespace)
    result = ctl(cluster, "release", group, "-n", namespace, "--yes")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kubectl singleton: error: the operator could not release the lock of group {namespace}/{group}: "
        f"cannot connect with the DSN in Secret {namespace}/pg: [Errno 111] Connect call failed ('127.0.0.1', 1)"
    ), result.stderr
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={group}")
    failed = [e for e in events["items"] if e["reason"] == "LockReleaseFailed"]
    assert len(failed) == 1 and failed[0]["type"] == "Warning", failed


def test_the_plugin_loads_no_database_driver(cluster: Cluster, namespace: str) -> None:
    probe = ("import sys, runpy; sys.argv = ['kubectl-singleton', '--kubeconfig', sys.argv[1], 'status', '-n', "
             "sys.argv[2]]\ntry:\n    runpy.run_module('singleton_ctl.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\nprint('asyncpg' in sys.modules, 'kopf' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe, str(cluster.kubeconfig), namespace], capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False False", result.stdout


def test_errors_are_one_clear_line(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    unknown = ctl(cluster, "status", "nope", "-n", namespace)
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (f"kubectl singleton: error: no SingletonService 'nope' in namespace "
                                      f"'{namespace}' (list them with: kubectl singleton status -n {namespace})")
    alias = ctl(cluster, "status", "nope", "-n", namespace, program=BIN / "singletonctl")
    assert alias.stderr.startswith("singletonctl: error: no SingletonService 'nope'"), alias.stderr
    grant(cluster, namespace, "nobody", [])
    kubeconfig = service_account_kubeconfig(cluster, namespace, "nobody", tmp_path / "nobody.kubeconfig")
    denied = ctl(cluster, "status", "-n", namespace, kubeconfig=kubeconfig)
    assert denied.returncode == 1 and denied.stderr.startswith("kubectl singleton: error: forbidden: 403 Forbidden:")
    assert len(denied.stderr.strip().splitlines()) == 1, denied.stderr
    config = (tmp_path / "nobody.kubeconfig").read_text()
    server = next(line.split("server:")[1].strip() for line in config.splitlines() if "server:" in line)
    (tmp_path / "dead.kubeconfig").write_text(config.replace(server, "https://127.0.0.1:1"))
    dead = ctl(cluster, "status", kubeconfig=tmp_path / "dead.kubeconfig")
    assert dead.returncode == 1 and dead.stderr.startswith("kubectl singleton: error: cannot reach the API server: ")
    assert len(dead.stderr.strip().splitlines()) == 1, dead.stderr
