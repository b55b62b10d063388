"""The SingletonService CRD (crds/singleton.dev_singletonservices.yaml) against the real API server.

Defaults, OpenAPI and CEL validation (on create and on update), ``kubectl explain``, the
printer columns, the short name and the category, and the status subresource.
"""

from __future__ import annotations

import copy
import json
import random
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_operator.model.spec import SpecError, read_spec
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
                "port": 7460,
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                "logLevel": "debug",
                "startOrder": "Last",
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
    assert spec["sidecar"] == {"port": 7450, "logLevel": "info", "startOrder": "AfterSidecars"}
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
    assert spec["sidecar"] == {"image": "", "port": 7450, "logLevel": "info", "startOrder": "AfterSidecars"}
    assert spec["service"] == {"type": "ClusterIP", "ports": [{"port": 80, "protocol": "TCP"}]}


def test_full_object_is_accepted_and_kept(cluster: Cluster, ns: str) -> None:
    obj = full("full-" + secrets.token_hex(3))
    code, err = create(cluster, ns, obj)
    assert code == 0, err
    spec = get(cluster, ns, obj["metadata"]["name"])["spec"]
    assert spec == obj["spec"]  # nothing pruned (PodSpec pass-through included), nothing added


FILE_GATE = {"spec.gating.mode": "file", "spec.template.spec.containers.0.command": ["run"]}

VALID: list[Any] = [
    # Each sits on the boundary of a rule (the operator's read_spec must accept them too:
    # tests/unit/operator/test_operator_units.py runs every one through it).
    pytest.param({"metadata.name": "a" * 52}, id="name-of-52-chars"),
    pytest.param({"metadata.name": "a"}, id="name-of-1-letter"),
    pytest.param({"metadata.name": "a1-2"}, id="name-with-digits-after-a-letter"),
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
    # 0.7 - 0.2 < 0.5 in floats: exactly 500ms in durations
    pytest.param(
        {"spec.timings": {"leaseDuration": "700ms", "renewDeadline": "200ms", "retryPeriod": "100ms"}},
        id="margin-500ms-exactly",
    ),
    # 5 x 2.401080001s exceeds 6 x 2.0009s by 5ns
    pytest.param(
        {"spec.timings": {"leaseDuration": "4s", "renewDeadline": "2.401080001s", "retryPeriod": "2.0009s"}},
        id="renew-1ns-over-1.2x-retry",
    ),
    # Go reads 0.5000000009s as 500ms (digits past the nanosecond are dropped): a margin of
    # exactly 500ms, not 499.9999991ms
    pytest.param(
        {"spec.timings": {"leaseDuration": "1s", "renewDeadline": "0.5000000009s", "retryPeriod": "0.4s"}},
        id="sub-nanosecond-digits-dropped",
    ),
    pytest.param(
        {"spec.timings": {"leaseDuration": "0.08h", "renewDeadline": "0.0275h", "retryPeriod": "1m0.5s"}},
        id="fractions-of-hours",
    ),
    pytest.param({"spec.drain": {"timeout": "1m30s"}, "spec.terminationGracePeriodSeconds": 120}, id="drain-1m30s"),
    pytest.param({"spec.drain.timeout": "28s"}, id="drain-2s-under-grace"),
    pytest.param({"spec.drain.timeout": "27.999999999s"}, id="drain-2s-and-1ns-under-grace"),
    pytest.param({"spec.drain.timeout": "0.000000001s"}, id="drain-1ns"),
    pytest.param({"spec.drain.timeout": "0.0005s", "spec.terminationGracePeriodSeconds": 3}, id="drain-500us"),
    pytest.param({"spec.drain.hookURL": "http://localhost/drain"}, id="hook-localhost"),
    pytest.param({"spec.drain.hookURL": "http://[::1]:8000/drain?wait=1"}, id="hook-ipv6-loopback"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:65535/drain"}, id="hook-port-65535"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:1"}, id="hook-port-1"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:7449/drain"}, id="hook-port-below-sidecar"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:7452/drain"}, id="hook-port-above-control"),
    pytest.param(FILE_GATE, id="file-gate"),
    pytest.param(
        {**FILE_GATE, "spec.template.spec.containers.0.volumeMounts": [{"name": "d", "mountPath": "/var/run/data"}],
         "spec.template.spec.volumes": [{"name": "d", "emptyDir": {}}]},
        id="file-gate-with-other-mounts",
    ),
    pytest.param({"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "db"}}}, id="postgres"),
    pytest.param({"spec.backend": "postgres", "spec.postgres": {"mode": "pooled", "secretRef": {"name": "db"}}},
                 id="postgres-pooled"),
    *(pytest.param({"spec.backend": "both", "spec.postgres": {"connectionCheck": check, "secretRef": {"name": "db"}}},
                   id=f"postgres-connection-check-{check}") for check in ("block", "warn", "skip")),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "db", "key": ".dsn"}}},
        id="secret-key-starting-with-one-dot",
    ),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 8080}]}}, id="one-unnamed-port"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 65535}]}}, id="target-port-65535"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 7450}]}}, id="target-port-of-sidecar"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": "singleton"}]}}, id="target-port-singleton"),
    pytest.param(
        {"spec.service": {"ports": [{"port": 80, "targetPort": "metrics-http15"}]},
         "spec.template.spec.initContainers": [{"name": "agent", "image": "x", "restartPolicy": "Always",
                                                "ports": [{"containerPort": 7000, "name": "metrics-http15"}]}]},
        id="target-port-named-in-init-container",
    ),
    pytest.param(
        {"spec.service": {"ports": [{"port": 80}], "annotations": {"service.beta.kubernetes.io/aws-lb": "x" * 500}}},
        id="service-annotation",
    ),
    pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 7449}]}, id="container-port-7449"),
    pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 7452}]}, id="container-port-7452"),
    pytest.param({"spec.sidecar": {"port": 65534}}, id="sidecar-port-65534"),
    pytest.param({"spec.sidecar": {"port": 1}}, id="sidecar-port-1"),
    pytest.param({"spec.sidecar": {"image": ""}}, id="sidecar-image-empty"),
    pytest.param(
        {"spec.sidecar": {"resources": {"requests": {"cpu": "10m", "memory": 67108864, "ephemeral-storage": "1e9"},
                                        "limits": {"cpu": "0.01", "memory": "64Mi", "ephemeral-storage": "1Gi"}}}},
        id="sidecar-requests-up-to-limits",
    ),
    pytest.param({"spec.sidecar": {"resources": {"limits": {"memory": "128Mi"}}}}, id="sidecar-limits-only"),
    pytest.param(
        {"spec.template.metadata": {"labels": {"example.com/" + "k" * 63: "v" * 63, "empty": ""},
                                    "annotations": {"a" * 253 + "/b": "anything at all: {\"json\": 1}"}}},
        id="label-and-annotation-limits",
    ),
    pytest.param(
        {"spec.template.spec.initContainers": [{"name": "one", "image": "x"}, {"name": "two", "image": "x"}]},
        id="two-init-containers",
    ),
    pytest.param({"spec.template.spec.volumes": [{"name": "data", "emptyDir": {}}]}, id="a-volume"),
]


@pytest.mark.parametrize("edits", VALID)
def test_valid_variants_are_accepted(cluster: Cluster, ns: str, edits: dict[str, Any]) -> None:
    obj = edited(minimal("ok-" + secrets.token_hex(4)), edits)
    code, err = create(cluster, ns, obj)
    assert code == 0, err


# --- invalid objects -------------------------------------------------------------------------

PG = {"secretRef": {"name": "db"}}
TWO = [{"name": "app", "image": "busybox"}, {"name": "two", "image": "busybox"}]
INIT = {"name": "agent", "image": "busybox", "restartPolicy": "Always"}

# The messages of the CRD's rules, in full: a refusal must say exactly this.
NAME_MSG = ("metadata.name must start with a letter: the leader Service <name>-leader is named after it, and "
            "Service names (DNS-1035 labels) cannot start with a digit")
MARGIN_MSG = ("spec.timings.renewDeadline must be at least 500ms shorter than spec.timings.leaseDuration (margin "
              "for clock drift and jitter)")
JITTER_MSG = ("spec.timings.renewDeadline must be more than 1.2 times spec.timings.retryPeriod, so the leader can "
              "retry a failed renewal before the deadline")
DRAIN_MSG = ("spec.drain.timeout must be at least 2s shorter than spec.terminationGracePeriodSeconds, so the lock is "
             "released before the pod is killed")
DRAIN_ZERO_MSG = "spec.drain.timeout must be longer than 0s"
HOOK_PORT_MSG = "spec.drain.hookURL must have a port from 1 to 65535 (or none, for 80)"
HOOK_SELF_MSG = ("spec.drain.hookURL must not use the sidecar's own ports (spec.sidecar.port and the control port "
                 "spec.sidecar.port + 1; no port means 80): the sidecar would ask itself to drain instead of the app")
HOOK_URL_MSG = "spec.drain.hookURL must be a valid URL (no control characters; '%' only in escapes such as %2F)"
SIDECAR_PORT_MSG = ("spec.sidecar.port must be at most 65534: the sidecar's loopback control port is "
                    "spec.sidecar.port + 1")
PORT_CLASH_MSG = ("spec.sidecar.port and spec.sidecar.port + 1 (the sidecar's loopback control port) must differ "
                  "from every containerPort in spec.template.spec.containers and spec.template.spec.initContainers "
                  "(the sidecar shares the pod's network)")
IMAGE_MSG = ("spec.template.spec.{}[].image must not have leading or trailing whitespace (the API server refuses "
             "such pods)")
PORT_NAME_MSG = ("a containerPort name must be an IANA service name: at most 15 lower case letters, digits and '-', "
                 "with a letter, not starting or ending with '-', without '--'")
KEYS_MSG = ("{} keys must be qualified names: an optional DNS subdomain prefix of at most 253 characters and '/', "
            "then at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
LABEL_VALUE_MSG = ("spec.template.metadata.labels values must be empty or letters, digits, '-', '_' or '.', starting "
                   "and ending with a letter or digit")
TARGET_PORT_MSG = ("spec.service.ports[].targetPort must be a port number from 1 to 65535 or a port name (an IANA "
                   "service name: at most 15 lower case letters, digits and '-', with a letter, not starting or "
                   "ending with '-', without '--')")
NAMED_TARGET_MSG = ("a named spec.service.ports[].targetPort must be the name of a containerPort in "
                    "spec.template.spec.containers or initContainers (or singleton, the sidecar's port)")
CONTROL_TARGET_MSG = ("spec.service.ports[] must not send traffic to spec.sidecar.port + 1 (a targetPort, or the port "
                      "when targetPort is unset): the sidecar's control port listens on the pod's loopback only")
QUANTITY_MSG = "spec.sidecar.resources.{} values must be quantities of at least 0, such as 10m, 0.5, 64Mi or 1G"
SECRET_KEY_MSG = "spec.postgres.secretRef.key must not be '.' or start with '..' (not a valid Secret key)"


def timings(lease: str, renew: str, retry: str) -> dict[str, Any]:
    return {"spec.timings": {"leaseDuration": lease, "renewDeadline": renew, "retryPeriod": retry}}


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
    # timings, exactly: each a nanosecond past its rule, or a value the duration grammar refuses
    pytest.param(timings("4s", "2.401s", "2.0009s"), ["spec.timings.renewDeadline", JITTER_MSG],
                 id="timings-renew-1.2x-retry-in-ms-only"),
    pytest.param(timings("4s", "2.40108s", "2.0009s"), ["spec.timings.renewDeadline", JITTER_MSG],
                 id="timings-renew-exactly-1.2x-retry"),
    pytest.param(timings("700ms", "200.000001ms", "100ms"), ["spec.timings.renewDeadline", MARGIN_MSG],
                 id="timings-margin-1ns-short"),
    pytest.param(timings("1s", "300ms", "99.999999ms"),
                 ["spec.timings.retryPeriod", "spec.timings.retryPeriod must be at least 100ms"],
                 id="timings-retry-1ns-under-100ms"),
    pytest.param(timings("5m0.000000001s", "4s", "2s"),
                 ["spec.timings.leaseDuration", "spec.timings.leaseDuration must be at most 5m"],
                 id="timings-lease-1ns-over-5m"),
    pytest.param(timings("6000000us", "4s", "2s"), ["spec.timings.leaseDuration", "should match"],
                 id="duration-microseconds"),
    pytest.param(timings(".5s", "4s", "2s"), ["spec.timings.leaseDuration", "should match"], id="duration-leading-dot"),
    pytest.param(timings("1" * 31 + "ms", "4s", "2s"), ["spec.timings.leaseDuration", "Too long"],
                 id="duration-33-chars"),
    pytest.param(timings("2562048h", "4s", "2s"),
                 ["spec.timings", "evaluating rule: spec.timings.leaseDuration must be at most 5m"],
                 id="duration-beyond-int64-nanoseconds"),
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
        {"spec.backend": "postgres", "spec.postgres": {"mode": "transaction", "secretRef": {"name": "db"}}},
        ["spec.postgres.mode", "Unsupported value"],
        id="postgres-mode-transaction",
    ),
    pytest.param(
        {"spec.backend": "postgres", "spec.postgres": {"connectionCheck": "Warn", "secretRef": {"name": "db"}}},
        ["spec.postgres.connectionCheck", 'Unsupported value: "Warn"', '"block", "warn", "skip"'],
        id="postgres-connection-check-unknown",
    ),
    *(pytest.param({"spec.backend": "postgres", "spec.postgres": {"secretRef": {"name": "db", "key": key}}},
                   ["spec.postgres.secretRef.key", SECRET_KEY_MSG], id=f"secret-key-{key}")
      for key in (".", "..", "..dsn")),
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
    pytest.param({"spec.drain.timeout": "28.000000001s"}, ["spec.drain.timeout", DRAIN_MSG],
                 id="drain-1ns-over-grace-less-2s"),
    pytest.param({"spec.drain.timeout": "0s"}, ["spec.drain.timeout", DRAIN_ZERO_MSG], id="drain-0s"),
    pytest.param({"spec.drain.timeout": "0.0000000009s"}, ["spec.drain.timeout", DRAIN_ZERO_MSG],
                 id="drain-under-1ns-is-0"),
    pytest.param({"spec.terminationGracePeriodSeconds": 0}, ["spec.terminationGracePeriodSeconds"], id="grace-0"),
    pytest.param({"spec.terminationGracePeriodSeconds": 2, "spec.drain.timeout": "1ms"},
                 ["spec.drain.timeout", DRAIN_MSG], id="grace-2-leaves-no-drain"),
    pytest.param({"spec.drain.hookURL": "http://example.com/drain"}, ["spec.drain.hookURL"], id="hook-not-loopback"),
    pytest.param({"spec.drain.hookURL": "https://127.0.0.1/drain"}, ["spec.drain.hookURL"], id="hook-https"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:0/drain"}, ["spec.drain.hookURL", HOOK_PORT_MSG],
                 id="hook-port-0"),
    pytest.param({"spec.drain.hookURL": "http://[::1]:65536/drain"}, ["spec.drain.hookURL", HOOK_PORT_MSG],
                 id="hook-port-65536"),
    pytest.param({"spec.drain.hookURL": "http://localhost:99999"}, ["spec.drain.hookURL", HOOK_PORT_MSG],
                 id="hook-port-99999"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:7450/drain"}, ["spec.drain.hookURL", HOOK_SELF_MSG],
                 id="hook-on-sidecar-port"),
    pytest.param({"spec.drain.hookURL": "http://localhost:7451/drain"}, ["spec.drain.hookURL", HOOK_SELF_MSG],
                 id="hook-on-control-port"),
    pytest.param({"spec.drain.hookURL": "http://localhost/drain", "spec.sidecar": {"port": 79}},
                 ["spec.drain.hookURL", HOOK_SELF_MSG], id="hook-default-port-80-is-control-port"),
    pytest.param({"spec.drain.hookURL": "http://127.0.0.1:8000/%zz"}, ["spec.drain.hookURL", HOOK_URL_MSG],
                 id="hook-bad-escape"),
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
    pytest.param({"spec.template": DELETE}, ["set exactly one of spec.template", "spec.workloadRef"],
                 id="template-missing"),
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
        {"spec.template.spec.initContainers": [{"name": "init", "image": "x"}, {"name": "init", "image": "y"}]},
        ["spec.template.spec.initContainers", "container names in spec.template.spec.initContainers must be unique"],
        id="init-container-names-duplicate",
    ),
    pytest.param(
        {"spec.template.spec.initContainers": [{"name": "init"}]},
        ["spec.template.spec.initContainers[0].image", "Required value"],
        id="init-container-without-image",
    ),
    pytest.param(
        {"spec.template.spec.initContainers": [{"name": "init", "image": ""}]},
        ["spec.template.spec.initContainers[0].image"],
        id="init-container-empty-image",
    ),
    pytest.param({"spec.template.spec.containers.0.image": "busybox "},
                 ["spec.template.spec.containers[0].image", IMAGE_MSG.format("containers")],
                 id="container-image-trailing-space"),
    pytest.param({"spec.template.spec.containers.0.image": "\u3000busybox"},
                 ["spec.template.spec.containers[0].image", IMAGE_MSG.format("containers")],
                 id="container-image-leading-ideographic-space"),
    pytest.param({"spec.template.spec.initContainers": [{"name": "init", "image": "\tbusybox"}]},
                 ["spec.template.spec.initContainers[0].image", IMAGE_MSG.format("initContainers")],
                 id="init-container-image-leading-tab"),
    pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 8080, "name": "8080"}]},
                 ["spec.template.spec.containers[0].ports[0].name", PORT_NAME_MSG], id="port-name-without-letter"),
    pytest.param({"spec.template.spec.initContainers": [{**INIT, "ports": [{"containerPort": 8080, "name": "a--b"}]}]},
                 ["spec.template.spec.initContainers[0].ports[0].name", PORT_NAME_MSG], id="port-name-double-dash"),
    pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 8080, "name": "a" * 16}]},
                 ["spec.template.spec.containers[0].ports[0].name", "Too long"], id="port-name-16-chars"),
    pytest.param(
        {"spec.template.spec.volumes": [{"name": "singleton-gate", "emptyDir": {}}]},
        ["spec.template.spec.volumes[0].name",
         "the volume name singleton-gate in spec.template.spec.volumes is reserved for the operator's file-gate "
         "volume"],
        id="volume-name-reserved",
    ),
    pytest.param(
        {**FILE_GATE, "spec.template.spec.volumes": [{"name": "d", "emptyDir": {}}],
         "spec.template.spec.containers.0.volumeMounts": [{"name": "d", "mountPath": "/var/run/singleton"}]},
        ["spec.gating.mode", "spec.gating.mode file mounts the gate folder at /var/run/singleton in the main "
                             "container, so its volumeMounts must not use that mountPath"],
        id="file-gate-mount-path-taken",
    ),
    pytest.param(
        {"spec.template.spec.terminationGracePeriodSeconds": 60},
        ["spec.template.spec.terminationGracePeriodSeconds",
         "spec.template.spec.terminationGracePeriodSeconds is not used: set spec.terminationGracePeriodSeconds, "
         "which the operator gives the pods and checks against spec.drain.timeout"],
        id="template-grace-period",
    ),
    pytest.param({"spec.template.metadata": {"labels": {"app": "a" * 64}}},
                 ["spec.template.metadata.labels.app", "Too long"], id="label-value-64-chars"),
    pytest.param({"spec.template.metadata": {"labels": {"app": "-poller"}}},
                 ["spec.template.metadata.labels", LABEL_VALUE_MSG], id="label-value-leading-dash"),
    pytest.param({"spec.template.metadata": {"labels": {"my app": "x"}}},
                 ["spec.template.metadata.labels", KEYS_MSG.format("spec.template.metadata.labels")],
                 id="label-key-with-space"),
    pytest.param({"spec.template.metadata": {"labels": {"k" * 64: "x"}}},
                 ["spec.template.metadata.labels", KEYS_MSG.format("spec.template.metadata.labels")],
                 id="label-key-name-64-chars"),
    pytest.param({"spec.template.metadata": {"labels": {"a" * 254 + "/b": "x"}}},
                 ["spec.template.metadata.labels", KEYS_MSG.format("spec.template.metadata.labels")],
                 id="label-key-prefix-254-chars"),
    pytest.param({"spec.template.metadata": {"annotations": {"a/b/c": "x"}}},
                 ["spec.template.metadata.annotations", KEYS_MSG.format("spec.template.metadata.annotations")],
                 id="annotation-key-two-slashes"),
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
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 0}]}},
                 ["spec.service.ports[0].targetPort", TARGET_PORT_MSG], id="target-port-0"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 65536}]}},
                 ["spec.service.ports[0].targetPort", TARGET_PORT_MSG], id="target-port-65536"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": "8080"}]}},
                 ["spec.service.ports[0].targetPort", TARGET_PORT_MSG], id="target-port-digits-as-string"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": "web"}]}},
                 ["spec.service.ports", NAMED_TARGET_MSG], id="target-port-name-undeclared"),
    pytest.param({"spec.service": {"ports": [{"port": 80, "targetPort": 7451}]}},
                 ["spec.service.ports", CONTROL_TARGET_MSG], id="target-port-is-control-port"),
    pytest.param({"spec.service": {"ports": [{"port": 7451}]}},
                 ["spec.service.ports", CONTROL_TARGET_MSG], id="service-port-is-control-port"),
    pytest.param({"spec.service": {"ports": [{"port": 80}], "annotations": {"-lb": "x"}}},
                 ["spec.service.annotations", KEYS_MSG.format("spec.service.annotations")],
                 id="service-annotation-key-invalid"),
    # sidecar and PDB
    pytest.param({"spec.sidecar": {"port": 0}}, ["spec.sidecar.port"], id="sidecar-port-0"),
    pytest.param({"spec.sidecar": {"port": 65536}}, ["spec.sidecar.port"], id="sidecar-port-65536"),
    pytest.param({"spec.sidecar": {"port": 65535}}, ["spec.sidecar.port", SIDECAR_PORT_MSG], id="sidecar-port-65535"),
    pytest.param(
        {"spec.template.spec.containers.0.ports": [{"containerPort": 80}, {"containerPort": 7450}]},
        ["spec.sidecar.port", PORT_CLASH_MSG],
        id="sidecar-port-clashes-with-container",
    ),
    pytest.param({"spec.template.spec.containers.0.ports": [{"containerPort": 7451}]},
                 ["spec.sidecar.port", PORT_CLASH_MSG], id="control-port-clashes-with-container"),
    pytest.param({"spec.template.spec.initContainers": [{**INIT, "ports": [{"containerPort": 7450}]}]},
                 ["spec.sidecar.port", PORT_CLASH_MSG], id="sidecar-port-clashes-with-init-container"),
    pytest.param({"spec.sidecar": {"port": 8000},
                  "spec.template.spec.initContainers": [{**INIT, "ports": [{"containerPort": 8001}]}]},
                 ["spec.sidecar.port", PORT_CLASH_MSG], id="control-port-clashes-with-init-container"),
    pytest.param({"spec.sidecar": {"image": "ghcr.io/acme/sidecar:1 "}},
                 ["spec.sidecar.image", "spec.sidecar.image must not have leading or trailing whitespace (the API "
                                        "server refuses such pods)"], id="sidecar-image-trailing-space"),
    pytest.param({"spec.sidecar": {"resources": {"requests": {"cpu": "lots"}}}},
                 ["spec.sidecar.resources.requests[cpu]", QUANTITY_MSG.format("requests")], id="request-not-quantity"),
    pytest.param({"spec.sidecar": {"resources": {"requests": {"memory": "-64Mi"}}}},
                 ["spec.sidecar.resources.requests[memory]", QUANTITY_MSG.format("requests")], id="request-negative"),
    pytest.param({"spec.sidecar": {"resources": {"limits": {"memory": "64 Mi"}}}},
                 ["spec.sidecar.resources.limits[memory]", QUANTITY_MSG.format("limits")], id="limit-not-quantity"),
    pytest.param({"spec.sidecar": {"resources": {"requests": {"memory": "129Mi"}, "limits": {"memory": "128Mi"}}}},
                 ["spec.sidecar.resources.requests",
                  "spec.sidecar.resources.requests must not exceed spec.sidecar.resources.limits"],
                 id="request-over-limit"),
    pytest.param({"spec.sidecar": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
                 ["spec.sidecar.resources.limits",
                  "spec.sidecar.resources.limits may only name cpu, memory and ephemeral-storage"],
                 id="sidecar-resource-not-allowed"),
    pytest.param({"spec.sidecar": {"resources": {"claims": [{"name": "gpu"}]}}},
                 ['unknown field "spec.sidecar.resources.claims"'], id="sidecar-resource-claims"),
    pytest.param({"spec.sidecar": {"logLevel": "trace"}}, ["spec.sidecar.logLevel", "Unsupported"], id="log-level-bad"),
    pytest.param({"spec.sidecar": {"startOrder": "last"}}, ["spec.sidecar.startOrder", "Unsupported"],
                 id="start-order-bad"),
    pytest.param({"spec.podDisruptionBudget": {"enabled": "yes"}}, ["spec.podDisruptionBudget.enabled"], id="pdb-str"),
    # metadata.name and unknown fields
    pytest.param({"metadata.name": "a" * 53}, ["metadata.name", "at most 52"], id="name-53-chars"),
    pytest.param({"metadata.name": "feed.poller"}, ["metadata.name", "DNS-1123 label"], id="name-with-dot"),
    pytest.param({"metadata.name": "1st-poller"}, ["metadata", NAME_MSG], id="name-starting-with-digit"),
    pytest.param({"metadata.name": "9"}, ["metadata", NAME_MSG], id="name-of-1-digit"),
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
    assert len(set(ids)) == len(ids) >= 100
    valid_ids = [p.id for p in VALID]
    assert len(set(valid_ids)) == len(valid_ids) >= 40


# --- admission and the operator agree ----------------------------------------------------------

MS = 1_000_000
SECOND = 1_000_000_000


def _spell(nanoseconds: int, rng: random.Random) -> str:
    """One of the spellings the CRD admits for a duration of ``nanoseconds`` (one of them with a
    digit past the nanosecond, which both readers must drop)."""
    seconds, rest = divmod(nanoseconds, SECOND)
    fraction = f"{rest:09d}".rstrip("0")
    form = rng.randrange(4)
    if form == 0:
        return f"{seconds}.{fraction}s" if fraction else f"{seconds}s"
    if form == 1:
        millis, sub = divmod(nanoseconds, MS)
        sub_text = f"{sub:06d}".rstrip("0")
        return f"{millis}.{sub_text}ms" if sub_text else f"{millis}ms"
    if form == 2:
        minutes, rest_seconds = divmod(seconds, 60)
        tail = f"{rest_seconds}.{fraction}s" if fraction else f"{rest_seconds}s"
        return f"{minutes}m{tail}" if minutes else tail
    return f"{seconds}.{rest:09d}{rng.randrange(1, 10)}s"


def duration_boundary_cases() -> list[tuple[str, dict[str, Any]]]:
    """Edits of ``minimal()`` that put durations within a nanosecond or a millisecond of every
    duration rule, spelt in the ways the CRD admits (seeded: the same cases every run). Some
    break a rule, some do not; admission and read_spec must agree on which."""
    rng = random.Random(13)
    deltas = (-MS - 1, -1, 0, 1, MS + 1)
    cases: list[tuple[str, dict[str, Any]]] = []

    def add(rule: str, lease: int, renew: int, retry: int) -> None:
        spelt = (_spell(lease, rng), _spell(renew, rng), _spell(retry, rng))
        cases.append((f"{rule}: {'/'.join(spelt)}", timings(*spelt)))

    for delta in deltas:
        lease = rng.randrange(700 * MS, 300 * SECOND)  # lease - renew == 500ms + delta
        add("margin", lease, lease - 500 * MS - delta, 100 * MS)
        retry = 5 * rng.randrange(20 * MS, 2 * SECOND)  # renew == 1.2 x retry + delta
        add("1.2x", retry // 5 * 6 + delta + SECOND, retry // 5 * 6 + delta, retry)
        add("retry >= 100ms", 2 * SECOND, SECOND, 100 * MS + delta)
        add("lease <= 5m", 300 * SECOND + delta, 240 * SECOND, 60 * SECOND)
        grace = rng.randrange(3, 600)  # drain + 2s == grace + delta
        drain = _spell((grace - 2) * SECOND + delta, rng)
        cases.append((f"drain: {drain} with grace {grace}",
                      {"spec.drain.timeout": drain, "spec.terminationGracePeriodSeconds": grace}))
    for drain in ("0s", "0.0000000009s", "0.000000001s", "0.000000001999s"):
        cases.append((f"drain > 0: {drain}", {"spec.drain.timeout": drain}))
    return cases


def _operator_verdict(obj: Obj, namespace: str) -> str | None:
    """None when the operator's read_spec accepts the object, else its error."""
    body = {**obj, "metadata": {**obj["metadata"], "namespace": namespace, "uid": "u-1"}}
    try:
        read_spec(body, default_sidecar_image="registry.example/singleton:1")
    except SpecError as exc:
        return str(exc)
    return None


def test_admission_and_the_operator_agree_near_every_duration_rule(cluster: Cluster, ns: str) -> None:
    """Both read the same strings to the same nanoseconds and apply the same rules: on every
    case, the API server admits the object exactly when read_spec accepts it."""
    disagreements, admitted = [], []
    for label, edits in duration_boundary_cases():
        obj = edited(minimal("agree-" + secrets.token_hex(4)), edits)
        result = cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input_text=json.dumps(obj),
                                 check=False)
        refusal = _operator_verdict(obj, ns)
        admitted.append(result.returncode == 0)
        if (result.returncode == 0) != (refusal is None):
            disagreements.append(f"{label}: API server {'admits' if result.returncode == 0 else result.stderr}, "
                                 f"read_spec {'accepts' if refusal is None else refusal}")
    assert disagreements == []
    assert admitted.count(True) >= 10 and admitted.count(False) >= 10  # both sides of every boundary were tried


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
    pytest.param({"spec": {"sidecar": {"port": 65535}}}, "spec.sidecar.port", id="sidecar-port-65535"),
    pytest.param({"spec": {"drain": {"hookURL": "http://127.0.0.1:7451/drain"}}}, "spec.drain.hookURL",
                 id="hook-on-control-port"),
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
    for condition_type in ("Available", "LeaderElected", "Progressing", "Degraded", "DatabaseReachable"):
        assert condition_type in conditions
    postgres = _explain(cluster, "sgl.spec.postgres")
    assert "Secret" in postgres
    assert "secretRef" in postgres
    assert "connectionCheck\t<string>" in postgres, postgres


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
