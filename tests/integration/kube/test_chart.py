"""The Helm chart (charts/singleton): lint, rendering, the values schema, the image it points
at (the Dockerfile's), the CRD copy, and install / upgrade / uninstall on the real API server.

The test bed's helm is built from Go modules without helm's release ldflags, so it assumes
Kubernetes v1.20 when no cluster is asked; ``helm template`` therefore always gets
``--kube-version`` (``helm install`` and ``upgrade`` ask the API server).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from singleton_testbed.binaries import pinned_versions
from singleton_testbed.controlplane import wait_established
from singleton_testbed.harness.kubehelpers import get_json
from tests.conftest import CRD_PATH, Cluster, use_existing_cluster
from tests.support import chart_objects
from tests.support.paths import REPO_ROOT

CHART = REPO_ROOT / "charts" / "singleton"
CHART_CRD = CHART / "crds" / CRD_PATH.name
KUBE_VERSION = "1.34.0"

Obj = dict[str, Any]

STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


def chart_meta() -> Obj:
    meta: Obj = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return meta


def helm(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["helm", *args], capture_output=True, text=True, env=env, check=False, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def values_args(values: Obj | None, tmp_path: Path) -> list[str]:
    if not values:
        return []
    path = tmp_path / f"values-{secrets.token_hex(4)}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def template(tmp_path: Path, values: Obj | None = None, *extra: str, release: str = "demo",
             namespace: str = "singleton-system", check: bool = True) -> subprocess.CompletedProcess[str]:
    return helm("template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
                *values_args(values, tmp_path), *extra, check=check)


def render(tmp_path: Path, values: Obj | None = None, *extra: str, release: str = "demo",
           namespace: str = "singleton-system") -> list[Obj]:
    out = template(tmp_path, values, *extra, release=release, namespace=namespace).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[Obj], kind: str) -> Obj:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_container(objects: list[Obj]) -> Obj:
    containers: list[Obj] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


# --- files: the CRD copy, the image ----------------------------------------------------------


def test_chart_crd_is_identical_to_the_source_of_truth() -> None:
    assert CHART_CRD.read_bytes() == CRD_PATH.read_bytes(), (
        f"{CHART_CRD.relative_to(REPO_ROOT)} differs from {CRD_PATH.relative_to(REPO_ROOT)}: run `make chart-crds`"
    )
    assert sorted(p.name for p in CHART_CRD.parent.iterdir()) == [CRD_PATH.name]


def dockerfile_labels(text: str) -> dict[str, str]:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[\w.]+)="([^"]*)"', text))
    return {k: re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], v) for k, v in labels.items()}


def test_default_image_is_the_dockerfiles_image_and_the_package_version() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    meta = chart_meta()
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    labels = dockerfile_labels((REPO_ROOT / "Dockerfile").read_text())
    assert meta["appVersion"] == meta["version"] == version == labels["org.opencontainers.image.version"]
    assert values["image"]["tag"] == "", "the tag must default to the chart's appVersion"
    # ghcr.io/<owner>/<name> is built from github.com/<owner>/<name>
    registry, owner, name = values["image"]["repository"].split("/")
    assert registry == "ghcr.io"
    assert labels["org.opencontainers.image.source"] == f"https://github.com/{owner}/{name}"
    assert labels["org.opencontainers.image.title"] == name
    makefile = (REPO_ROOT / "Makefile").read_text()
    image = re.search(r"^IMAGE \?= (\S+)$", makefile, flags=re.MULTILINE)
    tag = re.search(r"^IMAGE_TAG \?= (\S+)$", makefile, flags=re.MULTILINE)
    assert image is not None and tag is not None
    assert (image.group(1), tag.group(1)) == (values["image"]["repository"], version)
    # the operator's own default for the injected sidecar is the same image
    from singleton_operator.cli import DEFAULT_SIDECAR_IMAGE
    assert f"{values['image']['repository']}:{version}" == DEFAULT_SIDECAR_IMAGE


def test_dockerfile_is_multi_stage_non_root_without_entrypoint() -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line and not line[0].isspace()
                    and not line.startswith(("#", "&&"))]
    froms = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert froms == ["python:3.11-slim-bookworm", "python:3.11-slim-bookworm"]
    assert "ENTRYPOINT" not in instructions and "CMD" not in instructions
    final = text.split("\nFROM ")[-1]
    assert "COPY --from=builder /opt/singleton /opt/singleton" in final
    assert re.search(r"^USER 10001(:10001)?$", final, flags=re.MULTILINE)
    assert "PYTHONDONTWRITEBYTECODE=1" in final
    lock = (REPO_ROOT / "requirements.lock").read_text()
    pins = [line for line in lock.splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][\w.]*", p) for p in pins), pins
    pinned = {p.split("==")[0].lower().replace("_", "-") for p in pins}
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # The SDK is built from sdk/ in the image (not a wheel from an index), so it is not pinned.
    in_repository = tomllib.loads((REPO_ROOT / "sdk" / "pyproject.toml").read_text())["project"]["name"]
    assert "COPY sdk/ sdk/" in text
    for dep in deps:
        name = re.split(r"[<>=!~ ;\[]", dep)[0].lower()
        assert name in pinned or name == in_repository, dep


# --- lint and rendering ----------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., None])


def needs_helm(test: F) -> F:
    """helm is one of the test bed's binaries (on PATH through ``testbed_binaries``)."""
    marked: F = pytest.mark.k8s(pytest.mark.usefixtures("testbed_binaries")(test))
    return marked


@needs_helm
def test_helm_lint_strict() -> None:
    result = helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@needs_helm
def test_default_render(tmp_path: Path) -> None:
    objects = render(tmp_path)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Deployment",
        "PodDisruptionBudget", "Service", "Service", "NetworkPolicy", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration",
    ])
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert all(labels.get(k) for k in STANDARD_LABELS), (obj["kind"], labels)
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/version"] == chart_meta()["appVersion"]
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                               "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration"):
            assert obj["metadata"]["namespace"] == "singleton-system", obj["kind"]

    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "demo-singleton-operator"
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert set(deployment["spec"]["selector"]["matchLabels"].items()) <= set(pod["metadata"]["labels"].items())
    container = operator_container(objects)
    assert container["image"] == f"ghcr.io/singleton-dev/singleton:{chart_meta()['appVersion']}"
    assert container["command"] == ["singleton-operator", "run"]
    assert container["args"] == ["--health-listen=0.0.0.0:8080", "--webhook-listen=0.0.0.0:9443",
                                 "--webhook-service=demo-singleton-operator-webhook",
                                 "--webhook-secret=demo-singleton-operator-webhook-tls",
                                 "--webhook-config=demo-singleton-operator"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SINGLETON_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["SINGLETON_OPERATOR_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["SINGLETON_SIDECAR_IMAGE"]["value"] == container["image"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                                  {"name": "webhook", "containerPort": 9443, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["spec"]["volumes"][0]["name"] == "tmp" and "emptyDir" in pod["spec"]["volumes"][0]
    assert pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pod["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert pod["spec"]["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]

    assert one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    service = named(objects, "Service", "demo-singleton-operator-metrics")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    assert set(service["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
    role = one(objects, "Role")
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["singleton-operator"],
            "verbs": ["get", "list", "watch", "update"]} in role["rules"]
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-singleton-operator",
                                        "namespace": "singleton-system"}]
    policy = one(objects, "ValidatingAdmissionPolicy")
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    binding = one(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in by_kind(objects, kind) if o["metadata"]["name"] == name)


@needs_helm
def test_the_pod_webhook_renders_scoped_and_fail_closed(tmp_path: Path) -> None:
    objects = render(tmp_path)
    hook = one(objects, "MutatingWebhookConfiguration")["webhooks"][0]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["rules"][0]["operations"]) == ("Fail", "None", ["CREATE"])
    assert hook["objectSelector"]["matchExpressions"] == [
        {"key": "singleton.dev/group", "operator": "Exists"},
        {"key": "app.kubernetes.io/managed-by", "operator": "NotIn", "values": ["singleton-operator"]}]
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "kube-system", "kube-public", "kube-node-lease", "singleton-system"]
    assert hook["clientConfig"]["service"] == {"name": "demo-singleton-operator-webhook",
                                               "namespace": "singleton-system", "path": "/mutate-pods", "port": 443}
    service = named(objects, "Service", "demo-singleton-operator-webhook")
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    role = one(objects, "Role")
    assert {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["demo-singleton-operator-webhook-tls"],
            "verbs": ["get", "update"]} in role["rules"]
    rules = named(objects, "ClusterRole", "demo-singleton-operator")["rules"]
    assert {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
            "resourceNames": ["demo-singleton-operator"], "verbs": ["get", "patch"]} in rules
    policy = one(objects, "NetworkPolicy")
    assert {"ports": [{"port": 9443, "protocol": "TCP"}]} in policy["spec"]["ingress"]
    # Narrowed by the user, on top of the namespaces always left out.
    narrowed = render(tmp_path, {"webhook": {"namespaceSelector": {"matchLabels": {"singleton.dev/adoption": "on"}}}})
    selector = one(narrowed, "MutatingWebhookConfiguration")["webhooks"][0]["namespaceSelector"]
    assert selector["matchLabels"] == {"singleton.dev/adoption": "on"}
    assert len(selector["matchExpressions"]) == 1
    # cert-manager makes the certificate; the operator reads its files and keeps no caBundle.
    managed = render(tmp_path, {"webhook": {"certManager": {"enabled": True}}})
    assert sorted(o["metadata"]["name"] for o in by_kind(managed, "Certificate")) == [
        "demo-singleton-operator-webhook", "demo-singleton-operator-webhook-ca"]
    configuration = one(managed, "MutatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "singleton-system/demo-singleton-operator-webhook"}
    args = operator_container(managed)["args"]
    assert "--webhook-cert-dir=/var/run/singleton-webhook" in args
    assert not any(a.startswith(("--webhook-secret", "--webhook-config")) for a in args)
    assert not any(r.get("resources") == ["secrets"] and "update" in r["verbs"] for r in one(managed, "Role")["rules"])
    certificate = named(managed, "Certificate", "demo-singleton-operator-webhook")
    assert "demo-singleton-operator-webhook.singleton-system.svc" in certificate["spec"]["dnsNames"]
    issuer = {"name": "corp-ca", "kind": "ClusterIssuer"}
    own_issuer = render(tmp_path, {"webhook": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert [o["metadata"]["name"] for o in by_kind(own_issuer, "Certificate")] == ["demo-singleton-operator-webhook"]
    assert by_kind(own_issuer, "Issuer") == []
    assert one(own_issuer, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    # An external issuer (its own API group) keeps its group.
    external = {"name": "pca", "kind": "AWSPCAClusterIssuer", "group": "awspca.cert-manager.io"}
    external_issuer = render(tmp_path, {"webhook": {"certManager": {"enabled": True, "issuerRef": external}}})
    assert one(external_issuer, "Certificate")["spec"]["issuerRef"] == external
    # A kind without a name would quietly fall back to the chart's own CA: refused.
    with pytest.raises(AssertionError, match="'name' required, if 'kind' exists"):
        render(tmp_path, {"webhook": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}})
    # Off: no webhook, no flags, no port.
    off = render(tmp_path, {"webhook": {"enabled": False}})
    assert by_kind(off, "MutatingWebhookConfiguration") == []
    assert operator_container(off)["args"] == ["--health-listen=0.0.0.0:8080"]


@needs_helm
def test_the_webhook_port_host_network_and_failure_policy_values_reach_every_object(tmp_path: Path) -> None:
    defaults = render(tmp_path)
    pod = one(defaults, "Deployment")["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert one(defaults, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    objects = render(tmp_path, {"webhook": {"port": 10443, "hostNetwork": True, "failurePolicy": "Ignore"},
                                "healthPort": 10280})
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    # The node's ports: no two operator pods on one node, so no surge pod during a rollout.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    container = operator_container(objects)
    assert container["args"][:2] == ["--health-listen=0.0.0.0:10280", "--webhook-listen=0.0.0.0:10443"]
    assert container["ports"] == [{"name": "http", "containerPort": 10280, "protocol": "TCP"},
                                  {"name": "webhook", "containerPort": 10443, "protocol": "TCP"}]
    # The Services reach the ports by name; the API server still calls the webhook Service on 443.
    assert named(objects, "Service", "demo-singleton-operator-webhook")["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    assert named(objects, "Service", "demo-singleton-operator-metrics")["spec"]["ports"][0]["targetPort"] == "http"
    hook = one(objects, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["clientConfig"]["service"]["port"] == 443
    assert [rule["ports"] for rule in one(objects, "NetworkPolicy")["spec"]["ingress"]] == [
        [{"port": 10280, "protocol": "TCP"}], [{"port": 10443, "protocol": "TCP"}]]
    # hostNetwork is for the webhook: without it, the pods stay on the pod network.
    off = one(render(tmp_path, {"webhook": {"enabled": False, "hostNetwork": True}}), "Deployment")
    assert "hostNetwork" not in off["spec"]["template"]["spec"]
    # One port for both would fail at start (address in use): refused at render, saying why.
    clash = template(tmp_path, {"webhook": {"port": 8080}}, check=False)
    assert clash.returncode != 0
    assert "webhook.port and healthPort are both 8080: the operator serves the webhook and its health checks on " \
        "two ports" in clash.stderr, clash.stderr


@needs_helm
def test_the_readme_objects_table_is_what_the_chart_renders() -> None:
    text = chart_objects.README.read_text()
    rows = chart_objects.expected_rows(text, "helm")
    assert chart_objects.read_table(text) == rows, (
        "charts/singleton/README.md's objects table differs from helm template: run "
        "`.venv/bin/python -m tests.support.chart_objects --write` and write the notes of new rows")
    assert [row for row in rows if row.notes == chart_objects.TODO] == []
    # What the README owes its readers most: the cluster-wide webhook, installed by default.
    assert chart_objects.Row("MutatingWebhookConfiguration", "<fullname>-operator", "cluster", "default",
                             rows[[r.kind for r in rows].index("MutatingWebhookConfiguration")].notes) in rows
    assert ("PrometheusRule", "with `monitoring.prometheusRule.enabled`") in {(r.kind, r.installed) for r in rows}
    # A row the chart no longer renders, or one missing, is a difference.
    edited = text.replace("| Issuer | `<fullname>-operator-selfsigned` |", "| Issuer | `<fullname>-operator-gone` |")
    assert chart_objects.read_table(edited) != chart_objects.expected_rows(edited, "helm")


def render_notes(tmp_path: Path, values: Obj | None = None) -> str:
    """NOTES.txt as ``helm install`` prints it, without a cluster: a copy of the chart renders it
    with ``tpl`` into a ConfigMap (``helm template`` leaves NOTES out)."""
    copy = tmp_path / f"chart-{secrets.token_hex(4)}"
    shutil.copytree(CHART, copy)
    (copy / "templates" / "NOTES.txt").rename(copy / "notes.txt")
    (copy / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data: {notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}}\n')
    out = helm("template", "demo", str(copy), "--namespace", "singleton-system", "--kube-version", KUBE_VERSION,
               "--show-only", "templates/notes.yaml", *values_args(values, tmp_path)).stdout
    notes: str = yaml.safe_load(out)["data"]["notes"]
    return notes


@needs_helm
def test_notes_say_the_webhook_is_installed_and_its_failure_policy(tmp_path: Path) -> None:
    notes = render_notes(tmp_path)
    assert ("Pod webhook: MutatingWebhookConfiguration demo-singleton-operator (cluster-wide, webhook "
            "pods.singleton.dev, failurePolicy Fail)") in notes, notes
    assert "While no operator replica answers, such pods are refused (their controller retries)" in notes
    assert "Served by the operator pods on port 9443, through Service demo-singleton-operator-webhook." in notes
    ignoring = render_notes(tmp_path, {"webhook": {"failurePolicy": "Ignore", "hostNetwork": True, "port": 10443}})
    assert "failurePolicy Ignore)" in ignoring
    assert "such pods start WITHOUT the sidecar and act beside the leader" in ignoring
    assert "refused" not in ignoring
    assert "on port 10443, on their nodes' network (hostNetwork)" in ignoring
    assert "Pod webhook" not in render_notes(tmp_path, {"webhook": {"enabled": False}})


@needs_helm
def test_release_named_singleton_gives_the_documented_names(tmp_path: Path) -> None:
    objects = render(tmp_path, release="singleton")
    assert one(objects, "Deployment")["metadata"]["name"] == "singleton-operator"
    assert one(objects, "ServiceAccount")["metadata"]["name"] == "singleton-operator"
    assert sorted(o["metadata"]["name"] for o in by_kind(objects, "Service")) == [
        "singleton-operator-metrics", "singleton-operator-webhook"]


@needs_helm
def test_values_change_the_render(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(tmp_path, {
        "replicaCount": 1,
        "watchNamespaces": ["team-a", "team-b"],
        "image": {"repository": "registry.example/singleton", "tag": "9.9.9"},
        "sidecarImage": "registry.example/sidecar:1",
        "admissionPolicy": {"namespaceSelector": {"matchLabels": {"singleton": "on"}},
                            "validationActions": ["Warn", "Audit"]},
        "metrics": {"service": {"port": 9100}},
        "networkPolicy": {"enabled": False},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "commonLabels": {"team": "platform"},
    })
    assert not by_kind(objects, "PodDisruptionBudget"), "no PDB for a single replica"
    assert not by_kind(objects, "NetworkPolicy")
    assert all(o["metadata"]["labels"]["team"] == "platform" for o in objects)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    container = operator_container(objects)
    assert container["args"][0] == "--health-listen=0.0.0.0:8080"
    assert [a for a in container["args"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert container["image"] == "registry.example/singleton:9.9.9"
    assert {e["name"]: e.get("value") for e in container["env"]}["SINGLETON_SIDECAR_IMAGE"] == \
        "registry.example/sidecar:1"
    assert named(objects, "Service", "demo-singleton-operator-metrics")["spec"]["ports"][0]["port"] == 9100
    binding = one(objects, "ValidatingAdmissionPolicyBinding")["spec"]
    assert binding["validationActions"] == ["Warn", "Audit"]
    assert binding["matchResources"] == {"namespaceSelector": {"matchLabels": {"singleton": "on"}}}

    pulls = operator_container(render(tmp_path, {"sidecarImagePullPolicy": "Always",
                                                 "sidecarImagePullSecrets": ["regcred", "mirror.example"]}))
    pull_env = {e["name"]: e.get("value") for e in pulls["env"]}
    assert (pull_env["SINGLETON_SIDECAR_IMAGE_PULL_POLICY"], pull_env["SINGLETON_SIDECAR_IMAGE_PULL_SECRETS"]) == (
        "Always", "regcred,mirror.example")
    assert not {"SINGLETON_SIDECAR_IMAGE_PULL_POLICY", "SINGLETON_SIDECAR_IMAGE_PULL_SECRETS"} & {
        e["name"] for e in container["env"]}, "unset by default"
    assert len(by_kind(render(tmp_path, {"rbac": {"aggregateToDefaultRoles": False}}), "ClusterRole")) == 1

    by_digest = operator_container(render(tmp_path, {"image": {"digest": digest}}))
    assert by_digest["image"] == f"ghcr.io/singleton-dev/singleton@{digest}"


@needs_helm
def test_service_monitor_only_when_the_api_exists_or_forced(tmp_path: Path) -> None:
    assert not by_kind(render(tmp_path), "ServiceMonitor")
    failed = template(tmp_path, {"serviceMonitor": {"enabled": True}}, check=False)
    assert failed.returncode != 0
    assert "no monitoring.coreos.com/v1 ServiceMonitor" in failed.stderr
    for extra, values in (
        (["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"], {"serviceMonitor": {"enabled": True}}),
        ([], {"serviceMonitor": {"enabled": True, "force": True, "interval": "15s"}}),
    ):
        monitor = one(render(tmp_path, values, *extra), "ServiceMonitor")
        endpoint = monitor["spec"]["endpoints"][0]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        assert endpoint["honorLabels"] is True  # the per-group series keep the group's namespace
        assert endpoint["interval"] == values["serviceMonitor"].get("interval", "30s")
        service = named(render(tmp_path, values, *extra), "Service", "demo-singleton-operator-metrics")
        assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())


@needs_helm
def test_sidecar_pod_monitor_and_alerts_only_when_the_api_exists_or_forced(tmp_path: Path) -> None:
    from singleton_election import contract
    from singleton_operator.model import resources
    from singleton_operator.model.spec import SIDECAR_CONTAINER, SIDECAR_PORT_NAME, read_spec

    assert not by_kind(render(tmp_path), "PodMonitor") and not by_kind(render(tmp_path), "PrometheusRule")
    for kind, key in (("PodMonitor", "podMonitor"), ("PrometheusRule", "prometheusRule")):
        failed = template(tmp_path, {"monitoring": {key: {"enabled": True}}}, check=False)
        assert failed.returncode != 0
        assert f"monitoring.{key}.enabled=true but the cluster serves no monitoring.coreos.com/v1 {kind}" \
            in failed.stderr, failed.stderr
    apis = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor",
            "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
    values = {"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}},
                             "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus"}}}}
    objects = render(tmp_path, values, *apis)
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    # The label the operator and its webhook put on every member pod, the sidecar's port.
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": contract.LABEL_GROUP, "operator": "Exists"}]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": SIDECAR_PORT_NAME, "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    # The pod template the operator builds (and the webhook injects) matches it: the label, and
    # the sidecar's port by that name is the one it serves /metrics on.
    spec = read_spec({"metadata": {"name": "feed", "namespace": "feeds", "uid": "u-1", "generation": 1},
                      "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "app:1"}]}}}},
                     default_sidecar_image="sidecar:1")
    pod = resources.pod_template(spec)
    assert contract.LABEL_GROUP in pod["metadata"]["labels"]
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_CONTAINER]
    (port,) = [p["containerPort"] for p in sidecar["ports"] if p["name"] == SIDECAR_PORT_NAME]
    assert {"name": contract.ENV_LISTEN, "value": f"0.0.0.0:{port}"} in sidecar["env"]
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert "SingletonStuckLock" in {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
    scoped = {"monitoring": {"podMonitor": {"enabled": True, "force": True,
                                            "namespaceSelector": {"matchNames": ["feeds"]}}}}
    assert one(render(tmp_path, scoped), "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["feeds"]}


@needs_helm
def test_dashboard_config_map_only_when_enabled(tmp_path: Path) -> None:
    assert not [o for o in by_kind(render(tmp_path), "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    objects = render(tmp_path, {"monitoring": {"dashboard": {"enabled": True, "namespace": "grafana"}}})
    config_map = named(objects, "ConfigMap", "demo-singleton-operator-dashboard")
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["singleton.json"])
    assert shipped == json.loads((CHART / "dashboards" / "singleton.json").read_text())


@needs_helm
def test_the_chart_installs_on_the_supported_kubernetes_versions_only(tmp_path: Path) -> None:
    """kubeVersion >= 1.34 (the oldest version the test bed runs, docs/upgrades.md): the admission
    policy is always admissionregistration.k8s.io/v1 there."""
    oldest = [d for d in yaml.safe_load_all(template(tmp_path, None, "--kube-version", "1.34.0").stdout)
              if d and d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert [d["apiVersion"] for d in oldest] == ["admissionregistration.k8s.io/v1"] * 2
    assert "ValidatingAdmissionPolicy" not in template(tmp_path, {"admissionPolicy": {"enabled": False}}).stdout
    too_old = template(tmp_path, None, "--kube-version", "1.33.9", check=False)
    assert too_old.returncode != 0 and "kubeVersion" in too_old.stderr
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=" + pinned_versions()["KUBERNETES_VERSION"].removeprefix("v").rsplit(".", 1)[0] \
        + ".0-0", "the chart claims the version the whole suite runs on"


BAD_VALUES = [
    pytest.param({"replicaCount": 0}, "/replicaCount", id="replicas-0"),
    pytest.param({"replicaCount": 11}, "/replicaCount", id="replicas-11"),
    pytest.param({"replicaCount": "two"}, "/replicaCount", id="replicas-string"),
    pytest.param({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", id="pull-policy"),
    pytest.param({"sidecarImagePullPolicy": "always"}, "/sidecarImagePullPolicy", id="sidecar-pull-policy"),
    pytest.param({"sidecarImagePullSecrets": ["Bad_Name"]}, "/sidecarImagePullSecrets/0", id="sidecar-pull-secret"),
    pytest.param({"rbac": {"aggregateToDefaultRoles": "yes"}}, "/rbac/aggregateToDefaultRoles",
                 id="aggregate-string"),
    pytest.param({"image": {"repository": ""}}, "/image/repository", id="empty-repository"),
    pytest.param({"image": {"tag": 1.2}}, "/image/tag", id="tag-number"),
    pytest.param({"image": {"digest": "latest"}}, "/image/digest", id="digest"),
    pytest.param({"replicaCont": 2}, "replicaCont", id="unknown-top-level-key"),
    pytest.param({"watchNamespaces": ["team-a", "Bad_Name"]}, "/watchNamespaces/1", id="bad-namespace"),
    pytest.param({"watchNamespaces": "team-a"}, "/watchNamespaces", id="namespaces-not-a-list"),
    pytest.param({"metrics": {"service": {"port": 70000}}}, "/metrics/service/port", id="port-70000"),
    pytest.param({"serviceMonitor": {"interval": "soon"}}, "/serviceMonitor/interval", id="interval-soon"),
    pytest.param({"serviceMonitor": {"enabled": "yes"}}, "/serviceMonitor/enabled", id="enabled-string"),
    pytest.param({"resources": "lots"}, "/resources", id="resources-not-object"),
    pytest.param({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory", id="bad-quantity"),
    pytest.param({"sidecarImage": 3}, "/sidecarImage", id="sidecar-image-number"),
    pytest.param({"podDisruptionBudget": {"minAvailable": "half"}}, "/podDisruptionBudget/minAvailable",
                 id="pdb-min-available"),
    pytest.param({"tolerations": {"key": "x"}}, "/tolerations", id="tolerations-not-list"),
    pytest.param({"monitoring": {"prometheusRule": {"for": {"SingletonNoLeader": "1.5m"}}}},
                 "/monitoring/prometheusRule/for/SingletonNoLeader", id="alert-for-not-a-prometheus-duration"),
    pytest.param({"monitoring": {"podMonitor": {"namespaceSelector": {"matchNames": "feeds"}}}},
                 "/monitoring/podMonitor/namespaceSelector/matchNames", id="pod-monitor-namespaces-not-list"),
    pytest.param({"nodeSelector": ["linux"]}, "/nodeSelector", id="node-selector-not-map"),
    pytest.param({"admissionPolicy": {"validationActions": ["Block"]}}, "/admissionPolicy/validationActions/0",
                 id="validation-action"),
    pytest.param({"webhook": {"failurePolicy": "Maybe"}},
                 "at '/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'", id="failure-policy"),
    pytest.param({"webhook": {"port": 0}}, "at '/webhook/port': minimum: got 0, want 1,024", id="webhook-port-0"),
    pytest.param({"webhook": {"port": 443}}, "at '/webhook/port': minimum: got 443, want 1,024",
                 id="webhook-port-privileged"),
    pytest.param({"webhook": {"port": 65536}}, "at '/webhook/port': maximum: got 65,536, want 65,535",
                 id="webhook-port-65536"),
    pytest.param({"webhook": {"port": "9443"}}, "/webhook/port", id="webhook-port-string"),
    pytest.param({"webhook": {"hostNetwork": "yes"}}, "/webhook/hostNetwork", id="host-network-string"),
    pytest.param({"healthPort": 80}, "at '/healthPort': minimum: got 80, want 1,024", id="health-port-80"),
]


@needs_helm
@pytest.mark.parametrize(("values", "named"), BAD_VALUES)
def test_schema_rejects_bad_values(tmp_path: Path, values: Obj, named: str) -> None:
    result = template(tmp_path, values, check=False)
    assert result.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert named in result.stderr, result.stderr


# --- on the API server -----------------------------------------------------------------------

class Release:
    def __init__(self, cluster: Cluster, name: str, namespace: str) -> None:
        self.cluster = cluster
        self.name = name
        self.namespace = namespace

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return helm(*args, "--namespace", self.namespace, env=self.cluster.env, check=check)

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name}"


NAMESPACED = "deployments,serviceaccounts,services,roles,rolebindings,poddisruptionbudgets,networkpolicies"
CLUSTER_SCOPED = ("clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,"
                  "mutatingwebhookconfigurations")


@contextlib.contextmanager
def uninstalled_after(cluster: Cluster, namespace: str) -> Iterator[Release]:
    """A release name in ``namespace``, uninstalled (and its cluster-scoped objects deleted) after."""
    rel = Release(cluster, "sgl-" + secrets.token_hex(4), namespace)
    try:
        yield rel
    finally:
        rel.helm("uninstall", rel.name, "--wait", "--timeout", "60s", check=False)
        cluster.kubectl("delete", CLUSTER_SCOPED, "-l", rel.selector, "--ignore-not-found", check=False)


@pytest.fixture
def release(cluster: Cluster, namespace: str) -> Iterator[Release]:
    with uninstalled_after(cluster, namespace) as rel:
        yield rel


def items(cluster: Cluster, kinds: str, *args: str) -> list[Obj]:
    found: list[Obj] = get_json(cluster, kinds, *args)["items"]
    return found


def reapply_crd_like_the_fixture(cluster: Cluster) -> None:
    """What the ``singleton_crd`` fixture does (server-side apply, forcing conflicts)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=singleton-tests",
                    "-f", str(CRD_PATH))
    wait_established(cluster.kubectl, "crd/singletonservices.singleton.dev")


def singleton_service(name: str, namespace: str) -> Obj:
    return {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "busybox"}]}}}}


@pytest.mark.k8s
def test_install_creates_the_crd_then_the_fixture_still_applies(cluster: Cluster, singleton_crd: Path,
                                                                 release: Release, tmp_path: Path) -> None:
    """Order 1: helm installs the CRD (none there), then the fixture's server-side apply
    takes it over without conflict. helm never deletes a CRD of crds/ on uninstall. (The
    fixture first: the groups left by earlier tests are listed through the CRD, which a worker
    that runs this module before any other has not applied yet.)"""
    if use_existing_cluster():
        pytest.skip("deletes the SingletonService CRD (and every SingletonService): test bed only")
    crd = "crd/singletonservices.singleton.dev"
    source = yaml.safe_load(CRD_PATH.read_text())
    # A group an earlier test's operator left with its finalizer would hold the CRD's deletion
    # until the timeout: no operator of theirs runs any more to remove it.
    for left in get_json(cluster, "singletonservices", "-A")["items"]:
        if left["metadata"].get("finalizers"):
            cluster.kubectl("patch", "singletonservice", left["metadata"]["name"], "-n", left["metadata"]["namespace"],
                            "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    try:
        cluster.kubectl("delete", crd, "--ignore-not-found", "--wait=true", "--timeout=60s")
        release.helm("install", release.name, str(CHART), *values_args({"admissionPolicy": {"enabled": False}},
                                                                       tmp_path))
        wait_established(cluster.kubectl, crd)
        installed = get_json(cluster, crd, "--show-managed-fields")
        assert {f["manager"] for f in installed["metadata"]["managedFields"]} >= {"helm"}
        assert installed["spec"]["names"] == source["spec"]["names"] | {"listKind": "SingletonServiceList"}
        assert installed["spec"]["versions"][0]["schema"] == source["spec"]["versions"][0]["schema"]
        created = singleton_service("after-helm", release.namespace)
        cluster.kubectl("create", "-f", "-", input_text=json.dumps(created))
    finally:
        reapply_crd_like_the_fixture(cluster)
    taken_over = get_json(cluster, crd, "--show-managed-fields")
    assert "singleton-tests" in {f["manager"] for f in taken_over["metadata"]["managedFields"]}
    release.helm("uninstall", release.name, "--wait", "--timeout", "60s")
    assert get_json(cluster, crd)["metadata"]["uid"] == taken_over["metadata"]["uid"], "helm keeps CRDs"
    get_json(cluster, "singletonservice", "after-helm", "-n", release.namespace)


@pytest.mark.k8s
def test_install_upgrade_uninstall(cluster: Cluster, singleton_crd: Path, release: Release, namespace: str,
                                   tmp_path: Path) -> None:
    """Order 2: the CRD is there (the fixture's); helm skips it. Then install, upgrade with
    changed values keeping an existing SingletonService, uninstall."""
    assert singleton_crd == CRD_PATH
    own_namespace = {"admissionPolicy": {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": namespace}}}}
    out = release.helm("install", release.name, str(CHART), *values_args(own_namespace, tmp_path)).stdout
    assert "kubectl get singletonservices -A" in out and "singleton.dev/role=leader" in out  # NOTES.txt
    assert (f"Pod webhook: MutatingWebhookConfiguration {release.name}-singleton-operator (cluster-wide, webhook "
            "pods.singleton.dev, failurePolicy Fail)") in out, out
    assert "While no operator replica answers, such pods are refused" in out, out
    crd = get_json(cluster, "crd/singletonservices.singleton.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"

    namespaced = items(cluster, NAMESPACED, "-n", namespace, "-l", release.selector)
    cluster_scoped = items(cluster, CLUSTER_SCOPED, "-l", release.selector)
    assert sorted(o["kind"] for o in namespaced) == sorted([
        "Deployment", "ServiceAccount", "Service", "Service", "Role", "RoleBinding", "PodDisruptionBudget",
        "NetworkPolicy"])
    assert sorted(o["kind"] for o in cluster_scoped) == sorted([
        "ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration"])
    for obj in namespaced + cluster_scoped:
        labels = obj["metadata"]["labels"]
        assert all(labels.get(k) for k in STANDARD_LABELS), (obj["kind"], labels)
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert obj["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
    deployment = get_json(cluster, "deployment", f"{release.name}-singleton-operator", "-n", namespace)
    assert deployment["spec"]["replicas"] == 2

    existing = singleton_service("kept", namespace)
    cluster.kubectl("create", "-f", "-", input_text=json.dumps(existing))
    before = get_json(cluster, "singletonservice", "kept", "-n", namespace)

    release.helm("upgrade", release.name, str(CHART), "--reuse-values", "--set", "replicaCount=3",
                 "--set", "metrics.service.port=9100")
    deployment = get_json(cluster, "deployment", f"{release.name}-singleton-operator", "-n", namespace)
    assert deployment["spec"]["replicas"] == 3
    service = get_json(cluster, "service", f"{release.name}-singleton-operator-metrics", "-n", namespace)
    assert service["spec"]["ports"][0]["port"] == 9100
    assert deployment["metadata"]["labels"]["app.kubernetes.io/instance"] == release.name
    binding = items(cluster, "validatingadmissionpolicybindings", "-l", release.selector)[0]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace}, "--reuse-values keeps the install's values"
    after = get_json(cluster, "singletonservice", "kept", "-n", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"] and after["spec"] == before["spec"]
    history = release.helm("history", release.name, "-o", "json").stdout
    assert [h["status"] for h in json.loads(history)] == ["superseded", "deployed"]

    release.helm("uninstall", release.name, "--wait", "--timeout", "60s")
    deadline = time.monotonic() + 30
    while (left := items(cluster, NAMESPACED, "-n", namespace, "-l", release.selector)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left
    assert not items(cluster, CLUSTER_SCOPED, "-l", release.selector)
    assert get_json(cluster, "singletonservice", "kept", "-n", namespace)["metadata"]["uid"] == \
        before["metadata"]["uid"], "uninstall keeps the CRD and the user's objects"


def can(cluster: Cluster, user: str, namespace: str, *args: str) -> bool:
    """kubectl auth can-i, impersonating ``user`` (the API server's SubjectAccessReview)."""
    result = cluster.kubectl("auth", "can-i", *args, "-n", namespace, "--as", user, check=False)
    return result.stdout.strip() == "yes"


@needs_helm
def test_tenants_bound_to_the_built_in_edit_role_manage_their_groups(
    controllers: Cluster, singleton_crd: Path, namespace: str, tmp_path: Path
) -> None:
    """The chart's aggregated ClusterRoles on the real API server: the controller-manager's
    clusterrole-aggregation controller folds them into the built-in view, edit and admin roles."""
    cluster = controllers
    release = "agg-" + secrets.token_hex(3)
    objects = [doc for doc in yaml.safe_load_all(helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
        "--show-only", "templates/clusterrole-aggregated.yaml").stdout) if doc]
    assert sorted(o["metadata"]["name"] for o in objects) == [f"{release}-singleton-edit", f"{release}-singleton-view"]
    editor, viewer, admin = f"alice-{release}", f"bob-{release}", f"carol-{release}"
    for user, role in ((editor, "edit"), (viewer, "view"), (admin, "admin")):
        cluster.kubectl("create", "rolebinding", f"{user}-{role}", "-n", namespace, f"--clusterrole={role}",
                        f"--user={user}")
    # Without the chart's roles the built-in ones know nothing of SingletonServices.
    assert not can(cluster, editor, namespace, "create", "singletonservices.singleton.dev")
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    try:
        for user in (editor, admin):
            wait_for_true(functools.partial(can, cluster, user, namespace, "create", "singletonservices.singleton.dev"),
                          30, f"{user} to be allowed to create SingletonServices")
        wait_for_true(lambda: can(cluster, viewer, namespace, "list", "singletonservices.singleton.dev"), 30,
                      "view to cover SingletonServices")
        as_editor = ("-n", namespace, "--as", editor)
        cluster.kubectl("create", *as_editor, "-f", "-", input_text=json.dumps(singleton_service("tenant", namespace)))
        cluster.kubectl("scale", "sgl/tenant", "--replicas=5", *as_editor)
        assert get_json(cluster, "sgl", "tenant", "-n", namespace)["spec"]["replicas"] == 5
        cluster.kubectl("label", "sgl/tenant", "team=payments", *as_editor)
        status = cluster.kubectl("patch", "sgl/tenant", *as_editor, "--subresource=status", "--type=merge", "-p",
                                 json.dumps({"status": {"phase": "Running"}}), check=False)
        assert status.returncode != 0 and "forbidden" in status.stderr, status.stderr
        as_viewer = ("-n", namespace, "--as", viewer)
        assert cluster.kubectl("get", "sgl/tenant", *as_viewer, check=False).returncode == 0
        refused = cluster.kubectl("scale", "sgl/tenant", "--replicas=1", *as_viewer, check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr, refused.stderr
        # Elsewhere (no binding) nothing.
        assert not can(cluster, editor, "default", "create", "singletonservices.singleton.dev")
        cluster.kubectl("delete", "sgl/tenant", *as_editor)
    finally:
        cluster.kubectl("delete", *[f"clusterrole/{o['metadata']['name']}" for o in objects], "--ignore-not-found",
                        check=False)


def wait_for_true(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)
