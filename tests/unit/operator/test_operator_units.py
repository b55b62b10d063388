"""The operator's pure parts: reading a spec, building the owned objects, computing status."""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import re
from typing import Any, cast

import pytest

from singleton_election import contract
from singleton_election.core.timings import TimingError, Timings
from singleton_election.settings import ConfigError
from singleton_operator.model import resources
from singleton_operator.model.spec import (
    SpecError,
    format_seconds,
    is_label_value,
    is_qualified_name,
    parse_duration,
    parse_quantity,
    read_spec,
)
from singleton_operator.model.status import (
    DatabaseCheck,
    Observed,
    compute_status,
    deposed_leaders,
    find_leader,
    labelled_leaders,
    spec_error_status,
    status_changed,
)
from singleton_sidecar.config import SidecarConfig, load_config
from tests.integration.kube.test_crd import INVALID, VALID, duration_boundary_cases, edited, full, minimal
from tests.support.paths import REPO_ROOT

IMAGE = "registry.example/singleton:1"


def body(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "feed", "namespace": "ns", "uid": "u-1", "generation": 3},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "app:1",
                                                             "command": ["python", "poll.py"]}]}}, **spec}}


@pytest.mark.parametrize(("text", "nanoseconds"), [
    ("6s", 6_000_000_000), ("1500ms", 1_500_000_000), ("1m30s", 90_000_000_000), ("0.5s", 500_000_000),
    ("1h", 3_600_000_000_000), ("1.5s", 1_500_000_000), ("0.0005s", 500_000), ("1.5ms", 1_500_000),
    ("0.000000001s", 1), ("0.0000000019s", 1),  # digits past the nanosecond are dropped, as Go does
    ("0.0000000009s", 0), ("00010s", 10_000_000_000), ("1s1s", 2_000_000_000), ("1h0.5m", 3_630_000_000_000),
    ("0.1234567890123456789012345s", 123_456_789),  # Go stops reading a fraction at 19 digits
    ("2562047h47m16.854775807s", 2**63 - 1),  # the longest Go duration
])
def test_durations_are_read_to_the_nanosecond_as_go_reads_them(text: str, nanoseconds: int) -> None:
    assert parse_duration("x", text) == nanoseconds


@pytest.mark.parametrize("text", [
    "", "6", "6 s", "-1s", "+1s", "1d", "s", "1500us", "1500µs", "6000000ns", ".5s", "5.s", "1e3s", "1S", "1sm",
    "\u0661s",  # an Arabic-Indic digit: Python's \d would take it, the CRD's [0-9] does not
    "1" * 31 + "ms",  # 33 characters: the CRD's maxLength is 32
    "2562047h47m16.854775808s",  # one nanosecond past what Go can hold
])
def test_durations_the_crd_refuses_are_refused_naming_the_field(text: str) -> None:
    with pytest.raises(SpecError, match=r"^spec\.drain\.timeout: "):
        parse_duration("spec.drain.timeout", text)


@pytest.mark.parametrize(("nanoseconds", "text"), [
    (7_000_000_000, "7"), (2_400_000_000, "2.4"), (2_400_000_001, "2.400000001"), (1, "0.000000001"), (0, "0")])
def test_the_sidecar_gets_exact_seconds(nanoseconds: int, text: str) -> None:
    assert format_seconds(nanoseconds) == text


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
    assert main["readinessProbe"]["httpGet"] == {"path": "/candidate", "port": 7450}
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


def labelled(pod_body: dict[str, Any], role: str, version: str = "1") -> dict[str, Any]:
    pod_body["metadata"] |= {"labels": {contract.LABEL_ROLE: role}, "resourceVersion": version}
    return pod_body


def test_a_pod_labelled_leader_under_an_older_token_is_deposed() -> None:
    pods = [labelled(pod("old", "leader", 5), "leader", "41"), labelled(pod("new", "leader", 9), "leader"),
            labelled(pod("idle", "standby"), "standby"), labelled(pod("drained", "draining", 4), "draining", "7"),
            labelled(pod("unsaid", None), "leader", "8"),
            labelled(pod("leaving", "leader", 3, deleting=True), "leader")]
    deposed = {(d.pod, d.resource_version, d.token) for d in deposed_leaders(pods)}
    # "leaving" is being deleted: its sidecar hands over and relabels itself.
    assert deposed == {("old", "41", 5), ("drained", "7", 4), ("unsaid", "8", None)}


def test_no_pod_is_deposed_without_a_leader_to_compare_with() -> None:
    # Only pods that say they lead with a token make a leader: a lone label proves nothing.
    assert deposed_leaders([labelled(pod("a", None), "leader"), labelled(pod("b", "standby"), "standby")]) == []
    assert deposed_leaders([labelled(pod("a", "leader", 3), "leader")]) == []


def test_status_running_with_leader_and_standbys() -> None:
    spec = read_spec(body(replicas=3), default_sidecar_image=IMAGE)
    observed = Observed(pods=[pod("a", "leader", 7), pod("b", "standby"), pod("c", "standby")],
                        deployment=READY_DEPLOYMENT, applied_generation=3)
    status = compute_status(spec, observed, {}, NOW)
    assert (status["leader"], status["token"], status["readyStandbys"], status["phase"]) == ("a", 7, 2, "Running")
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Ready": "True", "Reconciling": "False", "Stalled": "False", "Available": "True",
                          "LeaderElected": "True", "Progressing": "False", "Degraded": "False"}
    assert status["observedGeneration"] == 3


def gitops(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """(status, reason) of Ready, Reconciling and Stalled."""
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]
            if c["type"] in ("Ready", "Reconciling", "Stalled")}


RUNNING = [pod("a", "leader", 7), pod("b", "standby"), pod("c", "standby")]


@pytest.mark.parametrize(("observed", "previous", "ready", "reconciling", "stalled", "generation"), [
    pytest.param(Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3), {}, ("True", "Ready"),
                 ("False", "Ready"), ("False", "AsExpected"), 3, id="applied-rolled-out-leading"),
    # Not applied yet (the operator just started): the older observedGeneration stays.
    pytest.param(Observed(RUNNING, READY_DEPLOYMENT), {"observedGeneration": 2}, ("False", "Applying"),
                 ("True", "Applying"), ("False", "AsExpected"), 2, id="not-applied-yet"),
    pytest.param(Observed(RUNNING, READY_DEPLOYMENT, applied_generation=2), {"observedGeneration": 2},
                 ("False", "Applying"), ("True", "Applying"), ("False", "AsExpected"), 2, id="older-applied"),
    # This generation's apply failed: Stalled with its reason, observedGeneration not stamped.
    pytest.param(Observed(RUNNING, READY_DEPLOYMENT, problem="the API server rejected the workload",
                          problem_reason="InvalidTemplate", applied_generation=2), {"observedGeneration": 2},
                 ("False", "InvalidTemplate"), ("False", "Stalled"), ("True", "InvalidTemplate"), 2,
                 id="apply-failed"),
    pytest.param(Observed([], None, problem="Secret ns/db does not exist", problem_reason="SecretNotFound"), {},
                 ("False", "SecretNotFound"), ("False", "Stalled"), ("True", "SecretNotFound"), None,
                 id="new-group-missing-secret"),
    pytest.param(Observed(RUNNING, {**READY_DEPLOYMENT, "status": {**READY_DEPLOYMENT["status"],
                                                                   "updatedReplicas": 1}}, applied_generation=3),
                 {}, ("False", "RollingOut"), ("True", "RollingOut"), ("False", "AsExpected"), 3, id="rolling-out"),
    pytest.param(Observed([pod("a", "standby"), pod("b", "standby")], READY_DEPLOYMENT, applied_generation=3), {},
                 ("False", "NoLeader"), ("True", "NoLeader"), ("False", "AsExpected"), 3, id="leaderless"),
    pytest.param(Observed([pod("a", "leader", 7, ready=False), pod("b", "standby")], READY_DEPLOYMENT,
                          applied_generation=3), {},
                 ("False", "LeaderNotReady"), ("True", "LeaderNotReady"), ("False", "AsExpected"), 3,
                 id="leader-not-ready"),
    pytest.param(Observed(RUNNING, {**READY_DEPLOYMENT, "status": {
        **READY_DEPLOYMENT["status"], "updatedReplicas": 1, "conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
             "message": "ReplicaSet \"feed-1\" has timed out progressing."}]}}, applied_generation=3), {},
                 ("False", "ProgressDeadlineExceeded"), ("False", "Stalled"), ("True", "ProgressDeadlineExceeded"), 3,
                 id="rollout-deadline-exceeded"),
])
def test_gitops_conditions_follow_the_kstatus_convention(
    *, observed: Observed, previous: dict[str, Any], ready: tuple[str, str], reconciling: tuple[str, str],
    stalled: tuple[str, str], generation: int | None,
) -> None:
    spec = read_spec(body(replicas=3), default_sidecar_image=IMAGE)
    status = compute_status(spec, observed, previous, NOW)
    assert gitops(status) == {"Ready": ready, "Reconciling": reconciling, "Stalled": stalled}
    assert status.get("observedGeneration") == generation


def test_a_spec_the_operator_cannot_read_is_stalled_and_keeps_the_rest() -> None:
    spec = read_spec(body(replicas=3), default_sidecar_image=IMAGE)
    running = compute_status(spec, Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3), {}, NOW)
    status = spec_error_status(4, "InvalidSpec", "spec.sidecar.port: must be from 1 to 65534", running, NOW)
    assert gitops(status) == {"Ready": ("False", "InvalidSpec"), "Reconciling": ("False", "Stalled"),
                              "Stalled": ("True", "InvalidSpec")}
    assert (status["phase"], status["observedGeneration"], status["leader"]) == ("Failed", 3, "a")
    assert [c["type"] for c in status["conditions"]] == [
        "Ready", "Reconciling", "Stalled", "Available", "LeaderElected", "Progressing", "Degraded"]


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


def test_leaders_are_counted_from_the_role_label_draining_and_terminating_included() -> None:
    def labelled(role: str | None, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": "p", "labels": {contract.LABEL_ROLE: role} if role else {}}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-25T12:00:00Z"
        return {"metadata": meta, "status": {"phase": phase}}

    assert labelled_leaders([]) == 0
    assert labelled_leaders([labelled("standby"), labelled(None), labelled("released")]) == 0
    assert labelled_leaders([labelled("leader"), labelled("standby")]) == 1
    assert labelled_leaders([labelled("draining", deleting=True), labelled("leader")]) == 2
    # A finished pod's label is whatever it was when it ended: it leads nothing.
    assert labelled_leaders([labelled("leader", phase="Failed"), labelled("leader", phase="Succeeded")]) == 0


# --- the operator agrees with admission (tests/integration/kube/test_crd.py) ------------------------------------


def admitted(obj: dict[str, Any]) -> dict[str, Any]:
    """An object of the admission tests as the operator receives it (namespace and uid set)."""
    return {**obj, "metadata": {**obj["metadata"], "namespace": "ns", "uid": "u-1"}}


def sidecar_config(spec: Any) -> SidecarConfig:
    """The configuration the sidecar of the operator's pods loads from the environment the
    operator gives it (downward-API and Secret values filled in as the kubelet would)."""
    sidecar = next(c for c in resources.deployment(spec)["spec"]["template"]["spec"]["initContainers"]
                   if c["name"] == "singleton-sidecar")
    from_pod = {"metadata.namespace": "ns", "metadata.name": "feed-7d9f-abcde", "metadata.uid": "0b1c"}
    environ = {}
    for entry in sidecar["env"]:
        source = entry.get("valueFrom") or {}
        if "fieldRef" in source:
            environ[entry["name"]] = from_pod[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            environ[entry["name"]] = "postgresql://app:pw@db.example/app"
        else:
            environ[entry["name"]] = entry["value"]
    return load_config(argparse.Namespace(command=[]), environ)


VARIANTS = [pytest.param(minimal(), id="minimal"), pytest.param(full(), id="full"),
            *(pytest.param(edited(minimal(), p.values[0]), id=p.id) for p in VALID)]


@pytest.mark.parametrize("obj", VARIANTS)
def test_every_admitted_variant_is_read_and_its_sidecar_accepts_its_settings(obj: dict[str, Any]) -> None:
    """The property the admission tests' valid variants (each on the boundary of a rule) stand
    for: what the API server admits, the operator builds, and its sidecar starts with."""
    spec = read_spec(admitted(obj), default_sidecar_image=IMAGE)
    config = sidecar_config(spec)
    assert (config.timings, config.drain_timeout) == (spec.timings, spec.drain_timeout)
    assert config.control_listen.port == spec.sidecar_port + 1 <= 65535


@pytest.mark.parametrize(("label", "edits"), duration_boundary_cases())
def test_near_the_duration_rules_whatever_the_operator_accepts_its_sidecar_accepts(
        label: str, edits: dict[str, Any]) -> None:
    """The cases on which tests/integration/kube/test_crd.py compares the API server's verdict with read_spec's:
    the settings of an accepted one are exact enough for the sidecar's own rules."""
    try:
        spec = read_spec(admitted(edited(minimal(), edits)), default_sidecar_image=IMAGE)
    except SpecError:
        return
    assert sidecar_config(spec).timings == spec.timings, label


OPERATOR_REFUSES = {
    # id in tests/integration/kube/test_crd.py's INVALID: the field read_spec names. These are what the operator
    # cannot build (or build into a working group); the others of INVALID are pure schema
    # (types, enums, patterns of fields it does not build from) or are refused at admission only
    # to avoid a surprise (see spec.py's docstring).
    "timings-renew-equals-lease": "spec.timings.renewDeadline",
    "timings-renew-within-500ms-of-lease": "spec.timings.renewDeadline",
    "timings-retry-equals-renew": "spec.timings.retryPeriod",
    "timings-renew-under-1.2x-retry": "spec.timings.renewDeadline",
    "timings-retry-under-100ms": "spec.timings.retryPeriod",
    "timings-lease-over-5m": "spec.timings.leaseDuration",
    "duration-words": "spec.timings.leaseDuration",
    "drain-duration-bad-unit": "spec.drain.timeout",
    "timings-renew-1.2x-retry-in-ms-only": "spec.timings.renewDeadline",
    "timings-renew-exactly-1.2x-retry": "spec.timings.renewDeadline",
    "timings-margin-1ns-short": "spec.timings.renewDeadline",
    "timings-retry-1ns-under-100ms": "spec.timings.retryPeriod",
    "timings-lease-1ns-over-5m": "spec.timings.leaseDuration",
    "duration-microseconds": "spec.timings.leaseDuration",
    "duration-leading-dot": "spec.timings.leaseDuration",
    "duration-33-chars": "spec.timings.leaseDuration",
    "duration-beyond-int64-nanoseconds": "spec.timings.leaseDuration",
    "postgres-without-postgres": "spec.postgres.secretRef.name",
    "both-without-postgres": "spec.postgres.secretRef.name",
    "secret-key-.": "spec.postgres.secretRef.key",
    "secret-key-..": "spec.postgres.secretRef.key",
    "secret-key-..dsn": "spec.postgres.secretRef.key",
    "postgres-mode-transaction": "spec.postgres.mode",
    "postgres-connection-check-unknown": "spec.postgres.connectionCheck",
    "drain-equals-grace": "spec.drain.timeout",
    "drain-within-2s-of-grace": "spec.drain.timeout",
    "drain-1ns-over-grace-less-2s": "spec.drain.timeout",
    "drain-0s": "spec.drain.timeout",
    "drain-under-1ns-is-0": "spec.drain.timeout",
    "grace-2-leaves-no-drain": "spec.drain.timeout",
    "hook-not-loopback": "spec.drain.hookURL",
    "hook-https": "spec.drain.hookURL",
    "hook-port-0": "spec.drain.hookURL",
    "hook-port-65536": "spec.drain.hookURL",
    "hook-port-99999": "spec.drain.hookURL",
    "hook-on-sidecar-port": "spec.drain.hookURL",
    "hook-on-control-port": "spec.drain.hookURL",
    "hook-default-port-80-is-control-port": "spec.drain.hookURL",
    "main-not-in-tmpl": "spec.mainContainer",
    "container-names-duplicate": "spec.template.spec.containers",
    "container-name-reserved": "spec.template.spec.containers",
    "init-container-name-reserved": "spec.template.spec.initContainers",
    "init-container-name-clash": "spec.template.spec.containers",
    "init-container-names-duplicate": "spec.template.spec.initContainers",
    "init-container-without-image": "spec.template.spec.initContainers[0].image",
    "init-container-empty-image": "spec.template.spec.initContainers[0].image",
    "container-empty-image": "spec.template.spec.containers[0].image",
    "container-image-trailing-space": "spec.template.spec.containers[0].image",
    "container-image-leading-ideographic-space": "spec.template.spec.containers[0].image",
    "init-container-image-leading-tab": "spec.template.spec.initContainers[0].image",
    "port-name-without-letter": "spec.template.spec.containers[0].ports[0].name",
    "port-name-double-dash": "spec.template.spec.initContainers[0].ports[0].name",
    "port-name-16-chars": "spec.template.spec.containers[0].ports[0].name",
    "file-gate-mount-path-taken": "spec.gating.mode",
    "label-value-64-chars": "spec.template.metadata.labels",
    "label-value-leading-dash": "spec.template.metadata.labels",
    "label-key-with-space": "spec.template.metadata.labels",
    "label-key-name-64-chars": "spec.template.metadata.labels",
    "label-key-prefix-254-chars": "spec.template.metadata.labels",
    "annotation-key-two-slashes": "spec.template.metadata.annotations",
    "target-port-0": "spec.service.ports[0].targetPort",
    "target-port-65536": "spec.service.ports[0].targetPort",
    "target-port-digits-as-string": "spec.service.ports[0].targetPort",
    "target-port-name-undeclared": "spec.service.ports[0].targetPort",
    "target-port-is-control-port": "spec.service.ports[0]",
    "service-port-is-control-port": "spec.service.ports[0]",
    "service-annotation-key-invalid": "spec.service.annotations",
    "sidecar-port-0": "spec.sidecar.port",
    "sidecar-port-65536": "spec.sidecar.port",
    "sidecar-port-65535": "spec.sidecar.port",
    "sidecar-port-clashes-with-container": "spec.sidecar.port",
    "control-port-clashes-with-container": "spec.sidecar.port",
    "sidecar-port-clashes-with-init-container": "spec.sidecar.port",
    "control-port-clashes-with-init-container": "spec.sidecar.port",
    "sidecar-image-trailing-space": "spec.sidecar.image",
    "request-not-quantity": "spec.sidecar.resources.requests[cpu]",
    "request-negative": "spec.sidecar.resources.requests[memory]",
    "limit-not-quantity": "spec.sidecar.resources.limits[memory]",
    "request-over-limit": "spec.sidecar.resources.requests",
    "sidecar-resource-not-allowed": "spec.sidecar.resources.limits",
}


def test_every_refusal_listed_for_the_operator_is_an_admission_test_case() -> None:
    assert set(OPERATOR_REFUSES) <= {p.id for p in INVALID}


@pytest.mark.parametrize(("edits", "field"), [pytest.param(p.values[0], OPERATOR_REFUSES[p.id], id=p.id)
                                              for p in INVALID if p.id in OPERATOR_REFUSES])
def test_what_the_operator_cannot_build_it_refuses_naming_the_field(edits: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match="^" + re.escape(field) + r"(: |\[)"):
        read_spec(admitted(edited(minimal(), edits)), default_sidecar_image=IMAGE)


def test_a_name_starting_with_a_digit_is_refused_only_with_a_leader_service() -> None:
    """Admission refuses such names for new groups; one admitted before runs, without a
    leader Service (whose name would start with the digit)."""
    legacy = body()
    legacy["metadata"]["name"] = "1st-feed"
    assert read_spec(legacy, default_sidecar_image=IMAGE).name == "1st-feed"
    legacy["spec"]["service"] = {"ports": [{"port": 80}]}
    with pytest.raises(SpecError, match=r"^metadata\.name: must start with a letter"):
        read_spec(legacy, default_sidecar_image=IMAGE)


def test_the_template_grace_period_is_replaced_not_refused() -> None:
    """Refused at admission so that it is not silently ignored; an older object that has one
    still runs, with spec.terminationGracePeriodSeconds."""
    raw = body(terminationGracePeriodSeconds=40)
    raw["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 600
    pod = resources.deployment(read_spec(raw, default_sidecar_image=IMAGE))["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 40


def test_the_names_the_operator_derives_from_the_longest_name_are_valid() -> None:
    """52 characters (the CRD's limit), starting with a letter: every derived name is valid."""
    spec = read_spec(admitted(edited(minimal(), {"metadata.name": "a" * 52,
                                                 "spec.service": {"ports": [{"port": 80}]}})),
                     default_sidecar_image=IMAGE)
    dns1035_label = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
    dns1123_subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    service = resources.leader_service(spec)
    assert service is not None and dns1035_label.fullmatch(service["metadata"]["name"])
    for obj in (resources.deployment(spec), resources.service_account(spec), resources.role(spec),
                resources.role_binding(spec), resources.pod_disruption_budget(spec)):
        assert obj is not None
        name = obj["metadata"]["name"]
        assert len(name) <= 253 and dns1123_subdomain.fullmatch(name), name
        assert all(is_qualified_name(k) and is_label_value(v) for k, v in obj["metadata"]["labels"].items())
    pod_labels = resources.deployment(spec)["spec"]["template"]["metadata"]["labels"]
    assert all(is_label_value(v) for v in pod_labels.values())


def test_the_operator_env_of_the_main_container_comes_first_and_cannot_be_overridden() -> None:
    raw = body()
    raw["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "MY_URL", "value": "$(SINGLETON_LEADER_URL)?watch=1"},
        {"name": "SINGLETON_LEADER_URL", "value": "http://elsewhere:1/leader"},
        {"name": "SINGLETON_GROUP", "value": "other"}]
    pod = resources.deployment(read_spec(raw, default_sidecar_image=IMAGE))["spec"]["template"]["spec"]
    main = pod["containers"][0]
    names = [e["name"] for e in main["env"]]
    # $(SINGLETON_LEADER_URL) expands only to a variable defined before it in the list
    assert names == ["SINGLETON_LEADER_URL", "SINGLETON_CONTROL_URL", contract.ENV_GROUP, "MY_URL"]
    assert env_of(main)["SINGLETON_LEADER_URL"] == "http://127.0.0.1:7450/leader"
    assert env_of(main)[contract.ENV_GROUP] == "feed"


def test_timings_reach_the_sidecar_exactly() -> None:
    spec = read_spec(body(timings={"leaseDuration": "700ms", "renewDeadline": "200ms", "retryPeriod": "100ms"},
                          drain={"timeout": "27.999999999s"}), default_sidecar_image=IMAGE)
    env = env_of(resources.deployment(spec)["spec"]["template"]["spec"]["initContainers"][0])
    assert [env[contract.ENV_LEASE_DURATION], env[contract.ENV_RENEW_DEADLINE], env[contract.ENV_RETRY_PERIOD],
            env[contract.ENV_DRAIN_TIMEOUT]] == ["0.7", "0.2", "0.1", "27.999999999"]


def test_the_sidecar_compares_its_timings_exactly() -> None:
    """In floats 0.7 - 0.2 < 0.5: the sidecar would refuse the 500ms margin admission accepts."""
    assert Timings(lease_duration=0.7, renew_deadline=0.2, retry_period=0.1).stop_margin > 0
    with pytest.raises(TimingError, match="renew_deadline"):
        Timings(lease_duration=4, renew_deadline=2.40108, retry_period=2.0009)  # exactly 1.2 x
    Timings(lease_duration=4, renew_deadline=2.401080001, retry_period=2.0009)


@pytest.mark.parametrize(("text", "value"), [
    ("10m", "0.01"), ("0.5", "0.5"), ("64Mi", "67108864"), ("1G", "1000000000"), ("1e3", "1000"), ("1E3", "1000"),
    ("1E", "1000000000000000000"), ("2k", "2000"), ("500u", "0.0005"), ("1n", "0.000000001"), (".5", "0.5"),
    ("5.", "5"), ("+1", "1"), ("-1", "-1"), ("0", "0"), ("1.5Ki", "1536"),
])
def test_quantities(text: str, value: str) -> None:
    assert parse_quantity(text) == decimal.Decimal(value)


@pytest.mark.parametrize("text", ["", "lots", "1 Gi", "1K", "1gi", "1e", "1e1.5", "Mi", "-", ".", "1Mi1", "0x10"])
def test_not_quantities(text: str) -> None:
    assert parse_quantity(text) is None


def test_the_default_sidecar_ports_are_the_ones_the_docs_and_the_crd_state() -> None:

    import yaml

    from singleton_operator.model.spec import DEFAULT_SIDECAR_PORT

    repo = REPO_ROOT
    readme = repo.joinpath("docs", "operator.md").read_text()
    stated = re.search(r"`spec\.sidecar\.port` \(default \*\*(\d+)\*\*\).*?loopback; (\d+) by default\)", readme,
                       re.DOTALL)
    assert stated is not None, "docs/operator.md's Ports paragraph no longer states the default"
    assert (int(stated.group(1)), int(stated.group(2))) == (DEFAULT_SIDECAR_PORT, DEFAULT_SIDECAR_PORT + 1)
    crd = yaml.safe_load(repo.joinpath("crds", "singleton.dev_singletonservices.yaml").read_text())
    sidecar = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["sidecar"]
    assert sidecar["default"]["port"] == sidecar["properties"]["port"]["default"] == DEFAULT_SIDECAR_PORT
    assert read_spec(body(), default_sidecar_image=IMAGE).sidecar_port == DEFAULT_SIDECAR_PORT
    assert DEFAULT_SIDECAR_PORT not in (9090, 9091) and DEFAULT_SIDECAR_PORT + 1 not in (9090, 9091)


def test_the_users_part_of_and_instance_win_on_pods_ours_are_defaults() -> None:
    own = read_spec(body(template={"metadata": {"labels": {"app.kubernetes.io/part-of": "billing",
                                                           "app.kubernetes.io/instance": "billing-eu",
                                                           "app.kubernetes.io/managed-by": "helm",
                                                           contract.LABEL_GROUP: "other"}},
                                   "spec": {"containers": [{"name": "app", "image": "app:1"}]}}),
                    default_sidecar_image=IMAGE)
    labels = resources.deployment(own)["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/part-of"] == "billing"
    assert labels["app.kubernetes.io/instance"] == "billing-eu"
    # The operator finds its pods by these, and the Deployment selects them: always ours.
    assert labels["app.kubernetes.io/managed-by"] == "singleton-operator"
    assert labels[contract.LABEL_GROUP] == "feed"
    defaults = resources.deployment(read_spec(body(), default_sidecar_image=IMAGE))["spec"]["template"]["metadata"]
    assert (defaults["labels"]["app.kubernetes.io/part-of"], defaults["labels"]["app.kubernetes.io/instance"]) == (
        "singleton", "feed")


def owned(**metadata: Any) -> list[dict[str, Any]]:
    obj = body(service={"ports": [{"port": 80}], "annotations": {"lb.example.com/internal": "true"}})
    obj["metadata"].update(metadata)
    spec = read_spec(obj, default_sidecar_image=IMAGE)
    return [resources.service_account(spec), resources.role(spec), resources.role_binding(spec),
            resources.deployment(spec), resources.leader_service(spec) or {}, resources.pod_disruption_budget(spec)
            or {}]


def test_the_groups_labels_and_the_annotations_it_names_reach_its_objects_not_its_pods() -> None:
    objects = owned(
        labels={"team": "payments", "app.kubernetes.io/part-of": "billing", "app.kubernetes.io/instance": "argo-app",
                "argocd.argoproj.io/instance": "x", "kustomize.toolkit.fluxcd.io/name": "apps",
                "app.kubernetes.io/managed-by": "Helm", contract.LABEL_GROUP: "other"},
        annotations={resources.ANNOTATION_PROPAGATE: "owner.example.com/team, cost.example.com/*, "
                                                     "argocd.argoproj.io/*",
                     "owner.example.com/team": "payments", "cost.example.com/center": "42",
                     "cost.example.com/budget": "7", "not-named": "x", "argocd.argoproj.io/tracking-id": "app:x",
                     "kubectl.kubernetes.io/last-applied-configuration": "{}"})
    assert len(objects) == 6 and all(objects)
    for obj in objects:
        labels, annotations = obj["metadata"]["labels"], obj["metadata"].get("annotations") or {}
        assert labels == {"team": "payments", "app.kubernetes.io/part-of": "billing",
                          "app.kubernetes.io/instance": "feed", "app.kubernetes.io/managed-by": "singleton-operator",
                          contract.LABEL_GROUP: "feed"}, obj["kind"]
        expected = {"owner.example.com/team": "payments", "cost.example.com/center": "42",
                    "cost.example.com/budget": "7"}
        if obj["kind"] == "Service":
            expected["lb.example.com/internal"] = "true"
        assert annotations == expected, obj["kind"]
    # Pods are the template's: a label edit of the group must not roll out (and hand over).
    template = objects[3]["spec"]["template"]["metadata"]
    assert "team" not in template["labels"] and "annotations" not in template
    # Nothing named: no annotations but the Service's own.
    plain = owned(labels={"team": "payments"})
    assert [o["metadata"].get("annotations") for o in plain] == [None, None, None, None,
                                                                 {"lb.example.com/internal": "true"}, None]


def test_sidecar_pull_policy_and_pull_secrets_set_once_for_every_groups_pods() -> None:
    import dataclasses

    from singleton_operator.cli import load, parser

    environ = {"SINGLETON_SIDECAR_IMAGE_PULL_POLICY": "Always",
               "SINGLETON_SIDECAR_IMAGE_PULL_SECRETS": "regcred, mirror.example,regcred"}
    config = load(parser().parse_args(["run"]), environ)
    assert (config.sidecar_pull_policy, config.image_pull_secrets) == ("Always", ("regcred", "mirror.example"))
    flags = load(parser().parse_args(["run", "--sidecar-image-pull-policy", "Never",
                                      "--sidecar-image-pull-secret", "a"]), environ)
    assert (flags.sidecar_pull_policy, flags.image_pull_secrets) == ("Never", ("a",))
    unset = load(parser().parse_args(["run"]), {})
    assert (unset.sidecar_pull_policy, unset.image_pull_secrets) == (None, ())
    with pytest.raises(ConfigError, match=r"^--sidecar-image-pull-policy \(SINGLETON_SIDECAR_IMAGE_PULL_POLICY\)"):
        load(parser().parse_args(["run"]), {"SINGLETON_SIDECAR_IMAGE_PULL_POLICY": "always"})
    with pytest.raises(ConfigError, match=r"'Bad_Name' is not a Secret name"):
        load(parser().parse_args(["run"]), {"SINGLETON_SIDECAR_IMAGE_PULL_SECRETS": "Bad_Name"})

    template = {"spec": {"imagePullSecrets": [{"name": "app-registry"}, {"name": "regcred"}],
                         "containers": [{"name": "app", "image": "app:1"}]}}
    spec = dataclasses.replace(read_spec(body(template=template), default_sidecar_image=IMAGE),
                               sidecar_pull_policy="Always", image_pull_secrets=("regcred", "mirror.example"))
    pod_spec = resources.deployment(spec)["spec"]["template"]["spec"]
    assert pod_spec["imagePullSecrets"] == [{"name": "app-registry"}, {"name": "regcred"}, {"name": "mirror.example"}]
    assert pod_spec["initContainers"][0]["imagePullPolicy"] == "Always"
    assert "imagePullPolicy" not in pod_spec["containers"][0]  # the app's own stays the user's
    plain = resources.deployment(read_spec(body(), default_sidecar_image=IMAGE))["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in plain and "imagePullPolicy" not in plain["initContainers"][0]


@pytest.mark.parametrize(("postgres", "mode"), [
    pytest.param({"secretRef": {"name": "db"}}, None, id="not set: the sidecar's default, session"),
    pytest.param({"mode": "session", "secretRef": {"name": "db"}}, None, id="session"),
    pytest.param({"mode": "pooled", "secretRef": {"name": "db"}}, "pooled", id="pooled"),
])
def test_the_postgres_mode_reaches_the_sidecar_only_when_pooled(postgres: dict[str, Any], mode: str | None) -> None:
    """Unset for session, so pods of groups created before the field existed stay as they are."""
    spec = read_spec(body(backend="postgres", postgres=postgres), default_sidecar_image=IMAGE)
    env = env_of(resources.deployment(spec)["spec"]["template"]["spec"]["initContainers"][0])
    assert env.get(contract.ENV_POSTGRES_MODE) == mode
    assert sidecar_config(spec).postgres_mode == (mode or "session")


def test_kopfs_state_is_kept_per_object_in_memory_and_nothing_goes_on_the_object() -> None:
    import kopf

    from singleton_operator.kopf_state import MemoryDiffBaseStorage, MemoryProgressStorage

    prefix = "operator.singleton.dev"
    diffbase, progress = MemoryDiffBaseStorage(prefix=prefix), MemoryProgressStorage(prefix=prefix)
    first = kopf.Body({"metadata": {"uid": "u1", "name": "a"}, "spec": {"replicas": 2}})
    second = kopf.Body({"metadata": {"uid": "u2", "name": "b"}, "spec": {"replicas": 3}})
    patch = kopf.Patch()
    assert diffbase.fetch(body=first) is None  # a new process: every group is new to kopf
    diffbase.store(body=first, patch=patch, essence=diffbase.build(body=first))
    record: kopf.ProgressRecord = {"started": "2026-11-28T00:00:00", "retries": 1, "success": False}
    progress.store(key="reconcile", record=record, body=first, patch=patch)
    progress.store(key="reconcile", record=record, body=second, patch=patch)
    assert not patch  # nothing to write on the objects
    assert diffbase.fetch(body=first) == {"spec": {"replicas": 2}}
    assert diffbase.fetch(body=second) is None
    assert progress.fetch(key="reconcile", body=first) == record
    progress.purge(key="reconcile", body=first, patch=patch)
    assert progress.fetch(key="reconcile", body=first) is None
    assert progress.fetch(key="reconcile", body=second) == record
    progress.forget("u2")
    diffbase.forget("u1")
    assert len(progress) == 0 and len(diffbase) == 0
    # A delayed retry still wakes kopf: its touch is a patch of the object.
    progress.touch(body=first, patch=patch, value="2026-11-28T00:00:05")
    assert patch["metadata"]["annotations"][f"{prefix}/touch-dummy"] == "2026-11-28T00:00:05"


def test_the_essence_kopf_diffs_is_the_one_its_own_storage_builds() -> None:
    """MemoryDiffBaseStorage builds it from the spec, labels, annotations and owner references only."""
    import kopf

    from singleton_operator.kopf_state import MemoryDiffBaseStorage

    prefix = "operator.singleton.dev"
    raw: dict[str, Any] = {
        "apiVersion": "singleton.dev/v1", "kind": "SingletonService",
        "metadata": {"uid": "u1", "name": "a", "namespace": "ns", "generation": 3, "resourceVersion": "9",
                     "labels": {"team": "x"},
                     "annotations": {"note": "kept", f"{prefix}/touch-dummy": "t", f"{prefix}/kopf-managed": "yes",
                                     "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                     "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {}}}]},
        "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "app", "image": "app:1"}]}}},
        "status": {"leader": "a-0", "observedGeneration": 3}}
    body = kopf.Body(cast(kopf.RawBody, raw))
    ours = MemoryDiffBaseStorage(prefix=prefix).build(body=body)
    assert ours == kopf.AnnotationsDiffBaseStorage(prefix=prefix).build(body=body)
    assert ours == {"metadata": {"labels": {"team": "x"}, "annotations": {"note": "kept"}},
                    "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "app", "image": "app:1"}]}}}}
    ours["spec"]["replicas"] = 5  # a copy: later changes of the body's essence do not reach it
    assert body["spec"]["replicas"] == 2
    # kopf names its annotations after the owner of a Deployment's ReplicaSet.
    owned: dict[str, Any] = {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "rs", "ownerReferences": [{"kind": "Deployment", "name": "d", "uid": "u"}],
                     "annotations": {f"{prefix}/last-handled-configuration": "{}",
                                     f"{prefix}/last-handled-configuration-ofDRS": "{}"}},
        "spec": {"replicas": 1}}
    replica_set = kopf.Body(cast(kopf.RawBody, owned))
    assert MemoryDiffBaseStorage(prefix=prefix).build(body=replica_set) == kopf.AnnotationsDiffBaseStorage(
        prefix=prefix).build(body=replica_set)
    # A handler on other fields (kopf's extra fields) gets kopf's own build.
    assert MemoryDiffBaseStorage(prefix=prefix).build(body=body, extra_fields=["status.leader"])["status"] == {
        "leader": "a-0"}


def test_kopfs_own_annotations_are_cleared_from_an_essence_as_kopf_clears_them() -> None:
    """MemoryProgressStorage.clear copies only the dicts on the way to the annotations."""
    import copy

    import kopf

    from singleton_operator.kopf_state import MemoryProgressStorage

    prefix = "operator.singleton.dev"
    template = {"spec": {"containers": [{"name": "app", "image": "app:1"}]}}
    essences: list[dict[str, Any]] = [
        {"metadata": {"labels": {"team": "x"}, "annotations": {"note": "kept", f"{prefix}/touch-dummy": "t"}},
         "spec": {"replicas": 2, "template": template}},
        {"metadata": {"annotations": {f"{prefix}/reconcile": "{}"}}, "spec": {"replicas": 1}},
        {"metadata": {"labels": {}, "annotations": {}}, "spec": {}, "status": {}},
        {"spec": {"replicas": 3}},
        {"metadata": {"annotations": {"other.dev/x": "y"}}},
    ]
    for essence in essences:
        before = copy.deepcopy(essence)
        ours = MemoryProgressStorage(prefix=prefix).clear(essence=cast(kopf.BodyEssence, essence))
        assert ours == kopf.AnnotationsProgressStorage(prefix=prefix).clear(
            essence=cast(kopf.BodyEssence, copy.deepcopy(essence)))
        assert essence == before  # the essence handed in is left as it was


def test_the_connection_check_is_block_unless_set_and_leaves_the_pods_alone() -> None:
    specs = {check: read_spec(body(backend="postgres", postgres={"secretRef": {"name": "db"}, **extra}),
                              default_sidecar_image=IMAGE)
             for check, extra in (("unset", {}), ("warn", {"connectionCheck": "warn"}),
                                  ("skip", {"connectionCheck": "skip"}))}
    assert [s.postgres_connection_check for s in specs.values()] == ["block", "warn", "skip"]
    # The operator's own business: switching it rolls no pod out.
    assert len({resources.sidecar_config_digest(s) for s in specs.values()}) == 1
    assert len({str(resources.deployment(s)) for s in specs.values()}) == 1
    with pytest.raises(SpecError, match=r"^spec\.postgres\.connectionCheck: must be block, warn or skip, got 'Warn'$"):
        read_spec(body(backend="postgres", postgres={"secretRef": {"name": "db"}, "connectionCheck": "Warn"}),
                  default_sidecar_image=IMAGE)


def test_the_database_condition_says_the_last_check_and_is_kept_until_the_first() -> None:
    spec = read_spec(body(replicas=3, backend="postgres", postgres={"secretRef": {"name": "db"}}),
                     default_sidecar_image=IMAGE)

    def database(status: dict[str, Any]) -> tuple[str, str, str] | None:
        found = next((c for c in status["conditions"] if c["type"] == "DatabaseReachable"), None)
        return found and (found["status"], found["reason"], found["lastTransitionTime"])

    unreachable = DatabaseCheck(False, "PostgresUnreachable", "cannot connect with the DSN in Secret ns/db: ...")
    warned = compute_status(spec, Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3, database=unreachable),
                            {}, NOW)
    assert database(warned) == ("False", "PostgresUnreachable", "2026-11-25T12:00:00Z")
    # Applied all the same (warn): the group runs, is Ready, and is not Stalled for it.
    assert (warned["phase"], gitops(warned)["Ready"], gitops(warned)["Stalled"]) == (
        "Running", ("True", "Ready"), ("False", "AsExpected"))
    later = NOW + dt.timedelta(minutes=1)
    # An operator that has not checked yet (just started) keeps what the status said.
    kept = compute_status(spec, Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3), warned, later)
    assert database(kept) == database(warned)
    reachable = compute_status(spec, Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3,
                                              database=DatabaseCheck(True, "Connected", "connected")), warned, later)
    assert database(reachable) == ("True", "Connected", "2026-11-25T12:01:00Z")
    skipped = compute_status(spec, Observed(RUNNING, READY_DEPLOYMENT, applied_generation=3,
                                            database=DatabaseCheck(None, "CheckSkipped", "not checked")), {}, NOW)
    assert database(skipped) == ("Unknown", "CheckSkipped", "2026-11-25T12:00:00Z")
    # A group without a database has no such condition.
    lease = read_spec(body(replicas=3), default_sidecar_image=IMAGE)
    assert database(compute_status(lease, Observed(RUNNING, READY_DEPLOYMENT, database=unreachable), warned,
                                   NOW)) is None


def test_the_operators_connection_check_is_the_default_of_groups_that_set_none() -> None:
    from singleton_operator.cli import load, parser

    assert load(parser().parse_args(["run"]), {}).postgres_connection_check == "block"
    environ = {"SINGLETON_POSTGRES_CONNECTION_CHECK": "warn"}
    assert load(parser().parse_args(["run"]), environ).postgres_connection_check == "warn"
    assert load(parser().parse_args(["run", "--postgres-connection-check", "skip"]),
                environ).postgres_connection_check == "skip"
    with pytest.raises(ConfigError, match=r"^--postgres-connection-check \(SINGLETON_POSTGRES_CONNECTION_CHECK\): "
                                          r"must be block, warn or skip, got 'Warn'$"):
        load(parser().parse_args(["run"]), {"SINGLETON_POSTGRES_CONNECTION_CHECK": "Warn"})
    unset, block = ({"secretRef": {"name": "db"}}, {"secretRef": {"name": "db"}, "connectionCheck": "block"})
    assert [read_spec(body(backend="postgres", postgres=postgres), default_sidecar_image=IMAGE,
                      default_connection_check="warn").postgres_connection_check
            for postgres in (unset, block)] == ["warn", "block"]


def _init(name: str, *, native: bool = False) -> dict[str, Any]:
    return {"name": name, "image": "x:1", **({"restartPolicy": "Always"} if native else {})}


MESH_INITS = [_init("mesh-proxy", native=True), _init("log-agent", native=True), _init("migrate"),
              _init("late-agent", native=True)]


@pytest.mark.parametrize(("order", "names"), [
    (None, ["mesh-proxy", "log-agent", "singleton-sidecar", "migrate", "late-agent"]),
    ("AfterSidecars", ["mesh-proxy", "log-agent", "singleton-sidecar", "migrate", "late-agent"]),
    ("First", ["singleton-sidecar", "mesh-proxy", "log-agent", "migrate", "late-agent"]),
    ("Last", ["mesh-proxy", "log-agent", "migrate", "late-agent", "singleton-sidecar"]),
])
def test_the_sidecar_starts_after_the_leading_native_sidecars_unless_told_otherwise(order: str | None,
                                                                                   names: list[str]) -> None:
    sidecar_settings = {} if order is None else {"sidecar": {"startOrder": order}}
    template = {"spec": {"initContainers": MESH_INITS,
                         "containers": [{"name": "app", "image": "app:1", "command": ["poll"]}]}}
    spec = read_spec(body(template=template, **sidecar_settings), default_sidecar_image=IMAGE)
    pod = resources.deployment(spec)["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == names
    assert spec.sidecar_start_order == (order or "AfterSidecars")


@pytest.mark.parametrize(("inits", "names"), [
    ([], ["singleton-sidecar"]),
    ([_init("migrate")], ["singleton-sidecar", "migrate"]),
    ([_init("proxy", native=True)], ["proxy", "singleton-sidecar"]),
    # Istio without its CNI (istio-validation with it), and Linkerd without its CNI: the mesh's
    # setup container, then its proxy, then the user's.
    ([_init("istio-init"), _init("istio-proxy", native=True), _init("migrate")],
     ["istio-init", "istio-proxy", "singleton-sidecar", "migrate"]),
    ([_init("linkerd-init"), _init("linkerd-proxy", native=True)],
     ["linkerd-init", "linkerd-proxy", "singleton-sidecar"]),
    # An injector that appended its proxy behind the user's migration: the proxy starts after
    # it, so the sidecar does too.
    ([_init("migrate"), _init("proxy", native=True), _init("late", native=True), _init("seed")],
     ["migrate", "proxy", "late", "singleton-sidecar", "seed"]),
])
def test_after_sidecars_goes_behind_the_first_native_sidecars_or_first_without_them(
        inits: list[dict[str, Any]], names: list[str]) -> None:
    placed = resources.place_sidecar({"name": "singleton-sidecar"}, inits, "AfterSidecars")
    assert [c["name"] for c in placed] == names


def test_a_bad_start_order_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match=r"spec.sidecar.startOrder: must be AfterSidecars, First or Last, got 'last'"):
        read_spec(body(sidecar={"startOrder": "last"}), default_sidecar_image=IMAGE)


def test_only_a_start_order_that_is_set_enters_the_sidecar_settings_digest() -> None:
    plain = read_spec(body(), default_sidecar_image=IMAGE)
    default = read_spec(body(sidecar={"startOrder": "AfterSidecars"}), default_sidecar_image=IMAGE)
    last = read_spec(body(sidecar={"startOrder": "Last"}), default_sidecar_image=IMAGE)
    # An operator upgrade changes no adopted workload's digest (no rollout); a change of the order does.
    assert resources.sidecar_config_digest(plain) == resources.sidecar_config_digest(default)
    assert resources.sidecar_config_digest(last) != resources.sidecar_config_digest(plain)
