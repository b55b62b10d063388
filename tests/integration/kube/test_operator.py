"""The operator process against the real API server (and controller-manager where owned
objects must be garbage-collected): owned objects, status from pods, bad inputs, HA.

Pods do not run here (that is the end-to-end suite on the real node): the tests
play the sidecars by writing their annotations on the pods the Deployment created."""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import bound_token, get_json, token_kubeconfig
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster

Factory = Callable[..., OperatorProcess]


@pytest.fixture
def operators(cluster: Cluster, singleton_crd: Path, namespace: str, tmp_path: Path) -> Iterator[Factory]:
    started: list[OperatorProcess] = []

    def make(name: str = "op-a") -> OperatorProcess:
        # Watch only this test's namespace, so operators of parallel tests don't meet.
        op = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / f"{name}.log", name=name,
                             extra_args=["--namespace", namespace])
        started.append(op.start())
        return op

    yield make
    for op in started:
        op.stop()


def service(name: str, **spec: Any) -> str:
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [
                {"name": "app", "image": "example.invalid/app:1", "command": ["sleep", "infinity"]}]}}, **spec}}
    return json.dumps(body)


def cr(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return get_json(cluster, "singletonservice", name, "-n", namespace)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def exists(cluster: Cluster, namespace: str, kind: str, name: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", namespace, check=False).returncode == 0


def test_owned_objects_are_created_with_owner_references(cluster: Cluster, namespace: str,
                                                         operators: Factory) -> None:
    operators()
    name = "feed-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name, service={"ports": [{"port": 80}]}), namespace=namespace)
    account = f"singleton-sidecar-{name}"
    for kind, obj in [("deployment", name), ("serviceaccount", account), ("role", account),
                      ("rolebinding", account), ("service", f"{name}-leader"), ("pdb", name)]:
        found = wait_for(lambda k=kind, o=obj: exists(cluster, namespace, k, o) or None, 20, f"{kind} {obj}", 0.2)
        assert found
        owner = get_json(cluster, kind, obj, "-n", namespace)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("SingletonService", name, True)
    deployment = get_json(cluster, "deployment", name, "-n", namespace)
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["name"] == "singleton-sidecar" and sidecar["restartPolicy"] == "Always"
    status = wait_for(lambda: (cr(cluster, namespace, name).get("status") or {}).get("phase") and
                      cr(cluster, namespace, name)["status"], 10, "a status", 0.2)
    assert status["observedGeneration"] == cr(cluster, namespace, name)["metadata"]["generation"]
    # kopf's state stays in the operator's memory: no record of the handled spec, no progress
    # on the object (only a retry would leave kopf's touch and its marker).
    prefix = f"operator.{contract.API_GROUP}/"
    annotations = cr(cluster, namespace, name)["metadata"].get("annotations") or {}
    assert not [key for key in annotations if key.startswith(prefix)
                and key not in (f"{prefix}touch-dummy", f"{prefix}kopf-managed")], annotations
    # Idempotent: deleting an owned object brings it back.
    cluster.kubectl("delete", "deployment", name, "-n", namespace)
    wait_for(lambda: exists(cluster, namespace, "deployment", name) or None, 20, "the Deployment to return", 0.2)


def test_spec_edits_roll_out(cluster: Cluster, namespace: str, operators: Factory) -> None:
    operators()
    name = "edit-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "deployment", name) or None, 20, "the Deployment", 0.2)
    cluster.kubectl("patch", "singletonservice", name, "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"replicas": 3, "drain": {"timeout": "7s"}}}))

    def rolled() -> bool:
        deployment = get_json(cluster, "deployment", name, "-n", namespace)
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["initContainers"][0]["env"]}
        return bool(deployment["spec"]["replicas"] == 3 and env[contract.ENV_DRAIN_TIMEOUT] == "7")

    wait_for(rolled, 20, "the edit to reach the Deployment", 0.2)


def test_missing_secret_is_reported_and_nothing_is_created_until_it_exists(
    cluster: Cluster, namespace: str, operators: Factory, pg_dsn: str
) -> None:
    operator = operators()
    name = "pg-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name, backend="postgres", postgres={"secretRef": {"name": "feed-db"}}),
                  namespace=namespace)
    degraded = wait_for(lambda: condition(cr(cluster, namespace, name), "Degraded"), 20, "a Degraded condition", 0.2)
    assert degraded["status"] == "True" and degraded["reason"] == "SecretNotFound"
    database = condition(cr(cluster, namespace, name), "DatabaseReachable")
    assert database is not None and (database["status"], database["reason"]) == ("False", "SecretNotFound")
    # The failed reconciles are counted per group and reason; the build is described.
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(operator.get("/metrics")[1]) for sample in family.samples}
    errors = (("group", name), ("namespace", namespace), ("reason", "SecretNotFound"))
    assert samples[("singleton_operator_reconcile_errors_total", errors)] >= 1
    assert [value for (metric, _), value in samples.items() if metric == "singleton_operator_build_info"] == [1.0]
    assert f"Secret {namespace}/feed-db" in degraded["message"]
    assert cr(cluster, namespace, name)["status"]["phase"] == "Failed"
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    assert "SecretNotFound" in {e["reason"] for e in events["items"]}
    assert not exists(cluster, namespace, "deployment", name)
    assert not exists(cluster, namespace, "serviceaccount", f"singleton-sidecar-{name}")
    # A Secret with the wrong key is named as such.
    cluster.kubectl("create", "secret", "generic", "feed-db", "-n", namespace, "--from-literal=url=x")
    wait_for(lambda: (condition(cr(cluster, namespace, name), "Degraded") or {}).get("reason") == "SecretKeyMissing",
             20, "SecretKeyMissing", 0.2)
    # An unreachable server is named as such, without the password.
    unreachable = "postgresql://singleton:hunter2@127.0.0.1:1/singleton"
    patch = {"data": {"dsn": base64.b64encode(unreachable.encode()).decode()}}
    cluster.kubectl("patch", "secret", "feed-db", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    bad = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Degraded")) and
                   c["reason"] == "PostgresUnreachable" and c, 20, "PostgresUnreachable", 0.2)
    assert "hunter2" not in bad["message"]
    assert not exists(cluster, namespace, "deployment", name)
    database = condition(cr(cluster, namespace, name), "DatabaseReachable")
    assert database is not None and (database["status"], database["reason"]) == ("False", "PostgresUnreachable")
    assert "cannot connect with the DSN in Secret" in database["message"] and "hunter2" not in database["message"]
    # Fixed: the workload appears and the problem is gone.
    patch = {"data": {"dsn": base64.b64encode(pg_dsn.encode()).decode()}}
    cluster.kubectl("patch", "secret", "feed-db", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait_for(lambda: exists(cluster, namespace, "deployment", name) or None, 20, "the Deployment", 0.2)
    wait_for(lambda: (condition(cr(cluster, namespace, name), "Degraded") or {}).get("reason") != "PostgresUnreachable",
             20, "the problem to clear", 0.2)
    database = condition(cr(cluster, namespace, name), "DatabaseReachable")
    assert database is not None and (database["status"], database["reason"]) == ("True", "Connected")


def test_with_connection_check_warn_an_unreachable_database_is_applied_with_a_condition_and_an_event(
    cluster: Cluster, namespace: str, singleton_crd: Path, tmp_path: Path, pg_dsn: str
) -> None:
    """Where only the app's pods reach the database (a proxy sidecar on localhost, say). warn
    comes from the operator's environment (the group sets none), skip from the group."""
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "op.log",
                               extra_args=["--namespace", namespace],
                               env={"SINGLETON_POSTGRES_CONNECTION_CHECK": "warn"}).start()
    try:
        _warned_then_reachable_then_skipped(cluster, namespace, pg_dsn)
    finally:
        operator.stop()


def _warned_then_reachable_then_skipped(cluster: Cluster, namespace: str, pg_dsn: str) -> None:
    name = "pgw-" + uuid.uuid4().hex[:4]
    unreachable = "postgresql://singleton:hunter2@127.0.0.1:1/singleton"
    cluster.kubectl("create", "secret", "generic", "feed-db", "-n", namespace, f"--from-literal=dsn={unreachable}")
    cluster.apply(service(name, backend="postgres", postgres={"secretRef": {"name": "feed-db"}}), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "deployment", name) or None, 20, "the Deployment", 0.2)
    database = wait_for(lambda: condition(cr(cluster, namespace, name), "DatabaseReachable"), 20,
                        "a DatabaseReachable condition", 0.2)
    assert (database["status"], database["reason"]) == ("False", "PostgresUnreachable")
    assert "cannot connect with the DSN in Secret" in database["message"] and "hunter2" not in database["message"]
    status = cr(cluster, namespace, name)["status"]
    assert status["phase"] != "Failed" and status["observedGeneration"] == cr(cluster, namespace, name)["metadata"][
        "generation"]
    assert (condition(cr(cluster, namespace, name), "Stalled") or {}).get("status") == "False"
    events = wait_for(lambda: [e for e in get_json(cluster, "events", "-n", namespace, "--field-selector",
                                                   f"involvedObject.name={name}")["items"]
                               if e["reason"] == "PostgresUnreachable"] or None, 10, "a Warning Event", 0.2)
    assert events[0]["type"] == "Warning" and "hunter2" not in events[0]["message"]
    # Reachable now: the check, tried again (after 5 s the first time), turns the condition True.
    patch = {"data": {"dsn": base64.b64encode(pg_dsn.encode()).decode()}}
    cluster.kubectl("patch", "secret", "feed-db", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait_for(lambda: (condition(cr(cluster, namespace, name), "DatabaseReachable") or {}).get("status") == "True",
             20, "the condition to turn True", 0.2)
    # skip: no connection at all, and the condition says so.
    cluster.kubectl("patch", "singletonservice", name, "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"postgres": {"connectionCheck": "skip"}}}))
    skipped = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "DatabaseReachable")) and
                       c["reason"] == "CheckSkipped" and c, 20, "CheckSkipped", 0.2)
    assert skipped["status"] == "Unknown"


def play_sidecar(cluster: Cluster, namespace: str, pod: str, role: str, token: int | None) -> None:
    annotations: dict[str, str | None] = {contract.ANNOTATION_ROLE: role,
                                          contract.ANNOTATION_TOKEN: str(token) if token else None,
                                          contract.ANNOTATION_LEADER_SINCE: "2026-11-25T10:00:00.000Z" if token
                                          else None}
    cluster.kubectl("annotate", "pod", pod, "-n", namespace, "--overwrite",
                    *[f"{k}={v}" if v is not None else f"{k}-" for k, v in annotations.items()])


def test_status_follows_the_pods_within_a_second_with_an_event(
    controllers: Cluster, namespace: str, operators: Factory
) -> None:
    cluster = controllers
    operator = operators()
    name = "st-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name), namespace=namespace)
    pods = wait_for(lambda: (items := get_json(cluster, "pods", "-n", namespace, "-l",
                                               f"{contract.LABEL_GROUP}={name}")["items"]) and len(items) == 2
                    and [p["metadata"]["name"] for p in items], 30, "two pods from the ReplicaSet", 0.2)
    play_sidecar(cluster, namespace, pods[0], "leader", 11)
    play_sidecar(cluster, namespace, pods[1], "standby", None)
    started = time.monotonic()
    wait_for(lambda: cr(cluster, namespace, name).get("status", {}).get("leader") == pods[0], 5, "leader", 0.05)
    assert time.monotonic() - started < 1.0
    play_sidecar(cluster, namespace, pods[0], "standby", None)
    play_sidecar(cluster, namespace, pods[1], "leader", 12)
    started = time.monotonic()
    status = wait_for(lambda: (s := cr(cluster, namespace, name).get("status", {})).get("leader") == pods[1] and s,
                      5, "the new leader", 0.05)
    assert time.monotonic() - started < 1.0
    assert status["token"] == 12 and status["transitions"] >= 1
    out = cluster.kubectl("get", "sgl", name, "-n", namespace).stdout
    assert pods[1] in out and "12" in out
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    messages = [e["message"] for e in events["items"] if e["reason"] == "LeaderChanged"]
    assert any(pods[1] in m and "token 12" in m for m in messages), messages
    # Counted per group like the Events: the first leader, then the second.
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(operator.get("/metrics")[1]) for sample in family.samples}
    assert samples[("singleton_operator_leader_changes_total", (("group", name), ("namespace", namespace)))] == 2


def operator_samples(operator: OperatorProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(operator.get("/metrics")[1]) for sample in family.samples}


def test_the_group_leaders_gauge_follows_the_pods_role_labels(
    controllers: Cluster, namespace: str, operators: Factory
) -> None:
    """singleton_group_leaders, from the operator alone (no sidecar scraped): what SingletonNoLeader
    reads when the groups' pods are not scraped."""
    cluster = controllers
    operator = operators()
    name = "gl-" + uuid.uuid4().hex[:4]
    series = ("singleton_group_leaders", (("group", name), ("namespace", namespace)))
    cluster.apply(service(name), namespace=namespace)
    pods = wait_for(lambda: (items := get_json(cluster, "pods", "-n", namespace, "-l",
                                               f"{contract.LABEL_GROUP}={name}")["items"]) and len(items) == 2
                    and [p["metadata"]["name"] for p in items], 30, "two pods from the ReplicaSet", 0.2)

    def role(pod: str, value: str) -> None:
        cluster.kubectl("label", "pod", pod, "-n", namespace, "--overwrite", f"{contract.LABEL_ROLE}={value}")

    def gauge_is(value: float) -> bool:
        return operator_samples(operator).get(series) == value

    # No pod says it leads yet (no sidecar runs here): 0, exported, so "no leader" can fire.
    wait_for(lambda: gauge_is(0.0) or None, 10, "the gauge at 0", 0.1)
    role(pods[0], contract.ROLE_LEADER)
    role(pods[1], contract.ROLE_STANDBY)
    wait_for(lambda: gauge_is(1.0) or None, 5, "the gauge at 1", 0.05)
    # Draining counts as leading (its term goes on until it releases the lock).
    role(pods[0], contract.ROLE_DRAINING)
    role(pods[1], contract.ROLE_LEADER)
    wait_for(lambda: gauge_is(2.0) or None, 5, "the gauge at 2", 0.05)
    role(pods[0], contract.ROLE_RELEASED)
    role(pods[1], contract.ROLE_STANDBY)
    wait_for(lambda: gauge_is(0.0) or None, 5, "the gauge back at 0", 0.05)
    # A deleted group's series goes with it.
    cluster.kubectl("delete", "singletonservice", name, "-n", namespace)
    wait_for(lambda: series not in operator_samples(operator) or None, 20, "the series to go", 0.2)


def test_deleting_the_service_removes_everything(controllers: Cluster, namespace: str, operators: Factory) -> None:
    cluster = controllers
    operators()
    name = "gone-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name, service={"ports": [{"port": 80}]}), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "pdb", name) or None, 20, "the objects", 0.2)
    cluster.kubectl("delete", "singletonservice", name, "-n", namespace)
    account = f"singleton-sidecar-{name}"
    for kind, obj in [("deployment", name), ("serviceaccount", account), ("role", account),
                      ("rolebinding", account), ("service", f"{name}-leader"), ("pdb", name)]:
        wait_for(lambda k=kind, o=obj: not exists(cluster, namespace, k, o), 30, f"{kind} {obj} to go", 0.2)
    selector = f"{contract.LABEL_GROUP}={name}"
    wait_for(lambda: not get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"], 30, "pods to go", 0.2)


def test_an_unwanted_leader_service_or_pdb_is_deleted_only_if_the_group_owns_it(
        cluster: Cluster, namespace: str, operators: Factory) -> None:
    operators()
    theirs, ours = "their-" + uuid.uuid4().hex[:4], "ours-" + uuid.uuid4().hex[:4]
    # A user's own Service and PodDisruptionBudget that happen to have the names a group's would.
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{theirs}-leader"},
         "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": theirs},
         "spec": {"selector": {"matchLabels": {"app": "theirs"}}, "maxUnavailable": 1}}]}), namespace=namespace)
    uids = {kind: get_json(cluster, kind, obj, "-n", namespace)["metadata"]["uid"]
            for kind, obj in (("service", f"{theirs}-leader"), ("pdb", theirs))}
    no_pdb = {"podDisruptionBudget": {"enabled": False}}
    cluster.apply(service(theirs, **no_pdb), namespace=namespace)
    cluster.apply(service(ours, service={"ports": [{"port": 80}]}), namespace=namespace)
    for kind, obj in (("service", f"{ours}-leader"), ("pdb", ours)):
        wait_for(lambda k=kind, o=obj: exists(cluster, namespace, k, o) or None, 20, f"the group's own {kind}", 0.2)
    # Edits, each reconciled: the first group still wants neither object; the second no longer does.
    cluster.kubectl("patch", "singletonservice", theirs, "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"replicas": 3}}))
    cluster.kubectl("patch", "singletonservice", ours, "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"service": None, **no_pdb}}))
    for kind, obj in (("service", f"{ours}-leader"), ("pdb", ours)):
        wait_for(lambda k=kind, o=obj: not exists(cluster, namespace, k, o), 20, f"the group's own {kind} to go", 0.2)
    wait_for(lambda: get_json(cluster, "deployment", theirs, "-n", namespace)["spec"]["replicas"] == 3, 20,
             "the first group's edit to be reconciled", 0.2)
    for kind, obj in (("service", f"{theirs}-leader"), ("pdb", theirs)):
        assert get_json(cluster, kind, obj, "-n", namespace)["metadata"]["uid"] == uids[kind], f"their {kind}"


def test_one_active_operator_and_fast_takeover_on_sigterm(
    cluster: Cluster, namespace: str, operators: Factory
) -> None:
    first, second = operators("op-a"), operators("op-b")
    wait_for(lambda: {first.role(), second.role()} == {"leader", "standby"}, 20, "one leader, one standby", 0.1)
    active, standby = (first, second) if first.role() == "leader" else (second, first)
    name = "ha-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "deployment", name) or None, 20, "the Deployment", 0.2)
    assert "starting kopf" not in standby.log()
    active.signal(signal.SIGTERM)
    started = time.monotonic()
    wait_for(lambda: standby.role() == "leader", 10, "the standby to take over", 0.02)
    takeover = time.monotonic() - started
    assert takeover < 3.0, takeover
    assert active.popen is not None and active.popen.wait(30) == 0
    # The new active one reconciles: a new group and a repaired one.
    other = "ha2-" + uuid.uuid4().hex[:4]
    cluster.apply(service(other), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "deployment", other) or None, 20, "a Deployment from the new leader",
             0.2)
    metrics = standby.get("/metrics")[1]
    assert "singleton_operator_is_leader 1.0" in metrics


def test_a_new_operator_process_applies_an_edit_made_while_none_ran(
    cluster: Cluster, namespace: str, operators: Factory
) -> None:
    """kopf's state lives in the operator's memory, so a new process sees every group as just
    created. A group with a status is not new to it: an edit made while no operator ran (the
    leader Service dropped) is applied, and the Service the group no longer wants is deleted."""
    first = operators("op-a")
    name = "again-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name, service={"ports": [{"port": 80}]}), namespace=namespace)
    wait_for(lambda: exists(cluster, namespace, "service", f"{name}-leader") or None, 20, "the leader Service", 0.2)
    wait_for(lambda: (cr(cluster, namespace, name).get("status") or {}).get("observedGeneration"), 10,
             "a status", 0.2)
    first.stop()
    cluster.kubectl("patch", "singletonservice", name, "-n", namespace, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/service"}]))
    operators("op-b")
    wait_for(lambda: not exists(cluster, namespace, "service", f"{name}-leader") or None, 20,
             "the unwanted leader Service to be deleted by the new operator", 0.2)
    generation = cr(cluster, namespace, name)["metadata"]["generation"]
    wait_for(lambda: (cr(cluster, namespace, name).get("status") or {}).get("observedGeneration") == generation
             or None, 10, "the edit's generation applied", 0.2)


def test_bad_flags_exit_2_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "singleton_operator.cli", "run", "--namespace", "Bad_NS"],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "singleton-operator: error: --namespace (SINGLETON_WATCH_NAMESPACES): 'Bad_NS' is not a namespace name"]


def test_a_taken_health_port_ends_the_operator_with_one_line(tmp_path: Path) -> None:
    """Not a traceback: one line naming the address and why."""
    import socket
    import subprocess
    import sys

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "singleton_operator.cli", "run", "--kubeconfig", str(kubeconfig),
                                 "--health-listen", f"127.0.0.1:{port}", "--log-format", "text"],
                                capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot serve the health checks and metrics (--health-listen)" in lines[0]
    assert f"listen=127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines[0]


def test_rbac_denied_is_reported_and_nothing_is_created(cluster: Cluster, namespace: str, singleton_crd: Path,
                                                        tmp_path: Path) -> None:
    """The chart's ClusterRole without PodDisruptionBudgets: the group reports exactly what is
    missing and gets no objects at all (not a Deployment without its budget)."""
    from tests.integration.kube.test_rbac import helm_template

    release = "deny-" + uuid.uuid4().hex[:4]
    objects = helm_template(release, namespace, "--show-only=templates/serviceaccount.yaml",
                            "--show-only=templates/clusterrole.yaml", "--show-only=templates/role.yaml")
    for obj in objects:
        if obj["kind"] == "ClusterRole":
            obj["rules"] = [r for r in obj["rules"] if "poddisruptionbudgets" not in r.get("resources", [])]
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    cluster_scoped = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects
                      if o["kind"].startswith("Cluster")]
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, bound_token(cluster, namespace, account), namespace,
                                  tmp_path / "op.kubeconfig")
    op = OperatorProcess(kubeconfig, namespace, tmp_path / "op.log", extra_args=["--namespace", namespace]).start()
    try:
        name = "deny-" + uuid.uuid4().hex[:4]
        cluster.apply(service(name), namespace=namespace)
        degraded = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Degraded")) and
                            c["reason"] == "RBACDenied" and c, 30, "RBACDenied", 0.2)
        assert "create poddisruptionbudgets.policy" in degraded["message"], degraded["message"]
        events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
        assert "RBACDenied" in {e["reason"] for e in events["items"]}
        for kind, object_name in [("deployment", name), ("serviceaccount", f"singleton-sidecar-{name}")]:
            assert not exists(cluster, namespace, kind, object_name)
        assert op.alive(), "the operator crashed"
    finally:
        op.stop()
        cluster.kubectl("delete", *cluster_scoped, "--ignore-not-found", check=False)


def pods_of(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", namespace, "-l", f"{contract.LABEL_GROUP}={name}")["items"])


def play_ready(cluster: Cluster, namespace: str, pod: str) -> None:
    """What the kubelet would report for a running pod whose probes pass (no kubelet here)."""
    status = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    cluster.kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=strategic", "-p",
                    json.dumps(status))


def kubectl_wait_ready(cluster: Cluster, namespace: str, name: str, timeout: str) -> Any:
    return cluster.kubectl("wait", "--for=condition=Ready", f"sgl/{name}", "-n", namespace, f"--timeout={timeout}",
                           check=False)


def test_ready_for_kubectl_wait_only_with_the_generation_rolled_out_and_a_ready_leader_and_kubectl_scale(
    controllers: Cluster, namespace: str, operators: Factory
) -> None:
    cluster = controllers
    operators()
    name = "rdy-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name), namespace=namespace)
    pods = wait_for(lambda: len(items := pods_of(cluster, namespace, name)) == 2
                    and [p["metadata"]["name"] for p in items], 30, "two pods", 0.2)
    # Leaderless, pods not Ready: Reconciling, and kubectl wait times out.
    reconciling = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Reconciling")) and
                           c["status"] == "True" and c, 20, "Reconciling=True", 0.2)
    assert reconciling["reason"] in ("RollingOut", "NoLeader"), reconciling
    assert (condition(cr(cluster, namespace, name), "Ready") or {}).get("status") == "False"
    assert kubectl_wait_ready(cluster, namespace, name, "2s").returncode != 0
    # A leader, but no pod Ready yet: still not Ready.
    play_sidecar(cluster, namespace, pods[0], "leader", 5)
    play_sidecar(cluster, namespace, pods[1], "standby", None)
    wait_for(lambda: cr(cluster, namespace, name).get("status", {}).get("leader") == pods[0], 10, "the leader", 0.1)
    assert (condition(cr(cluster, namespace, name), "Ready") or {}).get("status") == "False"
    for pod in pods:
        play_ready(cluster, namespace, pod)
    waited = kubectl_wait_ready(cluster, namespace, name, "30s")
    assert waited.returncode == 0, waited.stderr
    obj = cr(cluster, namespace, name)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert (condition(obj, "Reconciling") or {}).get("status") == "False"
    assert (condition(obj, "Stalled") or {}).get("status") == "False"
    # kubectl scale through the scale subresource: a new generation, rolled out by the operator.
    cluster.kubectl("scale", f"sgl/{name}", "-n", namespace, "--replicas=3")
    wait_for(lambda: get_json(cluster, "deployment", name, "-n", namespace)["spec"]["replicas"] == 3, 20,
             "the Deployment to get 3 replicas", 0.2)
    not_ready = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Ready")) and
                         c["status"] == "False" and c, 20, "Ready=False while scaling", 0.2)
    assert not_ready["reason"] == "RollingOut", not_ready
    scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/singleton.dev/v1alpha1/namespaces/{namespace}/"
                                       f"singletonservices/{name}/scale").stdout)
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == f"{contract.LABEL_GROUP}={name}"
    third = wait_for(lambda: len(items := pods_of(cluster, namespace, name)) == 3
                     and next(p["metadata"]["name"] for p in items if p["metadata"]["name"] not in pods),
                     30, "a third pod", 0.2)
    play_sidecar(cluster, namespace, third, "standby", None)
    play_ready(cluster, namespace, third)
    waited = kubectl_wait_ready(cluster, namespace, name, "30s")
    assert waited.returncode == 0, waited.stderr
    assert get_json(cluster, "sgl", name, "-n", namespace)["status"]["replicas"] == 3


def test_a_typo_in_the_template_is_stalled_as_invalid_template_and_keeps_the_older_generation(
    cluster: Cluster, namespace: str, operators: Factory
) -> None:
    """Server-side apply with strict field validation: an unknown field is refused by the API
    server (not dropped), the group is Stalled, and observedGeneration stays at the last
    generation that was applied."""
    operators()
    name = "typo-" + uuid.uuid4().hex[:4]
    cluster.apply(service(name), namespace=namespace)
    wait_for(lambda: cr(cluster, namespace, name).get("status", {}).get("observedGeneration") == 1, 20,
             "generation 1 applied", 0.2)
    typo = {"spec": {"template": {"spec": {"containers": [
        {"name": "app", "image": "example.invalid/app:2", "command": ["sleep", "infinity"],
         "imagePullPolicyy": "Always"}]}}}}
    cluster.kubectl("patch", "sgl", name, "-n", namespace, "--type=merge", "-p", json.dumps(typo))
    stalled = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Stalled")) and
                       c["status"] == "True" and c, 20, "Stalled=True", 0.2)
    assert stalled["reason"] == "InvalidTemplate"
    assert stalled["message"].startswith(f"the API server refused Deployment {name}: "), stalled
    assert '.spec.template.spec.containers[name="app"].imagePullPolicyy: field not declared' in stalled["message"]
    obj = cr(cluster, namespace, name)
    assert obj["metadata"]["generation"] == 2 and obj["status"]["observedGeneration"] == 1
    assert (condition(obj, "Ready") or {}).get("reason") == "InvalidTemplate"
    assert (condition(obj, "Reconciling") or {}).get("status") == "False"
    # Nothing of generation 2 reached the Deployment (not even its valid image change).
    deployment = get_json(cluster, "deployment", name, "-n", namespace)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "example.invalid/app:1"
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    assert "InvalidTemplate" in {e["reason"] for e in events["items"] if e["type"] == "Warning"}
    # Fixed: generation 3 applied, the problem gone.
    fixed = {"spec": {"template": {"spec": {"containers": [
        {"name": "app", "image": "example.invalid/app:2", "command": ["sleep", "infinity"],
         "imagePullPolicy": "Always"}]}}}}
    cluster.kubectl("patch", "sgl", name, "-n", namespace, "--type=merge", "-p", json.dumps(fixed))
    wait_for(lambda: cr(cluster, namespace, name).get("status", {}).get("observedGeneration") == 3, 20,
             "generation 3 applied", 0.2)
    assert (condition(cr(cluster, namespace, name), "Stalled") or {}).get("status") == "False"
    container = get_json(cluster, "deployment", name, "-n", namespace)["spec"]["template"]["spec"]["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == ("example.invalid/app:2", "Always")


def test_the_groups_labels_and_named_annotations_reach_its_objects_and_follow_edits(
    cluster: Cluster, namespace: str, operators: Factory
) -> None:
    operators()
    name = "lbl-" + uuid.uuid4().hex[:4]
    obj = json.loads(service(name, service={"ports": [{"port": 80}]}))
    obj["metadata"]["labels"] = {"team": "payments", "app.kubernetes.io/part-of": "billing"}
    obj["metadata"]["annotations"] = {"singleton.dev/propagate-annotations": "owner.example.com/*",
                                      "owner.example.com/team": "payments", "unnamed.example.com/x": "1"}
    obj["spec"]["template"]["metadata"] = {"labels": {"app.kubernetes.io/instance": "billing-eu"}}
    cluster.apply(json.dumps(obj), namespace=namespace)
    account = f"singleton-sidecar-{name}"
    kinds = [("deployment", name), ("serviceaccount", account), ("role", account), ("rolebinding", account),
             ("service", f"{name}-leader"), ("pdb", name)]
    for kind, obj_name in kinds:
        meta = wait_for(lambda k=kind, o=obj_name: exists(cluster, namespace, k, o) and
                        get_json(cluster, k, o, "-n", namespace)["metadata"], 20, f"{kind} {obj_name}", 0.2)
        assert (meta["labels"]["team"], meta["labels"]["app.kubernetes.io/part-of"]) == ("payments", "billing")
        assert meta["annotations"]["owner.example.com/team"] == "payments"
        assert "unnamed.example.com/x" not in meta["annotations"]
    template = get_json(cluster, "deployment", name, "-n", namespace)["spec"]["template"]["metadata"]["labels"]
    assert template["app.kubernetes.io/instance"] == "billing-eu" and "team" not in template
    # Editing only metadata (no new generation) reaches the objects too.
    cluster.kubectl("label", "sgl", name, "-n", namespace, "team=ledger", "--overwrite")
    cluster.kubectl("annotate", "sgl", name, "-n", namespace, "owner.example.com/team=ledger", "--overwrite")
    for kind, obj_name in kinds:
        wait_for(lambda k=kind, o=obj_name: (m := get_json(cluster, k, o, "-n", namespace)["metadata"])["labels"]
                 ["team"] == "ledger" and m["annotations"]["owner.example.com/team"] == "ledger", 20,
                 f"the edit to reach {kind} {obj_name}", 0.2)


def test_sidecar_pull_policy_and_secrets_from_the_operators_environment_reach_every_group(
    cluster: Cluster, namespace: str, singleton_crd: Path, tmp_path: Path
) -> None:
    op = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "op.log", extra_args=["--namespace", namespace],
                         env={"SINGLETON_SIDECAR_IMAGE_PULL_POLICY": "Always",
                              "SINGLETON_SIDECAR_IMAGE_PULL_SECRETS": "regcred,mirror"}).start()
    try:
        names = ["pull-" + uuid.uuid4().hex[:4], "pull-" + uuid.uuid4().hex[:4]]
        for name in names:
            obj = json.loads(service(name))
            obj["spec"]["template"]["spec"]["imagePullSecrets"] = [{"name": "app-registry"}]
            cluster.apply(json.dumps(obj), namespace=namespace)
        for name in names:
            pod = wait_for(lambda n=name: exists(cluster, namespace, "deployment", n) and
                           get_json(cluster, "deployment", n, "-n", namespace)["spec"]["template"]["spec"], 20,
                           f"Deployment {name}", 0.2)
            assert pod["imagePullSecrets"] == [{"name": "app-registry"}, {"name": "regcred"}, {"name": "mirror"}]
            assert pod["initContainers"][0]["imagePullPolicy"] == "Always"
    finally:
        op.stop()
