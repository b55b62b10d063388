"""The operator's pure parts: reading a spec, building the owned objects, computing status."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from singleton_operator import resources
from singleton_operator.spec import SpecError, parse_duration, read_spec
from singleton_operator.status import Observed, compute_status, find_leader, status_changed
from singleton_sidecar import contract

IMAGE = "registry.example/singleton:1"


def body(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "feed", "namespace": "ns", "uid": "u-1", "generation": 3},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "app:1",
                                                             "command": ["python", "poll.py"]}]}}, **spec}}


@pytest.mark.parametrize(("text", "seconds"), [("6s", 6), ("1500ms", 1.5), ("1m30s", 90), ("0.5s", 0.5), ("1h", 3600)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration("x", text) == seconds


@pytest.mark.parametrize("text", ["", "6", "6 s", "-1s", "1d", "s"])
def test_bad_durations_name_the_field(text: str) -> None:
    with pytest.raises(SpecError, match=r"^spec\.drain\.timeout: "):
        parse_duration("spec.drain.timeout", text)


@pytest.mark.parametrize(("backend", "expected"), [("lease", (9.0, 7.5, 6.0)), ("postgres", (6.0, 4.0, 2.0))])
def test_timings_default_per_backend(backend: str, expected: tuple[float, float, float]) -> None:
    extra = {"postgres": {"secretRef": {"name": "db"}}} if backend == "postgres" else {}
    timings = read_spec(body(backend=backend, **extra), default_sidecar_image=IMAGE).timings
    assert (timings.lease_duration, timings.renew_deadline, timings.retry_period) == expected


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(SpecError, match=r"spec\.postgres\.secretRef\.name"):
        read_spec(body(backend="both"), default_sidecar_image=IMAGE)
    with pytest.raises(SpecError, match=r"spec\.mainContainer"):
        read_spec(body(mainContainer="web"), default_sidecar_image=IMAGE)
    with pytest.raises(SpecError, match=r"spec\.timings"):
        read_spec(body(timings={"leaseDuration": "2s", "renewDeadline": "2s", "retryPeriod": "1s"}),
                  default_sidecar_image=IMAGE)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_deployment_injects_a_native_sidecar_with_downward_env_and_secret() -> None:
    spec = read_spec(body(backend="postgres", postgres={"secretRef": {"name": "db", "key": "url"}},
                          drain={"timeout": "25s"}, terminationGracePeriodSeconds=40),
                     default_sidecar_image=IMAGE)
    deployment = resources.deployment(spec)
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    sidecar = pod["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always" and sidecar["image"] == IMAGE
    env = env_of(sidecar)
    assert env[contract.ENV_POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env[contract.ENV_POD_UID] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env[contract.ENV_POSTGRES_DSN] == {"secretKeyRef": {"name": "db", "key": "url"}}
    assert env[contract.ENV_DRAIN_TIMEOUT] == "25" and env[contract.ENV_DRAIN_WAIT_CONTAINER] == "app"
    assert env[contract.ENV_NATIVE_SIDECAR] == "true"
    assert not any("password" in str(v).lower() for v in env.values())
    assert pod["terminationGracePeriodSeconds"] == 40
    assert pod["serviceAccountName"] == "singleton-sidecar-feed"
    main = pod["containers"][0]
    assert main["readinessProbe"]["httpGet"] == {"path": "/candidate", "port": 9090}
    assert main["command"] == ["python", "poll.py"]
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert deployment["spec"]["selector"]["matchLabels"] == {contract.LABEL_GROUP: "feed"}


def test_file_gating_wraps_the_command_and_shares_the_gate_folder() -> None:
    spec = read_spec(body(gating={"mode": "file"}), default_sidecar_image=IMAGE)
    pod = resources.deployment(spec)["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert main["command"][:2] == ["/bin/sh", "-c"] and main["command"][-2:] == ["python", "poll.py"]
    assert {"name": resources.GATE_VOLUME, "mountPath": resources.GATE_DIR} in main["volumeMounts"]
    assert env_of(pod["initContainers"][0])[contract.ENV_GATE_DIR] == resources.GATE_DIR
    assert any(v["name"] == resources.GATE_VOLUME for v in pod["volumes"])


def test_leader_service_selects_the_role_label_and_pdb_allows_one_disruption() -> None:
    spec = read_spec(body(service={"ports": [{"port": 80, "targetPort": 8080}]}), default_sidecar_image=IMAGE)
    service = resources.leader_service(spec)
    assert service is not None
    assert service["spec"]["selector"] == {contract.LABEL_GROUP: "feed", contract.LABEL_ROLE: "leader"}
    assert service["spec"]["ports"] == [{"port": 80, "protocol": "TCP", "targetPort": 8080}]
    pdb = resources.pod_disruption_budget(spec)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert resources.pod_disruption_budget(read_spec(body(podDisruptionBudget={"enabled": False}),
                                                     default_sidecar_image=IMAGE)) is None
    assert resources.leader_service(read_spec(body(), default_sidecar_image=IMAGE)) is None


def test_role_grants_exactly_the_sidecar_rules_and_binds_a_user_account() -> None:
    raw = body()
    raw["spec"]["template"]["spec"]["serviceAccountName"] = "app-sa"
    spec = read_spec(raw, default_sidecar_image=IMAGE)
    assert resources.role(spec)["rules"] == contract.sidecar_rbac_rules("feed")
    subjects = {s["name"] for s in resources.role_binding(spec)["subjects"]}
    assert subjects == {"singleton-sidecar-feed", "app-sa"}


def pod(name: str, role: str | None, token: int | None = None, *, ready: bool = True,
        deleting: bool = False) -> dict[str, Any]:
    annotations = {}
    if role:
        annotations[contract.ANNOTATION_ROLE] = role
    if token is not None:
        annotations[contract.ANNOTATION_TOKEN] = str(token)
        annotations[contract.ANNOTATION_LEADER_SINCE] = "2026-11-25T10:00:00.000Z"
    metadata: dict[str, Any] = {"name": name, "annotations": annotations}
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-25T10:00:00Z"
    return {"metadata": metadata, "status": {"phase": "Running",
                                             "conditions": [{"type": "Ready", "status": str(ready)}]}}


READY_DEPLOYMENT = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "updatedReplicas": 3,
                                                               "replicas": 3, "availableReplicas": 3}}
NOW = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)


def test_a_stale_leader_annotation_loses_to_the_greater_token() -> None:
    leader = find_leader([pod("a", "leader", 5), pod("b", "leader", 9), pod("c", "standby")])
    assert leader is not None and (leader.pod, leader.token) == ("b", 9)


def test_status_running_with_leader_and_standbys() -> None:
    spec = read_spec(body(replicas=3), default_sidecar_image=IMAGE)
    observed = Observed(pods=[pod("a", "leader", 7), pod("b", "standby"), pod("c", "standby")],
                        deployment=READY_DEPLOYMENT)
    status = compute_status(spec, observed, {}, NOW)
    assert (status["leader"], status["token"], status["readyStandbys"], status["phase"]) == ("a", 7, 2, "Running")
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Available": "True", "LeaderElected": "True", "Progressing": "False", "Degraded": "False"}
    assert status["observedGeneration"] == 3


def test_status_counts_leader_changes_and_keeps_transition_times() -> None:
    spec = read_spec(body(replicas=2), default_sidecar_image=IMAGE)
    first = compute_status(spec, Observed([pod("a", "leader", 1), pod("b", "standby")], READY_DEPLOYMENT), {}, NOW)
    later = NOW + dt.timedelta(minutes=5)
    same = compute_status(spec, Observed([pod("a", "leader", 1), pod("b", "standby")], READY_DEPLOYMENT), first,
                          later)
    assert not status_changed(first, same)
    moved = compute_status(spec, Observed([pod("a", "standby"), pod("b", "leader", 2)], READY_DEPLOYMENT), first,
                           later)
    assert moved["transitions"] == first["transitions"] + 1 and moved["leader"] == "b"
    assert status_changed(first, moved)


def test_status_without_leader_or_with_a_problem() -> None:
    spec = read_spec(body(replicas=2), default_sidecar_image=IMAGE)
    electing = compute_status(spec, Observed([pod("a", "standby"), pod("b", "standby")], READY_DEPLOYMENT), {}, NOW)
    assert electing["phase"] == "Electing" and electing["leader"] is None
    failed = compute_status(spec, Observed([], None, problem="Secret ns/db does not exist",
                                           problem_reason="SecretNotFound"), {}, NOW)
    degraded = next(c for c in failed["conditions"] if c["type"] == "Degraded")
    assert failed["phase"] == "Failed" and degraded["reason"] == "SecretNotFound"
    assert "Secret ns/db" in degraded["message"]


def test_terminating_pods_do_not_count_as_standbys() -> None:
    spec = read_spec(body(replicas=2), default_sidecar_image=IMAGE)
    status = compute_status(spec, Observed([pod("a", "leader", 3), pod("b", "standby", deleting=True)],
                                           READY_DEPLOYMENT), {}, NOW)
    assert status["readyStandbys"] == 0 and status["phase"] == "Degraded"
