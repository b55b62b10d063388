"""The SingletonService CRD (crds/singleton.dev_singletonservices.yaml) against the real API server.

Defaults, OpenAPI and CEL validation (on create and on update), ``kubectl explain``, the
printer columns, the short name and the category, and the status subresource.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CRD_PATH, Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

Obj = dict[str, Any]

DELETE = object()
"""Value in an edit that removes the key instead of setting it."""


def minimal(name: str = "demo") -> Obj:
    return {
        "apiVersion": "singleton.dev/v1alpha1",
        "kind": "SingletonService",
        "metadata": {"name": name},
        "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "busybox"}]}}},
    }


def full(name: str = "feed-poller") -> Obj:
    """Every field set; timings and drain sit exactly on the boundaries of their rules."""
    return {
        "apiVersion": "singleton.dev/v1alpha1",
        "kind": "SingletonService",
        "metadata": {"name": name},
        "spec": {
            "replicas": 3,
            "backend": "both",
            "postgres": {"secretRef": {"name": "feed-db.credentials", "key": "dsn.url"}},
            # leaseDuration - renewDeadline == 500ms; renewDeadline * 5 > retryPeriod * 6 (12.5s > 12s)
            "timings": {"leaseDuration": "3s", "renewDeadline": "2500ms", "retryPeriod": "2s"},
            # drain.timeout + 2s == terminationGracePeriodSeconds
            "drain": {"timeout": "25s", "hookURL": "http://127.0.0.1:8000/drain"},
            "terminationGracePeriodSeconds": 27,
            "gating": {"mode": "file"},
            "mainContainer": "poller",
            "template": {
                "metadata": {"labels": {"app": "feed-poller"}, "annotations": {"prometheus.io/scrape": "true"}},
                "spec": {
                    "serviceAccountName": "feed-poller",
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "initContainers": [{"name": "migrate", "image": "busybox", "command": ["true"]}],
                    "containers": [
                        {"name": "helper", "image": "busybox", "ports": [{"containerPort": 8080}]},
                        {
                            "name": "poller",
                            "image": "ghcr.io/acme/poller:1.2",
                            "command": ["python", "poller.py"],
                            "args": ["--verbose"],
                            "env": [{"name": "FEED", "value": "news"}],
                            "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
                        },
                    ],
                },
            },
            "service": {
                "type": "LoadBalancer",
                "annotations": {"example.com/lb": "internal"},
                "ports": [
                    {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                    {"name": "dns", "port": 80, "targetPort": 5353, "protocol": "UDP"},
                    {"name": "stream", "port": 9000, "protocol": "SCTP"},
                ],
            },
            "sidecar": {
                "image": "ghcr.io/acme/singleton-sidecar:0.1.0",
                "port": 9091,
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                "logLevel": "debug",
            },
            "podDisruptionBudget": {"enabled": False},
        },
    }


def edited(base: Obj, edits: dict[str, Any]) -> Obj:
    """A deep copy of ``base`` with dotted paths (``spec.template.spec.containers.0.image``) set or DELETEd."""
    obj = copy.deepcopy(base)
    for path, value in edits.items():
        *parents, last = path.split(".")
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        elif value is DELETE:
            del node[last]
        else:
            node[last] = value
    return obj


def create(cluster: Cluster, ns: str, obj: Obj) -> tuple[int, str]:
    """``kubectl create --validate=strict`` (unknown fields are errors); returns (exit code, stderr)."""
    args = ("create", "--validate=strict", "-n", ns, "-f", "-")
    result = cluster.kubectl(*args, input_text=json.dumps(obj), check=False)
    return result.returncode, result.stderr


def get(cluster: Cluster, ns: str, name: str) -> Obj:
    out: Obj = json.loads(cluster.kubectl("get", "singletonservice", name, "-n", ns, "-o", "json").stdout)
    return out


@pytest.fixture(scope="module")
def ns(cluster: Cluster, singleton_crd: Path) -> Iterator[str]:
    """One namespace for the tests of this module."""
    name = "crd-" + secrets.token_hex(4)
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# --- the file itself -------------------------------------------------------------------------


def _crd() -> Obj:
    doc: Obj = yaml.safe_load(CRD_PATH.read_text())
    return doc


def _undocumented(schema: Obj, path: str) -> Iterator[str]:
    if not schema.get("description"):
        yield path
    for key, sub in schema.get("properties", {}).items():
        if path == "" and key == "metadata":
            continue  # ObjectMeta: documented by Kubernetes itself
        yield from _undocumented(sub, f"{path}.{key}")
    if schema.get("items", {}).get("type") == "object":  # items of scalars are documented by their array
        yield from _undocumented(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict) and "properties" in schema["additionalProperties"]:
        yield from _undocumented(schema["additionalProperties"], f"{path}{{}}")


def test_every_field_has_a_description() -> None:
    (version,) = _crd()["spec"]["versions"]
    missing = [p or "<root>" for p in _undocumented(version["schema"]["openAPIV3Schema"], "")]
    assert missing == []


def test_object_defaults_agree_with_field_defaults() -> None:
    """An object default ({...}) must hold exactly the defaults of its fields, or the two would drift."""
    (version,) = _crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    checked = 0
    for name, schema in spec.items():
        if schema.get("type") == "object" and "default" in schema:
            field_defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
            assert schema["default"] == field_defaults, name
            checked += 1
    assert checked == 4


# --- defaults and valid objects --------------------------------------------------------------


def test_minimal_object_gets_defaults(cluster: Cluster, ns: str) -> None:
    name = "min-" + secrets.token_hex(3)
    code, err = create(cluster, ns, minimal(name))
    assert code == 0, err
    spec = get(cluster, ns, name)["spec"]
    assert spec["replicas"] == 2
    assert spec["backend"] == "lease"
    assert "timings" not in spec  # the operator applies the backend's defaults
    assert spec["drain"] == {"timeout": "20s"}
    assert spec["terminationGracePeriodSeconds"] == 30
    assert spec["gating"] == {"mode": "cooperative"}
    assert spec["sidecar"] == {"port": 9090, "logLevel": "info"}
    assert spec["podDisruptionBudget"] == {"enabled": True}
    assert "postgres" not in spec
    assert "service" not in spec
    assert "mainContainer" not in spec


def test_partial_objects_get_field_defaults(cluster: Cluster, ns: str) -> None:
    name = "part-" + secrets.token_hex(3)
    obj = edited(
        minimal(name),
        {
            "spec.backend": "postgres",
            "spec.postgres": {"secretRef": {"name": "db"}},
            "spec.sidecar": {"image": ""},
            "spec.service": {"ports": [{"port": 80}]},
        },
    )
    code, err = create(cluster, ns, obj)
    assert code == 0, err
    spec = get(cluster, ns, name)["spec"]
    assert spec["postgres"] == {"secretRef": {"name": "db", "key": "dsn"}}
    assert spec["sidecar"] == {"image": "", "port": 9090, "logLevel": "info"}
    assert spec["service"] == {"type": "ClusterIP", "ports": [{"port": 80, "protocol": "TCP"}]}


def test_full_object_is_accepted_and_kept(cluster: Cluster, ns: str) -> None:
    obj = full("full-" + secrets.token_hex(3))
    code, err = create(cluster, ns, obj)
    assert code == 0, err
    spec = get(cluster, ns, obj["metadata"]["name"])["spec"]
    assert spec == obj["spec"]  # nothing pruned (PodSpec pass-through included), nothing added


@pytest.mark.parametrize(
    "edits",
    [
        pytest.param({"metadata.name": "a" * 52}, id="name-of-52-chars"),
        pytest.param({"spec.replicas": 1}, id="replicas-1"),
        pytest.param({"spec.replicas": 50}, id="replicas-50"),
        pytest.param(
            {"spec.timings": {"leaseDuration": "5m", "renewDeadline": "4m59.5s", "retryPeriod": "1m"}},
            id="lease-5m",
        ),
        pytest.param(
            {"spec.timings": {"leaseDuration": "800ms", "renewDeadline": "300ms", "retryPeriod": "100ms"}},
            id="retry-100ms",
        ),
        pytest.param({"spec.drain": {"timeout": "1m30s"}, "spec.terminationGracePeriodSeconds": 120}, id="drain-1m30s"),
        pytest.param({"spec.drain.hookURL": "http://localhost/drain"}, id="hook-localhost"),
        pytest.param({"spec.drain.hookURL": "http://[::1]:8000/drain?wait=1"}, id="hook-ipv6-loopback"),
        pytest.param({"spec.gating.mode": "file", "spec.template.spec.containers.0.command": ["run"]}, id="file-gate"),
        pytest.param({"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "db"}}}, id="postgres"),
        pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 8080}]}}, id="one-unnamed-port"),
        pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 9091}]}, id="container-port-9091"),
    ],
)
def test_valid_variants_are_accepted(cluster: Cluster, ns: str, edits: dict[str, Any]) -> None:
    obj = edited(minimal("ok-" + secrets.token_hex(4)), edits)
    code, err = create(cluster, ns, obj)
    assert code == 0, err


# --- invalid objects -------------------------------------------------------------------------

PG = {"secretRef": {"name": "db"}}
TWO = [{"name": "app", "image": "busybox"}, {"name": "two", "image": "busybox"}]

INVALID: list[Any] = [
    # timings
    pytest.param(
        {"spec.timings": {"leaseDuration": "4s", "renewDeadline": "4s", "retryPeriod": "1s"}},
        ["spec.timings.renewDeadline", "must be shorter than spec.timings.leaseDuration"],
        id="timings-renew-equals-lease",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "4s", "renewDeadline": "3800ms", "retryPeriod": "1s"}},
        ["spec.timings.renewDeadline", "at least 500ms shorter than spec.timings.leaseDuration"],
        id="timings-renew-within-500ms-of-lease",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "6s", "renewDeadline": "2s", "retryPeriod": "2s"}},
        ["spec.timings.retryPeriod", "must be shorter than spec.timings.renewDeadline"],
        id="timings-retry-equals-renew",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "6s", "renewDeadline": "4s", "retryPeriod": "3500ms"}},
        ["spec.timings.renewDeadline", "1.2 times spec.timings.retryPeriod"],
        id="timings-renew-under-1.2x-retry",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "1s", "renewDeadline": "300ms", "retryPeriod": "50ms"}},
        ["spec.timings.retryPeriod", "at least 100ms"],
        id="timings-retry-under-100ms",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "5m1s", "renewDeadline": "4s", "retryPeriod": "2s"}},
        ["spec.timings.leaseDuration", "at most 5m"],
        id="timings-lease-over-5m",
    ),
    pytest.param({"spec.timings.leaseDuration": "6 seconds"}, ["spec.timings.leaseDuration"], id="duration-words"),
    pytest.param({"spec.timings.retryPeriod": "2"}, ["spec.timings.retryPeriod"], id="duration-no-unit"),
    pytest.param({"spec.timings.renewDeadline": "-4s"}, ["spec.timings.renewDeadline"], id="duration-negative"),
    pytest.param({"spec.drain.timeout": "20sec"}, ["spec.drain.timeout"], id="drain-duration-bad-unit"),
    # replicas
    pytest.param({"spec.replicas": 0}, ["spec.replicas"], id="replicas-0"),
    pytest.param({"spec.replicas": -1}, ["spec.replicas"], id="replicas-negative"),
    pytest.param({"spec.replicas": 51}, ["spec.replicas"], id="replicas-51"),
    pytest.param({"spec.replicas": "two"}, ["spec.replicas"], id="replicas-string"),
    # backend and postgres
    pytest.param({"spec.backend": "etcd"}, ["spec.backend", "Unsupported value"], id="backend-unknown"),
    pytest.param({"spec.backend": "postgres"}, ["spec.postgres", "is required"], id="postgres-without-postgres"),
    pytest.param({"spec.backend": "both"}, ["spec.postgres", "is required"], id="both-without-postgres"),
    pytest.param(
        {"spec.postgres": PG}, ["spec.postgres", "must not be set when spec.backend is lease"], id="lease-with-postgres"
    ),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "Bad_Name"}}},
        ["spec.postgres.secretRef.name"],
        id="secret-name-invalid",
    ),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"secretRef": {"key": "dsn"}}},
        ["spec.postgres.secretRef.name", "Required value"],
        id="secret-name-missing",
    ),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "db", "key": "a/b"}}},
        ["spec.postgres.secretRef.key"],
        id="secret-key-invalid",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "10s"}}, ["spec.timings.renewDeadline", "Required value"],
        id="timings-partial",
    ),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"dsn": "postgresql://u:pw@db/app", **PG}},
        ['unknown field "spec.postgres.dsn"'],
        id="postgres-dsn-in-spec",
    ),
    # drain and grace period
    pytest.param(
        {"spec.drain.timeout": "30s"},
        ["spec.drain.timeout", "spec.terminationGracePeriodSeconds"],
        id="drain-equals-grace",
    ),
    pytest.param(
        {"spec.drain.timeout": "28500ms"},
        ["spec.drain.timeout", "at least 2s shorter than spec.terminationGracePeriodSeconds"],
        id="drain-within-2s-of-grace",
    ),
    pytest.param({"spec.terminationGracePeriodSeconds": 0}, ["spec.terminationGracePeriodSeconds"], id="grace-0"),
    pytest.param({"spec.drain.hookURL": "http://example.com/drain"}, ["spec.drain.hookURL"], id="hook-not-loopback"),
    pytest.param({"spec.drain.hookURL": "https://127.0.0.1/drain"}, ["spec.drain.hookURL"], id="hook-https"),
    # gating and main container
    pytest.param({"spec.gating.mode": "exec"}, ["spec.gating.mode", "Unsupported value"], id="gating-mode-unknown"),
    pytest.param({"spec.gating.mode": "file"}, ["spec.gating.mode", "command"], id="file-gating-without-command"),
    pytest.param(
        {
            "spec.gating.mode": "file",
            "spec.mainContainer": "two",
            "spec.template.spec.containers": [{"name": "app", "image": "b", "command": ["x"]}, TWO[1]],
        },
        ["spec.gating.mode", "command"],
        id="file-gating-main-container-without-command",
    ),
    pytest.param(
        {"spec.gating.mode": "file", "spec.template.spec.containers.0.command": []},
        ["spec.gating.mode", "command"],
        id="file-gating-empty-command",
    ),
    pytest.param({"spec.mainContainer": "web"}, ["spec.mainContainer", "must name a container"], id="main-not-in-tmpl"),
    pytest.param({"spec.mainContainer": "App"}, ["spec.mainContainer"], id="main-container-invalid-name"),
    # template
    pytest.param({"spec.template": DELETE}, ["spec.template", "Required value"], id="template-missing"),
    pytest.param({"spec.template.spec.containers": []}, ["spec.template.spec.containers"], id="containers-empty"),
    pytest.param({"spec.template.spec.containers": DELETE}, ["spec.template.spec.containers"], id="containers-missing"),
    pytest.param(
        {"spec.template.spec.containers": [{"name": "app"}]},
        ["spec.template.spec.containers[0].image", "Required value"],
        id="container-without-image",
    ),
    pytest.param(
        {"spec.template.spec.containers.0.image": ""},
        ["spec.template.spec.containers[0].image"],
        id="container-empty-image",
    ),
    pytest.param(
        {"spec.template.spec.containers.0.name": "My_App"},
        ["spec.template.spec.containers[0].name"],
        id="container-name-invalid",
    ),
    pytest.param(
        {"spec.template.spec.containers": [TWO[0], TWO[0]]},
        ["spec.template.spec.containers", "must be unique"],
        id="container-names-duplicate",
    ),
    pytest.param(
        {"spec.template.spec.containers": [TWO[0], {"name": "singleton-sidecar", "image": "x"}]},
        ["spec.template.spec.containers[1].name", "reserved"],
        id="container-name-reserved",
    ),
    pytest.param(
        {"spec.template.spec.initContainers": [{"name": "singleton-sidecar", "image": "x"}]},
        ["spec.template.spec.initContainers[0].name", "reserved"],
        id="init-container-name-reserved",
    ),
    pytest.param(
        {"spec.template.spec.initContainers": [{"name": "app", "image": "x"}]},
        ["spec.template.spec.containers", "must be unique"],
        id="init-container-name-clash",
    ),
    pytest.param(
        {"spec.template.spec.containers": [{"name": f"c{i}", "image": "x"} for i in range(21)]},
        ["spec.template.spec.containers", "21"],
        id="containers-too-many",
    ),
    pytest.param(
        {"spec.template.metadata": {"labels": {"singleton.dev/role": "leader"}}},
        ["spec.template.metadata.labels", "singleton.dev/"],
        id="template-label-reserved",
    ),
    pytest.param(
        {"spec.template.metadata": {"annotations": {"singleton.dev/token": "7"}}},
        ["spec.template.metadata.annotations", "singleton.dev/"],
        id="template-annotation-reserved",
    ),
    pytest.param(
        {"spec.template.spec.serviceAccountName": "Not_Valid"},
        ["spec.template.spec.serviceAccountName"],
        id="service-account-name-invalid",
    ),
    # service
    pytest.param({"spec.service": {"ports": [{"port": 0}]}}, ["spec.service.ports[0].port"], id="service-port-0"),
    pytest.param({"spec.service": {"ports": [{"port": 70000}]}}, ["spec.service.ports[0].port"], id="svc-port-70000"),
    pytest.param(
        {"spec.service": {"ports": [{"port": 80, "protocol": "HTTP"}]}},
        ["spec.service.ports[0].protocol", "Unsupported value"],
        id="service-protocol-unknown",
    ),
    pytest.param(
        {"spec.service": {"ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81}]}},
        ["spec.service.ports", "name values must be unique"],
        id="service-port-names-duplicate",
    ),
    pytest.param(
        {"spec.service": {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80, "protocol": "TCP"}]}},
        ["spec.service.ports", "unique per protocol"],
        id="service-ports-duplicate",
    ),
    pytest.param(
        {"spec.service": {"ports": [{"name": "a", "port": 80}, {"port": 81}]}},
        ["spec.service.ports", "name is required"],
        id="service-port-name-missing",
    ),
    pytest.param(
        {"spec.service": {"type": "ExternalName", "ports": [{"port": 80}]}},
        ["spec.service.type", "Unsupported value"],
        id="service-type-unknown",
    ),
    pytest.param({"spec.service": {"ports": []}}, ["spec.service.ports"], id="service-ports-empty"),
    # sidecar and PDB
    pytest.param({"spec.sidecar": {"port": 0}}, ["spec.sidecar.port"], id="sidecar-port-0"),
    pytest.param({"spec.sidecar": {"port": 65536}}, ["spec.sidecar.port"], id="sidecar-port-65536"),
    pytest.param(
        {"spec.template.spec.containers.0.ports": [{"containerPort": 80}, {"containerPort": 9090}]},
        ["spec.sidecar.port", "containerPort"],
        id="sidecar-port-clashes-with-container",
    ),
    pytest.param({"spec.sidecar": {"logLevel": "trace"}}, ["spec.sidecar.logLevel", "Unsupported"], id="log-level-bad"),
    pytest.param({"spec.podDisruptionBudget": {"enabled": "yes"}}, ["spec.podDisruptionBudget.enabled"], id="pdb-str"),
    # metadata.name and unknown fields
    pytest.param({"metadata.name": "a" * 53}, ["metadata.name", "at most 52"], id="name-53-chars"),
    pytest.param({"metadata.name": "feed.poller"}, ["metadata.name", "DNS-1123 label"], id="name-with-dot"),
    pytest.param({"spec.replica": 3}, ['unknown field "spec.replica"'], id="unknown-spec-field"),
    pytest.param({"spec.timings.lease": "6s"}, ['unknown field "spec.timings.lease"'], id="unknown-timings-field"),
]


@pytest.mark.parametrize(("edits", "expected"), INVALID)
def test_invalid_object_is_rejected(cluster: Cluster, ns: str, edits: dict[str, Any], expected: list[str]) -> None:
    obj = edited(minimal("bad-" + secrets.token_hex(4)), edits)
    code, err = create(cluster, ns, obj)
    if code == 0:
        cluster.kubectl("delete", "singletonservice", obj["metadata"]["name"], "-n", ns, check=False)
        pytest.fail(f"accepted: {json.dumps(obj['spec'])}")
    for text in expected:
        assert text in err, f"{text!r} not in: {err}"


def test_there_are_many_invalid_cases() -> None:
    ids = [p.id for p in INVALID]
    assert len(set(ids)) == len(ids) >= 30


# --- updates ---------------------------------------------------------------------------------

BAD_UPDATES: list[Any] = [
    pytest.param({"spec": {"timings": {"leaseDuration": "6s", "renewDeadline": "10s", "retryPeriod": "2s"}}},
                 "spec.timings.renewDeadline", id="renew-over-lease"),
    pytest.param({"spec": {"backend": "both", "postgres": {"secretRef": {"name": "db"}}}}, "spec.backend",
                 id="backend-change"),
    pytest.param({"spec": {"backend": "postgres"}}, "spec.postgres", id="backend-postgres-without-postgres"),
    pytest.param({"spec": {"terminationGracePeriodSeconds": 20}}, "spec.drain.timeout", id="grace-below-drain"),
    pytest.param({"spec": {"gating": {"mode": "file"}}}, "spec.gating.mode", id="file-gating-without-command"),
    pytest.param({"spec": {"mainContainer": "web"}}, "spec.mainContainer", id="main-container-unknown"),
    pytest.param({"spec": {"replicas": 0}}, "spec.replicas", id="replicas-0"),
    pytest.param(
        {"spec": {"template": {"metadata": {"labels": {"singleton.dev/role": "leader"}}}}},
        "spec.template.metadata.labels",
        id="reserved-label",
    ),
]


@pytest.mark.parametrize(("patch", "field"), BAD_UPDATES)
def test_invalid_update_is_rejected(cluster: Cluster, ns: str, patch: Obj, field: str) -> None:
    name = "upd-" + secrets.token_hex(4)
    code, err = create(cluster, ns, minimal(name))
    assert code == 0, err
    before = get(cluster, ns, name)
    result = cluster.kubectl(
        "patch", "singletonservice", name, "-n", ns, "--type=merge", "-p", json.dumps(patch), check=False
    )
    assert result.returncode != 0, "update accepted"
    assert field in result.stderr, result.stderr
    after = get(cluster, ns, name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_valid_update_is_accepted(cluster: Cluster, ns: str) -> None:
    name = "upd-" + secrets.token_hex(4)
    code, err = create(cluster, ns, edited(minimal(name), {"spec.backend": "both",
                                                            "spec.postgres": {"secretRef": {"name": "db"}}}))
    assert code == 0, err
    patch = {
        "spec": {
            "postgres": {"secretRef": {"name": "db2", "key": "url"}},
            "timings": {"leaseDuration": "10s", "renewDeadline": "8s", "retryPeriod": "3s"},
            "replicas": 3,
        }
    }
    cluster.kubectl("patch", "singletonservice", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    spec = get(cluster, ns, name)["spec"]
    assert (spec["postgres"]["secretRef"]["name"], spec["replicas"], spec["timings"]["renewDeadline"]) == (
        "db2", 3, "8s")


# --- kubectl explain, printer columns, short name, category, status ---------------------------


def _explain(cluster: Cluster, path: str) -> str:
    """``kubectl explain``, retried: the OpenAPI of a new CRD is published a few seconds after Established."""
    deadline = time.monotonic() + 60
    while True:
        result = cluster.kubectl("explain", path, check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            assert result.returncode == 0, result.stderr
            return result.stdout
        time.sleep(0.5)


def test_explain_documents_fields(cluster: Cluster, singleton_crd: Path) -> None:
    lease = _explain(cluster, "singletonservice.spec.timings.leaseDuration")
    assert "FIELD: leaseDuration <string>" in lease
    assert "valid without renewal" in lease
    conditions = _explain(cluster, "singletonservice.status.conditions")
    for condition_type in ("Available", "LeaderElected", "Progressing", "Degraded"):
        assert condition_type in conditions
    postgres = _explain(cluster, "sgl.spec.postgres")
    assert "Secret" in postgres
    assert "secretRef" in postgres


def test_printer_columns_short_name_category_and_status(cluster: Cluster, namespace: str, singleton_crd: Path) -> None:
    code, err = create(cluster, namespace, minimal("poller"))
    assert code == 0, err
    header, row = cluster.kubectl("get", "sgl", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "LEADER", "TOKEN", "STANDBYS", "BACKEND", "PHASE", "AGE"]
    assert row.split()[:2] == ["poller", "lease"]

    status: Obj = {
        "status": {
            "leader": "poller-7d9f-abcde",
            "leaderIdentity": "poller-7d9f-abcde/0b1c/4f2a",
            "token": 42,
            "leaderSince": "2025-01-02T03:04:05Z",
            "transitions": 3,
            "replicas": 2,
            "readyReplicas": 2,
            "readyStandbys": 1,
            "phase": "Running",
            "message": "leader elected",
            "observedGeneration": 1,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "LeaderElected",
                    "message": "poller-7d9f-abcde leads",
                    "lastTransitionTime": "2025-01-02T03:04:05Z",
                    "observedGeneration": 1,
                }
            ],
        }
    }
    args = ("patch", "sgl", "poller", "-n", namespace, "--subresource=status", "--type=merge")
    cluster.kubectl(*args, "-p", json.dumps(status))
    _, row = cluster.kubectl("get", "sgl", "-n", namespace).stdout.splitlines()
    assert row.split()[:6] == ["poller", "poller-7d9f-abcde", "42", "1", "lease", "Running"]
    assert get(cluster, namespace, "poller")["status"] == status["status"]

    listed = cluster.kubectl("get", "singleton", "-n", namespace, "-o", "name").stdout.split()
    assert listed == ["singletonservice.singleton.dev/poller"]

    # the status schema is validated too
    bad = cluster.kubectl(*args, "-p", json.dumps({"status": {"phase": "Happy"}}), check=False)
    assert bad.returncode != 0
    assert "status.phase" in bad.stderr
    condition = {**status["status"]["conditions"][0], "status": "Maybe"}
    bad = cluster.kubectl(*args, "-p", json.dumps({"status": {"conditions": [condition]}}), check=False)
    assert bad.returncode != 0
    assert "status.conditions[0].status" in bad.stderr
    twice = [status["status"]["conditions"][0]] * 2
    bad = cluster.kubectl(*args, "-p", json.dumps({"status": {"conditions": twice}}), check=False)
    assert bad.returncode != 0
    assert "status.conditions[1]: Duplicate value" in bad.stderr
    # and a spec change through the status subresource is ignored
    cluster.kubectl(*args, "-p", json.dumps({"spec": {"replicas": 5}}))
    assert get(cluster, namespace, "poller")["spec"]["replicas"] == 2
