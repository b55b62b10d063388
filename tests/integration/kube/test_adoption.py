"""Adopting existing workloads: the injection shared by the webhook and ``singletonctl inject``,
the CRD's ``spec.workloadRef`` on the real API server, and the operator's part of an adoption
(the group label on the workload's template, the RBAC for the workload's own account, the
status from the adopted pods, the label taken back when the group is deleted)."""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as dt
import http.server
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from singleton_election import contract
from singleton_operator import certs
from singleton_operator.model.inject import InjectError, Manifest, inject_manifests, is_injected, pod_patch
from singleton_operator.model.spec import SpecError, read_spec
from singleton_operator.model.status import workload_suitability
from singleton_testbed.harness.kubehelpers import get_json
from singleton_testbed.harness.operators import OperatorProcess
from singleton_testbed.harness.sidecars import wait_for
from singleton_testbed.procs import free_port
from tests.conftest import Cluster
from tests.integration.kube.test_operator import Factory, condition, cr, operator_samples, operators  # noqa: F401

IMAGE = "example.invalid/singleton:test"


def vendor_deployment(name: str = "poller", **pod: Any) -> dict[str, Any]:
    """A Deployment as a third party writes it: its own labels, account and probes."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "Helm",
                                                  "app.kubernetes.io/instance": "vendor"}},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name, "app.kubernetes.io/instance": "vendor"}},
                                  "spec": {"serviceAccountName": "vendor-poller",
                                           "containers": [{"name": "poller", "image": "vendor/poller:1",
                                                           "command": ["/poll"]}], **pod}}}}


def adopting(name: str = "poller", kind: str = "Deployment", workload: str = "poller",
             **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": name},
            "spec": {"workloadRef": {"kind": kind, "name": workload}, **spec}}


def inject(*docs: dict[str, Any]) -> list[dict[str, Any]]:
    return inject_manifests([Manifest(doc=copy.deepcopy(d), source=f"doc{i}") for i, d in enumerate(docs)],
                            default_namespace="team", default_sidecar_image=IMAGE)


def test_inject_adds_the_sidecar_and_keeps_the_workloads_own_fields() -> None:
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "poller"}}
    out = inject(adopting(gating={"mode": "file"}), vendor_deployment(), other)
    assert [d["kind"] for d in out] == ["SingletonService", "Deployment", "ConfigMap"]
    assert out[2] == other
    deployment = out[1]
    template = deployment["spec"]["template"]
    # The workload's own: labels (with the group's added), selector, replicas, account.
    assert deployment["metadata"]["labels"] == vendor_deployment()["metadata"]["labels"]
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": "poller"}}
    assert deployment["spec"]["replicas"] == 3
    assert template["metadata"]["labels"] == {"app": "poller", "app.kubernetes.io/instance": "vendor",
                                              contract.LABEL_GROUP: "poller"}
    assert template["spec"]["serviceAccountName"] == "vendor-poller"
    sidecar = template["spec"]["initContainers"][0]
    assert (sidecar["name"], sidecar["image"], sidecar["restartPolicy"]) == ("singleton-sidecar", IMAGE, "Always")
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env[contract.ENV_GROUP] == "poller" and env[contract.ENV_LOCK_KEY] == "team/poller"
    main = template["spec"]["containers"][0]
    assert main["command"][-1] == "/poll" and "gate.sh" in main["command"][2]
    assert {"name": "singleton-gate", "mountPath": "/var/run/singleton"} in main["volumeMounts"]


def test_inject_refuses_what_would_be_half_done() -> None:
    with pytest.raises(InjectError, match=r"no SingletonService with spec.workloadRef"):
        inject(vendor_deployment())
    with pytest.raises(InjectError, match=r"adopts Deployment team/poller, which is not in the input"):
        inject(adopting(), vendor_deployment("other"))
    with pytest.raises(InjectError, match="adopted by two SingletonServices"):
        inject(adopting("a"), adopting("b"), vendor_deployment())
    injected = inject(adopting(), vendor_deployment())[1]
    with pytest.raises(InjectError, match="already has the singleton-sidecar container"):
        inject(adopting(), injected)
    # The group's rules, checked on the workload's template and said to be about it.
    with pytest.raises(InjectError, match=r"spec.mainContainer: no container named 'app' .*adopted Deployment"):
        inject(adopting(mainContainer="app"), vendor_deployment())
    clash = vendor_deployment()
    clash["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 7451}]
    with pytest.raises(InjectError, match=r"spec.sidecar.port .* \(in the adopted Deployment team/poller\)"):
        inject(adopting(), clash)
    with pytest.raises(InjectError, match=r"spec.workloadRef.kind: must be Deployment or StatefulSet"):
        inject(adopting(kind="DaemonSet"), vendor_deployment())
    both = adopting(template={"spec": {"containers": [{"name": "a", "image": "a"}]}})
    with pytest.raises(InjectError, match=r"spec.template: must not be set together with spec.workloadRef"):
        inject(both, vendor_deployment())


def test_a_statefulset_is_injected_too() -> None:
    sts = vendor_deployment()
    sts["kind"] = "StatefulSet"
    sts["spec"]["serviceName"] = "poller"
    out = inject(adopting(kind="StatefulSet"), sts)
    assert is_injected(out[1]["spec"]["template"]["spec"])


def test_the_pod_patch_is_the_templates_injection_and_empty_once_injected() -> None:
    pod = {"metadata": {"generateName": "poller-", "labels": {"app": "poller", contract.LABEL_GROUP: "poller"}},
           "spec": copy.deepcopy(vendor_deployment()["spec"]["template"]["spec"])}
    body = {**adopting(), "metadata": {"name": "poller", "namespace": "team", "uid": "u"}}
    spec = read_spec(body, default_sidecar_image=IMAGE, workload={"spec": {"template": pod}})
    patch = pod_patch(spec, pod)
    patched = jsonpatch.apply_patch(pod, patch)
    assert patched["spec"]["initContainers"][0]["name"] == "singleton-sidecar"
    assert patched["spec"]["serviceAccountName"] == "vendor-poller"
    assert patched["metadata"]["generateName"] == "poller-"
    assert pod_patch(spec, patched) == []
    with pytest.raises(ValueError, match="must be read before"):
        read_spec(body, default_sidecar_image=IMAGE)
    with pytest.raises(SpecError, match=r"spec.workloadRef.name"):
        read_spec({**body, "spec": {"workloadRef": {"kind": "Deployment", "name": "Bad_Name"}}},
                  default_sidecar_image=IMAGE, workload={"spec": {"template": pod}})


def test_a_second_call_puts_the_sidecar_behind_a_proxy_another_webhook_added_after_it() -> None:
    pod = {"metadata": {"generateName": "poller-", "labels": {"app": "poller", contract.LABEL_GROUP: "poller"}},
           "spec": copy.deepcopy(vendor_deployment()["spec"]["template"]["spec"])}
    pod["spec"]["initContainers"] = [{"name": "migrate", "image": "migrate:1"}]
    body = {**adopting(), "metadata": {"name": "poller", "namespace": "team", "uid": "u"}}
    spec = read_spec(body, default_sidecar_image=IMAGE, workload={"spec": {"template": pod}})
    injected = jsonpatch.apply_patch(pod, pod_patch(spec, pod))
    assert [c["name"] for c in injected["spec"]["initContainers"]] == ["singleton-sidecar", "migrate"]
    # A mesh's injector, called after ours, adds its proxy as a native sidecar right behind ours
    # (and another one at the end): the API server calls our webhook again (reinvocationPolicy
    # IfNeeded), which moves the sidecar behind the proxy, still ahead of the migration.
    meshed = copy.deepcopy(injected)
    meshed["spec"]["initContainers"].insert(1, {"name": "mesh-proxy", "image": "proxy:1", "restartPolicy": "Always"})
    meshed["spec"]["initContainers"].append({"name": "mesh-late", "image": "proxy:1", "restartPolicy": "Always"})
    again = pod_patch(spec, meshed)
    inits = meshed["spec"]["initContainers"]
    assert again == [{"op": "replace", "path": "/spec/initContainers", "value": [inits[1], inits[0], *inits[2:]]}]
    placed = jsonpatch.apply_patch(meshed, again)
    assert [c["name"] for c in placed["spec"]["initContainers"]] == [
        "mesh-proxy", "singleton-sidecar", "migrate", "mesh-late"]
    assert pod_patch(spec, placed) == []  # in its place: nothing more to do
    # Istio puts its setup container and its proxy first, whatever the order was: the sidecar
    # goes right behind the proxy.
    istio = copy.deepcopy(injected)
    istio["spec"]["initContainers"][:0] = [{"name": "istio-init", "image": "proxy:1"},
                                           {"name": "istio-proxy", "image": "proxy:1", "restartPolicy": "Always"}]
    assert [c["name"] for c in jsonpatch.apply_patch(istio, pod_patch(spec, istio))["spec"]["initContainers"]] == [
        "istio-init", "istio-proxy", "singleton-sidecar", "migrate"]


def singletonctl(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    # The alias console script (kubectl-singleton is the plugin's name; tests/integration/kube/test_ctl.py runs it).
    return subprocess.run([str(Path(sys.executable).parent / "singletonctl"), *args], input=stdin,
                          capture_output=True, text=True, timeout=60, check=False)


def test_singletonctl_inject_reads_files_and_stdin_and_writes_everything(tmp_path: Path) -> None:
    group_file = tmp_path / "group.yaml"
    group_file.write_text(yaml.safe_dump(adopting()))
    vendor = yaml.safe_dump_all([vendor_deployment(), {"apiVersion": "v1", "kind": "Service",
                                                       "metadata": {"name": "poller"}}])
    result = singletonctl("inject", "-f", str(group_file), "-f", "-", "-n", "team", "--sidecar-image", IMAGE,
                          stdin="---\n" + vendor)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["SingletonService", "Deployment", "Service"]
    assert docs[1]["spec"]["template"]["spec"]["initContainers"][0]["image"] == IMAGE
    # The operator's pull settings, given as the operator has them.
    pulled = singletonctl("inject", "-f", str(group_file), "-f", "-", "--sidecar-image-pull-policy", "Always",
                          "--sidecar-image-pull-secret", "regcred", stdin=vendor)
    assert pulled.returncode == 0, pulled.stderr
    pod = list(yaml.safe_load_all(pulled.stdout))[1]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    # Errors: one line, exit 1, nothing on stdout (no half-written stream).
    for args, stdin, message in [
        (["inject"], vendor, "no SingletonService with spec.workloadRef in the input"),
        (["inject", "-f", str(tmp_path / "missing.yaml")], "", "cannot read"),
        (["inject", "-f", str(group_file), "-f", "-"], "kind: [unclosed", "stdin: not valid YAML"),
        (["inject", "-f", str(group_file), "-f", "-"], "- a\n- b\n", "document 1 is not a Kubernetes object"),
        (["inject", "-f", "-", "-f", "-"], vendor, "stdin can be read once"),
    ]:
        bad = singletonctl(*args, stdin=stdin)
        assert bad.returncode == 1, (args, bad.stdout, bad.stderr)
        assert bad.stdout == ""
        assert bad.stderr.startswith("singletonctl: error: ") and message in bad.stderr, bad.stderr
        assert bad.stderr.count("\n") == 1


def test_injected_manifests_are_valid_for_the_api_server(cluster: Cluster, singleton_crd: Path, namespace: str,
                                                         tmp_path: Path) -> None:
    manifest = tmp_path / "injected.yaml"
    manifest.write_text(yaml.safe_dump_all(inject(adopting(gating={"mode": "file"}), vendor_deployment())))
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(manifest), check=False)
    assert result.returncode == 0, result.stderr
    assert "deployment.apps/poller created (server dry run)" in result.stdout


@pytest.mark.parametrize(("spec", "message"), [
    ({"workloadRef": {"kind": "Deployment", "name": "x"},
      "template": {"spec": {"containers": [{"name": "a", "image": "a"}]}}}, "set exactly one of spec.template"),
    ({}, "set exactly one of spec.template"),
    ({"workloadRef": {"kind": "DaemonSet", "name": "x"}}, "Unsupported value: \"DaemonSet\""),
    ({"workloadRef": {"kind": "Deployment", "name": "Not_A_Name"}}, "spec.workloadRef.name"),
])
def test_the_crd_admits_exactly_one_of_template_and_workload_ref(cluster: Cluster, singleton_crd: Path,
                                                                namespace: str, spec: dict[str, Any],
                                                                message: str) -> None:
    body = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": "g"},
            "spec": spec}
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=json.dumps(body), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_the_adopted_workload_cannot_be_swapped(cluster: Cluster, singleton_crd: Path, namespace: str) -> None:
    cluster.apply(json.dumps(adopting()), namespace=namespace)
    for spec, message in [({"workloadRef": {"kind": "Deployment", "name": "other"}}, "spec.workloadRef cannot change"),
                          ({"workloadRef": None, "template": {"spec": {"containers": [{"name": "a", "image": "a"}]}}},
                           "cannot switch between spec.template and spec.workloadRef")]:
        result = cluster.kubectl("patch", "singletonservice", "poller", "-n", namespace, "--type=merge", "-p",
                                 json.dumps({"spec": spec}), check=False)
        assert result.returncode != 0
        assert message in result.stderr, result.stderr


@pytest.fixture
def adopting_operator(cluster: Cluster, singleton_crd: Path, namespace: str,
                      tmp_path: Path) -> Iterator[OperatorProcess]:
    """An operator that serves the pod webhook, in a namespace of its own (its webhook never
    sees its own namespace, so it adopts nothing there), watching this test's namespace."""
    own = f"{namespace}-op"
    cluster.kubectl("create", "namespace", own)
    operator = OperatorProcess(cluster.kubeconfig, own, tmp_path / "adopting-operator.log", name="adopter",
                               extra_args=["--namespace", namespace, "--webhook-listen", f"127.0.0.1:{free_port()}",
                                           "--webhook-extra-name", "127.0.0.1", "--sidecar-image", IMAGE])
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        cluster.kubectl("delete", "namespace", own, "--wait=false", check=False)


def template_labels(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    deployment = get_json(cluster, "deployment", name, "-n", namespace)
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"].get("labels") or {}
    return labels


def test_the_operator_adopts_a_deployment_and_gives_it_back(cluster: Cluster, namespace: str,
                                                            adopting_operator: OperatorProcess) -> None:
    name = "adopt-" + uuid.uuid4().hex[:4]
    cluster.apply(json.dumps(adopting(name, workload=name, service={"ports": [{"port": 80}]})), namespace=namespace)
    # No workload yet: said so, and adopted as soon as it exists.
    stalled = wait_for(lambda: (c := condition(cr(cluster, namespace, name), "Stalled")) and c["status"] == "True"
                       and c, 20, "a Stalled condition", 0.2)
    assert f"Deployment {namespace}/{name} does not exist" in stalled["message"]
    vendor = vendor_deployment(name)
    cluster.apply(json.dumps(vendor), namespace=namespace)
    labels = wait_for(lambda: (found := template_labels(cluster, namespace, name)).get(contract.LABEL_GROUP) and found,
                      30, "the group label on the template", 0.2)
    assert labels == {"app": name, "app.kubernetes.io/instance": "vendor", contract.LABEL_GROUP: name}
    # The operator's two fields on the template: the label and its settings' digest.
    assert set(get_json(cluster, "deployment", name, "-n", namespace)["spec"]["template"]["metadata"]["annotations"]) \
        == {"singleton.dev/sidecar-config"}
    deployment = get_json(cluster, "deployment", name, "-n", namespace, "--show-managed-fields")
    # Only the label is the operator's; the Deployment is otherwise the vendor's, untouched.
    assert deployment["metadata"]["labels"] == vendor["metadata"]["labels"]
    assert "ownerReferences" not in deployment["metadata"]
    assert "initContainers" not in deployment["spec"]["template"]["spec"]
    managers = {m["manager"]: m for m in deployment["metadata"]["managedFields"]}
    assert managers["singleton-operator"]["operation"] == "Apply"
    binding = get_json(cluster, "rolebinding", f"singleton-sidecar-{name}", "-n", namespace)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "vendor-poller", "namespace": namespace}]
    service = get_json(cluster, "service", f"{name}-leader", "-n", namespace)
    assert service["spec"]["selector"] == {contract.LABEL_GROUP: name, contract.LABEL_ROLE: contract.ROLE_LEADER}
    # The pods keep the workload's account: the group makes none of its own.
    assert cluster.kubectl("get", "serviceaccount", f"singleton-sidecar-{name}", "-n", namespace,
                           check=False).returncode != 0
    # The owner re-applies its manifest (kubectl apply, as helm upgrade does, a three-way merge
    # that knows nothing of the label): the label stays.
    vendor["spec"]["template"]["metadata"]["annotations"] = {"vendor/version": "2"}
    cluster.apply(json.dumps(vendor), namespace=namespace)
    annotations = get_json(cluster, "deployment", name, "-n", namespace)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["vendor/version"] == "2"
    assert template_labels(cluster, namespace, name)[contract.LABEL_GROUP] == name
    # Deleted: the workload is given back (the label off its template), then the group goes.
    cluster.kubectl("delete", "singletonservice", name, "-n", namespace, "--wait=true", "--timeout=30s")
    assert contract.LABEL_GROUP not in template_labels(cluster, namespace, name)
    assert template_labels(cluster, namespace, name)["app"] == name


def test_an_adopted_workload_scaled_to_zero_exports_no_leader_count(cluster: Cluster, namespace: str,
                                                                    adopting_operator: OperatorProcess) -> None:
    """No leader is what a workload scaled to zero asks for: singleton_group_leaders leaves it
    out (SingletonNoLeader reads 0 as an alert); scaled up with no leader yet, it says 0."""
    name = "zero-" + uuid.uuid4().hex[:4]
    series = ("singleton_group_leaders", (("group", name), ("namespace", namespace)))
    vendor = vendor_deployment(name)
    vendor["spec"]["replicas"] = 0
    cluster.apply(json.dumps(vendor), namespace=namespace)
    cluster.apply(json.dumps(adopting(name, workload=name)), namespace=namespace)
    wait_for(lambda: (cr(cluster, namespace, name).get("status") or {}).get("phase") or None, 20, "a status", 0.2)
    wait_for(lambda: contract.LABEL_GROUP in template_labels(cluster, namespace, name) or None, 20, "adopted", 0.2)
    try:
        assert series not in operator_samples(adopting_operator)
        cluster.kubectl("scale", "deployment", name, "-n", namespace, "--replicas=1")
        # A change of the group makes the operator read the workload again at once.
        cluster.kubectl("annotate", "singletonservice", name, "-n", namespace, "example.com/scaled=1")
        wait_for(lambda: operator_samples(adopting_operator).get(series) == 0.0 or None, 20, "the count at 0", 0.2)
    finally:
        # While its operator runs: it removes its finalizer, or the group outlives the test (and
        # a later deletion of the CRD waits on it forever).
        cluster.kubectl("delete", "singletonservice", name, "-n", namespace, "--wait=true", "--timeout=30s")


def webhook_configuration(name: str, namespace: str, port: int) -> dict[str, Any]:
    """The chart's webhook, pointed at an operator process on this machine by URL, and scoped
    to this test's namespace."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": "pods.singleton.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": "Fail", "timeoutSeconds": 5, "reinvocationPolicy": "IfNeeded",
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                     "resources": ["pods"], "scope": "Namespaced"}],
                          "objectSelector": {"matchExpressions": [
                              {"key": contract.LABEL_GROUP, "operator": "Exists"},
                              {"key": "app.kubernetes.io/managed-by", "operator": "NotIn",
                               "values": ["singleton-operator"]}]},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                          "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate-pods"}}]}


MESH_PROXY = {"name": "mesh-proxy", "image": "mesh/proxy:1", "restartPolicy": "Always"}


@contextlib.contextmanager
def mesh_injector(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[list[str]]:
    """A stand-in for a mesh's injector: a webhook of this process that appends ``MESH_PROXY``
    to every pod of ``namespace``, called after the operator's (its configuration's name sorts
    after ``singleton-test-*``). Yields the names of the pods it was called for."""
    bundle = certs.new_bundle(["127.0.0.1"], dt.datetime.now(dt.UTC))
    (tmp_path / "mesh.crt").write_bytes(bundle.cert)
    (tmp_path / "mesh.key").write_bytes(bundle.key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "mesh.crt", tmp_path / "mesh.key")
    calls: list[str] = []

    class Injector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = review["request"]
            calls.append(request["object"]["metadata"].get("name", ""))
            has_inits = "initContainers" in request["object"]["spec"]
            patch = [{"op": "add", "path": "/spec/initContainers/-", "value": MESH_PROXY} if has_inits else
                     {"op": "add", "path": "/spec/initContainers", "value": [MESH_PROXY]}]
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
                "uid": request["uid"], "allowed": True, "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode()}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Injector)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    name = "zz-mesh-" + uuid.uuid4().hex[:6]
    configuration = webhook_configuration(name, namespace, server.server_address[1])
    hook = configuration["webhooks"][0]
    # Ignore: a pod created just after the configuration is deleted, while the API server's
    # cache still holds it, is created without the proxy instead of refused.
    hook.update(name="inject.mesh.example", reinvocationPolicy="Never", objectSelector={}, failurePolicy="Ignore",
                clientConfig={"url": f"https://127.0.0.1:{server.server_address[1]}/inject",
                              "caBundle": base64.b64encode(bundle.ca_cert).decode()})
    cluster.apply(json.dumps(configuration))
    try:
        yield calls
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found")
        server.shutdown()
        server.server_close()


def bare_pod(name: str, group: str | None, **container: Any) -> str:
    labels = {"app": "x", **({contract.LABEL_GROUP: group} if group else {})}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                       "spec": {"containers": [{"name": "poller", "image": "vendor/poller:1", "command": ["/poll"],
                                                **container}]}})


def webhook_reads(audit: Path, namespace: str, group: str) -> int:
    """The SingletonService's reads by the webhook's own client, in the API server's audit log."""
    # Whole lines only (the API server may be writing the last one); the TLS Secret's name
    # holds the same words, so the user agent is checked on each entry.
    lines = audit.read_bytes().split(b"\n")[:-1]
    entries = [json.loads(line) for line in lines if b"singleton-operator-webhook" in line]
    return len({e["auditID"] for e in entries
                if e.get("userAgent", "").startswith("singleton-operator-webhook") and e["verb"] == "get"
                and (e.get("objectRef") or {}).get("resource") == "singletonservices"
                and ((e.get("objectRef") or {}).get("namespace"), (e.get("objectRef") or {}).get("name"))
                == (namespace, group)})


def test_the_webhook_injects_adopted_pods_and_refuses_them_while_no_operator_answers(
        cluster: Cluster, namespace: str, operators: Factory, tmp_path: Path) -> None:  # noqa: F811
    port = free_port()
    configuration = "singleton-test-" + uuid.uuid4().hex[:6]
    cluster.apply(json.dumps(webhook_configuration(configuration, namespace, port)))
    try:
        operator = operators("hook")
        operator.extra_args += ["--webhook-listen", f"127.0.0.1:{port}", "--webhook-extra-name", "127.0.0.1",
                                "--webhook-config", configuration, "--sidecar-image", IMAGE]
        operator.stop()
        operator.start()
        # The operator makes its certificate (a Secret in its namespace) and puts its CA into the
        # configuration before it answers.
        secret = wait_for(lambda: cluster.kubectl("get", "secret", "singleton-operator-webhook-tls", "-n", namespace,
                                                  "-o", "json", check=False).stdout or None, 30, "the TLS Secret", 0.2)
        assert json.loads(secret)["type"] == "kubernetes.io/tls"
        wait_for(lambda: (get_json(cluster, "mutatingwebhookconfiguration", configuration)["webhooks"][0]
                          ["clientConfig"].get("caBundle")), 30, "the caBundle", 0.2)
        cluster.apply(json.dumps(adopting(gating={"mode": "file"})), namespace=namespace)
        # A pod of the group is created with the sidecar, keeping its own fields.
        wait_for(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bare_pod("p1", "poller"),
                                         check=False).returncode == 0, 20, "the webhook to admit p1", 0.5)
        pod = get_json(cluster, "pod", "p1", "-n", namespace)
        sidecar = pod["spec"]["initContainers"][0]
        assert (sidecar["name"], sidecar["image"]) == ("singleton-sidecar", IMAGE)
        assert pod["spec"]["containers"][0]["command"][-1] == "/poll"
        assert pod["metadata"]["labels"] == {"app": "x", contract.LABEL_GROUP: "poller"}
        # The API server said it waits 5 s (timeoutSeconds): the group is read within 4, less the
        # moments the request spent before the read.
        given = [float(seconds) for seconds in re.findall(r"pod admission .* read_timeout_seconds=([0-9.]+)",
                                                          operator.log())]
        assert given and all(3.5 < seconds <= 4.0 for seconds in given), operator.log()
        if cluster.control_plane is not None:  # the audit log is the test bed's
            # The webhook read the group on connections of its own, never queued behind reconciles.
            assert webhook_reads(cluster.control_plane.workdir / "audit.log", namespace, "poller") >= 1
        # The sidecar gets the service account token like every container (the API server
        # runs its ServiceAccount admission again after a webhook changed the pod).
        assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
                   for m in sidecar.get("volumeMounts") or []), sidecar
        # A mesh's injector called after ours appends its proxy behind the sidecar: the API server
        # calls our webhook once more, and it moves the sidecar behind the proxy.
        with mesh_injector(cluster, namespace, tmp_path) as mesh_calls:
            # The API server calls a new webhook once its configuration has reached its cache:
            # server-side dry runs (webhooks are called for them too) until the stand-in is.
            wait_for(lambda: cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                             input_text=bare_pod("p6", "poller"), check=False).returncode == 0
                     and mesh_calls, 20, "the stand-in mesh webhook to be called", 0.5)
            cluster.kubectl("create", "-n", namespace, "-f", "-", input_text=bare_pod("p6", "poller"))
            meshed = get_json(cluster, "pod", "p6", "-n", namespace)["spec"]["initContainers"]
            assert [(c["name"], c.get("restartPolicy")) for c in meshed] == [
                ("mesh-proxy", "Always"), ("singleton-sidecar", "Always")]
            assert mesh_calls.count("p6") >= 2  # the dry runs and the creation
        # A pod injected before it is created (singletonctl inject) is admitted as it is.
        group = get_json(cluster, "sgl", "poller", "-n", namespace)
        plain = json.loads(bare_pod("p7", "poller"))
        spec = read_spec(group, default_sidecar_image=IMAGE, workload={"spec": {"template": plain}})
        injected = jsonpatch.apply_patch(plain, pod_patch(spec, plain))
        cluster.apply(json.dumps(injected), namespace=namespace)
        admitted = get_json(cluster, "pod", "p7", "-n", namespace)["spec"]
        assert [c["name"] for c in admitted["initContainers"]] == ["singleton-sidecar"]
        assert admitted["containers"][0]["command"] == injected["spec"]["containers"][0]["command"]
        # A pod that breaks the group's rules is refused, saying which rule.
        clash = cluster.kubectl("apply", "-n", namespace, "-f", "-",
                                input_text=bare_pod("p2", "poller", ports=[{"containerPort": 7450}]), check=False)
        assert clash.returncode != 0
        assert "spec.sidecar.port" in clash.stderr and "cannot run this pod" in clash.stderr, clash.stderr
        # A label for a group that does not exist: created unchanged, with a warning.
        orphan = cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bare_pod("p3", "nobody"))
        assert "no SingletonService" in orphan.stderr, orphan.stderr
        assert "initContainers" not in get_json(cluster, "pod", "p3", "-n", namespace)["spec"]
        # No operator answers: adopted pods are refused, other pods are created as usual.
        operator.stop()
        refused = cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bare_pod("p4", "poller"),
                                  check=False)
        assert refused.returncode != 0
        assert "failed calling webhook" in refused.stderr and "pods.singleton.dev" in refused.stderr, refused.stderr
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bare_pod("p5", None))
        # Back: the same certificate (the Secret) is served again.
        operator.start()
        wait_for(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=bare_pod("p4", "poller"),
                                         check=False).returncode == 0, 30, "the webhook to admit p4", 0.5)
        assert json.loads(cluster.kubectl("get", "secret", "singleton-operator-webhook-tls", "-n", namespace,
                                          "-o", "json").stdout)["data"] == json.loads(secret)["data"]
        delete_while_the_operator_runs(cluster, namespace, "poller")
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration, "--ignore-not-found")


@pytest.mark.parametrize(("given", "seconds"), [
    ("5s", 4.0), ("10s", 9.0), ("30s", 10.0), ("1m0s", 10.0), ("1m30s", 10.0), ("1s", 0.5), ("2.5s", 1.5),
    ("500ms", 0.25),
    (None, 10.0), ("", 10.0),  # no time given: the client's own timeout
    ("0s", 0.5), ("5", 0.5), ("soon", 0.5), ("-5s", 0.5), ("5s later", 0.5),  # not a time left: 1 s's share
])
def test_the_webhook_reads_the_group_within_the_time_the_api_server_gives(given: str | None,
                                                                           seconds: float) -> None:
    from singleton_operator.webhook import read_timeout

    assert read_timeout(given) == seconds


async def test_a_webhook_whose_group_read_hangs_refuses_the_pod_before_the_api_server_gives_up() -> None:
    """The API server gives it 2 s (``?timeout=2s``): the webhook answers a 503 naming the group
    within them, not after its own 10 s, when the API server has long given up."""
    import asyncio
    import time

    from aiohttp import ClientSession, web

    from singleton_election.kube import KubeClient, KubeConfig
    from singleton_operator.webhook import PATH, PodAdmission

    given_up = asyncio.Event()  # set once the test is done: the runner's cleanup waits for its handlers

    async def hang(_: web.Request) -> web.Response:
        await given_up.wait()
        return web.Response()

    async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    api = web.Application()
    api.router.add_get("/{tail:.*}", hang)
    api_runner, api_url = await serve(api)
    async with KubeClient(KubeConfig(server=api_url)) as client:
        admission = PodAdmission(client, lambda body, workload: read_spec(body, default_sidecar_image=IMAGE))
        hook_runner, hook_url = await serve(admission.app())
        try:
            review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                      "request": {"uid": "u1", "operation": "CREATE", "namespace": "team",
                                  "object": json.loads(bare_pod("p1", "poller"))}}
            started = time.monotonic()
            async with ClientSession() as session, session.post(f"{hook_url}{PATH}?timeout=2s", json=review) as resp:
                answer = (await resp.json())["response"]
            took = time.monotonic() - started
        finally:
            given_up.set()
            await hook_runner.cleanup()
            await api_runner.cleanup()
    assert took < 2.0, took
    assert answer["allowed"] is False and answer["status"]["code"] == 503, answer
    assert "cannot read SingletonService team/poller" in answer["status"]["message"], answer


def test_workload_suitability_names_the_settings_that_break_one_handover_per_rollout() -> None:
    body = {**adopting(kind="StatefulSet"), "metadata": {"name": "poller", "namespace": "team", "uid": "u"}}
    sts = vendor_deployment()
    sts["kind"] = "StatefulSet"
    spec = read_spec(body, default_sidecar_image=IMAGE, workload=sts)
    assert workload_suitability(spec, sts)[:2] == (False, "OrderedRollout")
    sts["spec"]["updateStrategy"] = {"type": "OnDelete"}
    assert workload_suitability(spec, sts)[:2] == (True, "AsExpected")
    sts["spec"]["replicas"] = 1
    suitable, reason, message = workload_suitability(spec, sts)
    assert (suitable, reason) == (False, "NoStandby")
    assert "StatefulSet team/poller runs 1 replica" in message


def test_the_operator_adopts_a_statefulset_and_says_what_its_rollouts_do(
        cluster: Cluster, namespace: str, adopting_operator: OperatorProcess) -> None:
    sts = vendor_deployment("ledger")
    sts["kind"] = "StatefulSet"
    sts["spec"]["serviceName"] = "ledger"
    cluster.apply(json.dumps(sts), namespace=namespace)
    cluster.apply(json.dumps(adopting("ledger", kind="StatefulSet", workload="ledger")), namespace=namespace)
    labels = wait_for(lambda: (get_json(cluster, "statefulset", "ledger", "-n", namespace)["spec"]["template"]
                               ["metadata"]["labels"]).get(contract.LABEL_GROUP), 30, "the group label", 0.2)
    assert labels == "ledger"
    found = wait_for(lambda: condition(cr(cluster, namespace, "ledger"), "WorkloadSuitable"), 30,
                     "the WorkloadSuitable condition", 0.2)
    assert (found["status"], found["reason"]) == ("False", "OrderedRollout"), found
    # The owner switches to OnDelete: the operator sees it (on its next look at the group).
    cluster.kubectl("patch", "statefulset", "ledger", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"updateStrategy": {"type": "OnDelete", "rollingUpdate": None}}}))
    cluster.kubectl("annotate", "sgl", "ledger", "-n", namespace, "example.com/poke=1")
    wait_for(lambda: (condition(cr(cluster, namespace, "ledger"), "WorkloadSuitable") or {}).get("status") == "True",
             30, "WorkloadSuitable True", 0.2)
    delete_while_the_operator_runs(cluster, namespace, "ledger")


def delete_while_the_operator_runs(cluster: Cluster, namespace: str, name: str) -> None:
    """An adopting group keeps kopf's finalizer until the operator gave its workload back: delete
    it while the operator runs, or it (and its namespace, and a CRD deletion) waits for one."""
    cluster.kubectl("delete", "sgl", name, "-n", namespace, "--wait=true", "--timeout=60s")


def stalled_reason(cluster: Cluster, namespace: str, name: str) -> str | None:
    found = condition(cr(cluster, namespace, name), "Stalled")
    return str(found["reason"]) if found and found["status"] == "True" else None


def test_adoptions_the_operator_must_refuse(cluster: Cluster, namespace: str, adopting_operator: OperatorProcess,
                                            operators: Factory, tmp_path: Path) -> None:  # noqa: F811
    cluster.apply(json.dumps(vendor_deployment("shared")), namespace=namespace)
    cluster.apply(json.dumps(adopting("first", workload="shared")), namespace=namespace)
    wait_for(lambda: template_labels(cluster, namespace, "shared").get(contract.LABEL_GROUP) == "first", 30,
             "the first group's label", 0.2)
    # A second group for the same workload: refused, the first keeps it.
    cluster.apply(json.dumps(adopting("second", workload="shared")), namespace=namespace)
    wait_for(lambda: stalled_reason(cluster, namespace, "second") == "WorkloadAdoptedByAnother", 30,
             "WorkloadAdoptedByAnother", 0.2)
    assert template_labels(cluster, namespace, "shared")[contract.LABEL_GROUP] == "first"
    # The Deployment the operator makes for a template group is not adoptable.
    cluster.apply(json.dumps({"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService",
                              "metadata": {"name": "made"},
                              "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "a",
                                                                             "command": ["a"]}]}}}}),
                  namespace=namespace)
    wait_for(lambda: cluster.kubectl("get", "deployment", "made", "-n", namespace, check=False).returncode == 0, 30,
             "the template group's Deployment", 0.2)
    cluster.apply(json.dumps(adopting("thief", workload="made")), namespace=namespace)
    wait_for(lambda: stalled_reason(cluster, namespace, "thief") == "WorkloadIsAGroup", 30, "WorkloadIsAGroup", 0.2)
    for name in ("second", "thief", "first"):
        delete_while_the_operator_runs(cluster, namespace, name)
    assert contract.LABEL_GROUP not in template_labels(cluster, namespace, "shared")
    # An operator without the webhook adopts only workloads injected already.
    adopting_operator.stop()
    plain_operator = OperatorProcess(cluster.kubeconfig, f"{namespace}-op", tmp_path / "plain.log", name="plain",
                                     extra_args=["--namespace", namespace])
    plain_operator.start()
    cluster.apply(json.dumps(vendor_deployment("plain")), namespace=namespace)
    cluster.apply(json.dumps(adopting("plain", workload="plain")), namespace=namespace)
    wait_for(lambda: stalled_reason(cluster, namespace, "plain") == "NoWebhook", 30, "NoWebhook", 0.2)
    assert contract.LABEL_GROUP not in template_labels(cluster, namespace, "plain")
    injected = inject(adopting("pre", workload="pre"), vendor_deployment("pre"))
    cluster.apply(json.dumps(injected[1]), namespace=namespace)
    cluster.apply(json.dumps(adopting("pre", workload="pre")), namespace=namespace)
    wait_for(lambda: (condition(cr(cluster, namespace, "pre"), "Stalled") or {}).get("status") == "False", 30,
             "the injected workload adopted", 0.2)
    for name in ("plain", "pre"):
        delete_while_the_operator_runs(cluster, namespace, name)
    plain_operator.stop()
    # Nor does an operator adopt in its own namespace, which its webhook never sees.
    operators("same-namespace")
    cluster.apply(json.dumps(adopting("mine", workload="plain")), namespace=namespace)
    wait_for(lambda: stalled_reason(cluster, namespace, "mine") == "OperatorNamespace", 30, "OperatorNamespace", 0.2)
    delete_while_the_operator_runs(cluster, namespace, "mine")


def test_an_adopted_workload_is_kept_adopted_and_follows_the_groups_settings(
        cluster: Cluster, namespace: str, adopting_operator: OperatorProcess) -> None:
    cluster.apply(json.dumps(vendor_deployment("kept")), namespace=namespace)
    cluster.apply(json.dumps(adopting("kept", workload="kept", gating={"mode": "file"})), namespace=namespace)

    def digest() -> str | None:
        template = get_json(cluster, "deployment", "kept", "-n", namespace)["spec"]["template"]["metadata"]
        value = (template.get("annotations") or {}).get("singleton.dev/sidecar-config")
        return str(value) if value else None

    first = wait_for(digest, 30, "the settings' digest on the template", 0.2)
    # A change of the group's settings changes the digest: one rollout of the workload.
    cluster.kubectl("patch", "sgl", "kept", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"drain": {"timeout": "7s"}}}))
    second = wait_for(lambda: (d := digest()) != first and d, 30, "a new digest", 0.2)
    assert second != first
    # Re-created without the label (helm uninstall and install): adopted again by the next look.
    cluster.kubectl("delete", "deployment", "kept", "-n", namespace, "--wait=true")
    cluster.apply(json.dumps(vendor_deployment("kept")), namespace=namespace)
    wait_for(lambda: template_labels(cluster, namespace, "kept").get(contract.LABEL_GROUP) == "kept", 45,
             "the label back on the re-created Deployment", 0.5)
    # Its template now breaks a rule (file gating needs a command): reported, and it is still
    # given back when the group goes.
    cluster.kubectl("patch", "deployment", "kept", "-n", namespace, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/template/spec/containers/0/command"}]))
    cluster.kubectl("annotate", "sgl", "kept", "-n", namespace, "example.com/poke=1")
    wait_for(lambda: stalled_reason(cluster, namespace, "kept") == "InvalidWorkload", 30, "InvalidWorkload", 0.2)
    delete_while_the_operator_runs(cluster, namespace, "kept")
    assert contract.LABEL_GROUP not in template_labels(cluster, namespace, "kept")


def test_the_operator_runs_while_its_webhook_cannot_start_and_is_ready_once_it_serves(
        cluster: Cluster, singleton_crd: Path, namespace: str, tmp_path: Path) -> None:
    configuration = "singleton-late-" + uuid.uuid4().hex[:6]
    port = free_port()
    operator = OperatorProcess(cluster.kubeconfig, namespace, tmp_path / "late.log", name="late",
                               extra_args=["--namespace", namespace, "--webhook-listen", f"127.0.0.1:{port}",
                                           "--webhook-extra-name", "127.0.0.1", "--webhook-config", configuration])
    operator.start()
    try:
        # Its MutatingWebhookConfiguration does not exist yet: the operator lives on (template
        # groups need no webhook), but is not Ready, saying why.
        body = wait_for(lambda: (answer := operator.get("/readyz"))[0] == 503 and "not found" in answer[1].lower()
                        and answer[1], 30, "/readyz 503 naming the missing configuration", 0.2)
        assert body.startswith("pod webhook: no certificate yet"), body
        assert operator.role() == "" and operator.alive()
        # Its certificate comes, but its port is taken: still not Ready, saying so.
        with socket.socket() as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", port))
            taken.listen()
            cluster.apply(json.dumps(webhook_configuration(configuration, namespace, port)))
            body = wait_for(lambda: (answer := operator.get("/readyz"))[0] == 503 and "listen" in answer[1]
                            and answer[1], 30, "/readyz 503 naming the taken port", 0.2)
            assert body.startswith(f"pod webhook: cannot listen on 127.0.0.1:{port}"), body
            assert "pod webhook cannot listen (--webhook-listen)" in operator.log()
        wait_for(lambda: operator.get("/readyz")[0] == 200, 60, "/readyz 200 once the webhook serves", 0.5)
        assert operator.alive()
    finally:
        operator.stop()
        cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration, "--ignore-not-found")
