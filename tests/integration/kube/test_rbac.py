"""Least privilege, proven on the real API server: the chart's operator ClusterRole/Role and a
group's sidecar Role (``sidecar_rbac_rules``) allow what each needs and refuse the rest, and
the chart's ValidatingAdmissionPolicy narrows a sidecar's "patch pods" to its own pod's
``singleton.dev/`` labels, annotations and leader condition.

Permissions are asked with ``kubectl auth can-i --as=system:serviceaccount:...`` (with the
service-account groups) and proven end to end with real service-account tokens.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_election import contract
from singleton_testbed.harness.kubehelpers import bound_token, get_json, grant, token_kubeconfig
from tests.conftest import Cluster
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

CHART = REPO_ROOT / "charts" / "singleton"
KUBE_VERSION = "1.34.0"  # the test bed's helm assumes v1.20 unless told (see tests/integration/kube/test_chart.py)
GROUP = "g1"
SIDECAR = f"singleton-sidecar-{GROUP}"
LEADER_CONDITION = contract.CONDITION_LEADER

Obj = dict[str, Any]


def helm_template(release: str, namespace: str, *args: str) -> list[Obj]:
    out = subprocess.run(["helm", "template", release, str(CHART), "--namespace", namespace,
                          "--kube-version", KUBE_VERSION, *args],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


SUBRESOURCES = frozenset({"status", "log", "exec", "eviction", "token", "approval"})


def can_i(cluster: Cluster, account: str, verb: str, resource: str, *args: str) -> bool:
    """``kubectl auth can-i`` as ``account`` ("namespace:name"), with the groups its token carries.
    ``resource`` is "type", "type/name" or "type/subresource" (one of SUBRESOURCES)."""
    namespace = account.split(":", maxsplit=1)[0]
    kind, _, rest = resource.partition("/")
    if rest in SUBRESOURCES:
        resource, args = kind, (*args, f"--subresource={rest}")
    result = cluster.kubectl("auth", "can-i", verb, resource, *args, f"--as=system:serviceaccount:{account}",
                             "--as-group=system:serviceaccounts", f"--as-group=system:serviceaccounts:{namespace}",
                             "--as-group=system:authenticated", check=False)
    answer = result.stdout.strip()
    # can-i exits 1 for "no", so its answer, not its status, is the verdict; anything but
    # "yes" or "no" is an error (a typo in a resource, an unreachable server).
    assert answer in ("yes", "no"), (result.stdout, result.stderr)
    return answer == "yes"


@dataclass
class Api:
    """Raw requests with one bearer token (kubectl cannot PATCH a subresource without a GET)."""

    server: str
    token: str
    context: ssl.SSLContext

    @classmethod
    def from_cluster(cls, cluster: Cluster, token: str) -> Api:
        config = json.loads(cluster.kubectl("config", "view", "--minify", "--raw", "-o", "json").stdout)
        spec = config["clusters"][0]["cluster"]
        context = ssl.create_default_context()
        if "certificate-authority-data" in spec:
            context.load_verify_locations(cadata=base64.b64decode(spec["certificate-authority-data"]).decode())
        elif "certificate-authority" in spec:
            context.load_verify_locations(cafile=spec["certificate-authority"])
        if spec.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return cls(spec["server"], token, context)

    def request(self, method: str, path: str, body: Obj | None = None,
                content_type: str = "application/merge-patch+json") -> tuple[int, Obj]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def patch_pod(self, namespace: str, pod: str, body: Obj, *, status: bool = False,
                  content_type: str = "application/merge-patch+json") -> tuple[int, Obj]:
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}" + ("/status" if status else "")
        return self.request("PATCH", path, body, content_type)


def create_pod_as(cluster: Cluster, namespace: str, name: str, account: str) -> Obj:
    """Like ``kubehelpers.create_pod`` (bound to a node with no kubelet, so it stays), but run
    by ``account``: a token can be bound only to a pod of its own service account."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": {"app": "demo"},
                        "annotations": {"note": "set by the test"}},
           "spec": {"serviceAccountName": account, "nodeName": "no-kubelet", "terminationGracePeriodSeconds": 30,
                    "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}
    created: Obj = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input_text=json.dumps(pod)).stdout)
    return created


def force_delete_pods(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", "--wait=false",
                    check=False)


# --- the operator -----------------------------------------------------------------------------


@dataclass
class Operator:
    account: str  # "namespace:name"
    namespace: str  # the release namespace
    workloads: str  # a namespace with SingletonServices


@pytest.fixture(scope="module")
def operator(cluster: Cluster, singleton_crd: Path) -> Iterator[Operator]:
    """The chart's ServiceAccount, ClusterRole(Binding) and Role(Binding), rendered and applied."""
    suffix = secrets.token_hex(3)
    release, namespace, workloads = f"rbac-{suffix}", f"t-rbac-operator-{suffix}", f"t-rbac-workloads-{suffix}"
    objects = helm_template(release, namespace, "--show-only", "templates/serviceaccount.yaml",
                            "--show-only", "templates/clusterrole.yaml", "--show-only", "templates/role.yaml")
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                                                 "ServiceAccount"]
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    cluster_scoped = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objects
                      if o["kind"].startswith("Cluster")]
    for ns in (namespace, workloads):
        cluster.kubectl("create", "namespace", ns)
    try:
        cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        yield Operator(f"{namespace}:{account}", namespace, workloads)
    finally:
        cluster.kubectl("delete", *cluster_scoped, "--ignore-not-found", check=False)
        for ns in (namespace, workloads):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


ALL = ("get", "list", "watch", "create", "update", "patch", "delete")

OPERATOR_NEEDS = [
    pytest.param("singletonservices.singleton.dev", ("get", "list", "watch", "patch", "update"), id="crs"),
    pytest.param("singletonservices.singleton.dev/status", ("get", "patch", "update"), id="cr-status"),
    pytest.param("deployments.apps", ALL, id="deployments"),
    pytest.param("statefulsets.apps", ("get", "list", "patch"), id="statefulsets"),
    pytest.param("serviceaccounts", ALL, id="serviceaccounts"),
    pytest.param("services", ALL, id="services"),
    pytest.param("roles.rbac.authorization.k8s.io", ALL, id="roles"),
    pytest.param("rolebindings.rbac.authorization.k8s.io", ALL, id="rolebindings"),
    pytest.param("poddisruptionbudgets.policy", ALL, id="pdbs"),
    pytest.param("pods", ("get", "list", "watch", "patch"), id="pods"),
    pytest.param("pods/status", ("patch",), id="pod-status"),
    pytest.param("secrets/some-postgres-secret", ("get",), id="secret-by-name"),
    pytest.param("leases.coordination.k8s.io", ("get", "list", "watch", "create", "update"), id="leases"),
    pytest.param("events", ("create", "patch"), id="events"),
    pytest.param("events.events.k8s.io", ("create", "patch"), id="events-k8s-io"),
]


@pytest.mark.parametrize(("resource", "verbs"), OPERATOR_NEEDS)
def test_operator_can(cluster: Cluster, operator: Operator, resource: str, verbs: tuple[str, ...]) -> None:
    refused = [v for v in verbs if not can_i(cluster, operator.account, v, resource, "-n", operator.workloads)]
    assert not refused, f"the operator may not {refused} {resource}"
    if {"list", "watch"} <= set(verbs):  # informers watch across namespaces
        assert can_i(cluster, operator.account, "watch", resource, "--all-namespaces")


@pytest.mark.parametrize(("verb", "resource"), [
    ("get", "customresourcedefinitions.apiextensions.k8s.io"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    ("get", "namespaces"),
    ("list", "namespaces"),
    ("watch", "namespaces"),
])
def test_operator_can_discover(cluster: Cluster, operator: Operator, verb: str, resource: str) -> None:
    assert can_i(cluster, operator.account, verb, resource)


def test_operator_own_lease(cluster: Cluster, operator: Operator) -> None:
    ns = ["-n", operator.namespace]
    for verb in ("get", "list", "watch", "update"):
        assert can_i(cluster, operator.account, verb, "leases.coordination.k8s.io/singleton-operator", *ns), verb
    assert can_i(cluster, operator.account, "create", "leases.coordination.k8s.io", *ns)


OPERATOR_REFUSED = [
    ("list", "secrets", "ns"),
    ("watch", "secrets", "ns"),
    ("create", "secrets", "ns"),
    ("update", "secrets", "ns"),
    ("delete", "secrets", "ns"),
    ("create", "pods", "ns"),
    ("delete", "pods", "ns"),
    ("update", "pods", "ns"),
    ("create", "pods/exec", "ns"),
    ("create", "pods/eviction", "ns"),
    ("get", "pods/log", "ns"),
    ("create", "serviceaccounts/token", "ns"),
    ("delete", "leases.coordination.k8s.io", "ns"),
    ("delete", "singletonservices.singleton.dev", "ns"),
    ("create", "singletonservices.singleton.dev", "ns"),
    ("create", "statefulsets.apps", "ns"),
    ("create", "configmaps", "ns"),
    ("escalate", "roles.rbac.authorization.k8s.io", "ns"),
    ("bind", "roles.rbac.authorization.k8s.io", "ns"),
    ("bind", "clusterroles.rbac.authorization.k8s.io", "ns"),
    ("patch", "nodes", "cluster"),
    ("delete", "namespaces", "cluster"),
    ("create", "namespaces", "cluster"),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", "cluster"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io", "cluster"),
    ("create", "clusterroles.rbac.authorization.k8s.io", "cluster"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", "cluster"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", "cluster"),
    ("update", "validatingadmissionpolicies.admissionregistration.k8s.io", "cluster"),
    ("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io", "cluster"),
    ("impersonate", "users", "cluster"),
    ("impersonate", "serviceaccounts", "ns"),
    ("update", "certificatesigningrequests/approval", "cluster"),
]


@pytest.mark.parametrize(("verb", "resource", "scope"), OPERATOR_REFUSED,
                         ids=[f"{v}-{r.split('.')[0]}" for v, r, _ in OPERATOR_REFUSED])
def test_operator_is_refused(cluster: Cluster, operator: Operator, verb: str, resource: str, scope: str) -> None:
    where = ["-n", operator.workloads] if scope == "ns" else []
    assert not can_i(cluster, operator.account, verb, resource, *where)


def test_operator_can_grant_exactly_the_sidecar_role(cluster: Cluster, operator: Operator) -> None:
    """RBAC lets a user create a Role only with rules it holds itself (no escalate here): the
    operator can create every group's sidecar Role and binding, and not a wider one."""
    as_operator = [f"--as=system:serviceaccount:{operator.account}",
                   "--as-group=system:serviceaccounts", "--as-group=system:authenticated"]
    name = "singleton-sidecar-" + secrets.token_hex(3)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": operator.workloads},
            "rules": contract.sidecar_rbac_rules(name.removeprefix("singleton-sidecar-"))}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": operator.workloads},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": operator.workloads}]}
    cluster.kubectl("create", *as_operator, "-f", "-", input_text=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [role, binding]}))
    wider = role | {"metadata": {"name": name + "-wider", "namespace": operator.workloads},
                    "rules": [*role["rules"], {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}]}
    denied = cluster.kubectl("create", *as_operator, "-f", "-", input_text=json.dumps(wider), check=False)
    assert denied.returncode != 0 and "attempting to grant RBAC permissions not currently held" in denied.stderr


def test_operator_real_token(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    namespace, account = operator.account.split(":")
    config = token_kubeconfig(cluster, bound_token(cluster, namespace, account), operator.workloads,
                              tmp_path / "operator.kubeconfig")
    cluster.kubectl("create", "secret", "generic", "db", "--from-literal=dsn=postgresql://x", "-n",
                    operator.workloads)
    got = cluster.kubectl("get", "secret", "db", "-o", "jsonpath={.data.dsn}", kubeconfig=config)
    assert base64.b64decode(got.stdout).decode() == "postgresql://x"
    listed = cluster.kubectl("get", "secrets", kubeconfig=config, check=False)
    assert listed.returncode != 0 and "cannot list resource \"secrets\"" in listed.stderr
    deleted = cluster.kubectl("delete", "secret", "db", kubeconfig=config, check=False)
    assert deleted.returncode != 0 and "cannot delete resource \"secrets\"" in deleted.stderr
    cluster.kubectl("create", "serviceaccount", "made-by-operator", kubeconfig=config)
    node = cluster.kubectl("label", "node", "any", "x=y", kubeconfig=config, check=False)
    assert node.returncode != 0 and "forbidden" in node.stderr


# --- a group's sidecar ------------------------------------------------------------------------


@pytest.fixture
def sidecar(cluster: Cluster, namespace: str) -> str:
    grant(cluster, namespace, SIDECAR, contract.sidecar_rbac_rules(GROUP))
    return f"{namespace}:{SIDECAR}"


SIDECAR_MAY = [
    ("get", f"leases.coordination.k8s.io/{GROUP}"),
    ("watch", f"leases.coordination.k8s.io/{GROUP}"),
    ("list", f"leases.coordination.k8s.io/{GROUP}"),
    ("update", f"leases.coordination.k8s.io/{GROUP}"),
    ("create", "leases.coordination.k8s.io"),
    ("get", "pods"),
    ("list", "pods"),
    ("watch", "pods"),
    ("patch", "pods"),
    ("create", "events"),
]

SIDECAR_REFUSED = [
    ("get", "leases.coordination.k8s.io/g2"),
    ("update", "leases.coordination.k8s.io/g2"),
    ("list", "leases.coordination.k8s.io"),
    ("delete", f"leases.coordination.k8s.io/{GROUP}"),
    ("patch", f"leases.coordination.k8s.io/{GROUP}"),
    ("get", "secrets"),
    ("get", "secrets/db"),
    ("list", "secrets"),
    ("delete", "pods"),
    ("create", "pods"),
    ("update", "pods"),
    ("create", "pods/exec"),
    ("create", "pods/eviction"),
    ("update", "deployments.apps"),
    ("patch", "singletonservices.singleton.dev"),
    ("create", "serviceaccounts/token"),
    ("patch", "events"),
    ("create", "roles.rbac.authorization.k8s.io"),
]


def test_sidecar_can(cluster: Cluster, sidecar: str, namespace: str) -> None:
    refused = [(v, r) for v, r in SIDECAR_MAY if not can_i(cluster, sidecar, v, r, "-n", namespace)]
    assert not refused
    assert can_i(cluster, sidecar, "patch", "pods/status", "-n", namespace)


def test_sidecar_is_refused(cluster: Cluster, sidecar: str, namespace: str) -> None:
    allowed = [(v, r) for v, r in SIDECAR_REFUSED if can_i(cluster, sidecar, v, r, "-n", namespace)]
    assert not allowed
    assert not can_i(cluster, sidecar, "get", "pods/status", "-n", namespace)
    # anything in another namespace, even its own group's Lease name
    for verb, resource in SIDECAR_MAY:
        assert not can_i(cluster, sidecar, verb, resource, "-n", "default"), (verb, resource)
    assert not can_i(cluster, sidecar, "list", "pods", "--all-namespaces")


def test_sidecar_real_token(cluster: Cluster, sidecar: str, namespace: str, tmp_path: Path) -> None:
    config = token_kubeconfig(cluster, bound_token(cluster, namespace, SIDECAR), namespace,
                              tmp_path / "sidecar.kubeconfig")
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": GROUP},
             "spec": {"holderIdentity": "me"}}
    cluster.kubectl("create", "-f", "-", input_text=json.dumps(lease), kubeconfig=config)
    read = json.loads(cluster.kubectl("get", "lease", GROUP, "-o", "json", kubeconfig=config).stdout)
    assert read["spec"]["holderIdentity"] == "me"
    cluster.kubectl("create", "-f", "-", "-n", namespace, input_text=json.dumps(
        lease | {"metadata": {"name": "g2"}}))
    other = cluster.kubectl("get", "lease", "g2", kubeconfig=config, check=False)
    assert other.returncode != 0 and 'cannot get resource "leases"' in other.stderr
    cluster.kubectl("create", "secret", "generic", "db", "--from-literal=dsn=x", "-n", namespace)
    secret = cluster.kubectl("get", "secret", "db", kubeconfig=config, check=False)
    assert secret.returncode != 0 and 'cannot get resource "secrets"' in secret.stderr
    elsewhere = cluster.kubectl("get", "pods", "-n", "default", kubeconfig=config, check=False)
    assert elsewhere.returncode != 0 and 'cannot list resource "pods"' in elsewhere.stderr


# --- the admission policy ---------------------------------------------------------------------


@dataclass
class PolicyBed:
    namespace: str
    pod_a: Obj
    pod_b: Obj
    api_a: Api  # the sidecar of pod A, with a token bound to pod A
    policy: str


def denied_by_policy(code: int, body: Obj, policy: str) -> str:
    message = str(body.get("message", ""))
    assert code == 403, (code, body)
    assert f"ValidatingAdmissionPolicy '{policy}'" in message, message
    return message


@pytest.fixture(scope="module")
def policy_bed(cluster: Cluster) -> Iterator[PolicyBed]:
    """Pods A and B of group g1 (service account singleton-sidecar-g1) in a namespace of their
    own, A's sidecar token, and the chart's policy bound to that namespace only (the cluster is
    shared). The tests only add singleton.dev/ keys to pod A, so they share one bed."""
    namespace = "t-rbac-policy-" + secrets.token_hex(3)
    release = "vap-" + secrets.token_hex(3)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values:
        yaml.safe_dump({"admissionPolicy": {"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": namespace}}}}, values)
        values.flush()
        objects = helm_template(release, namespace, "--values", values.name,
                                "--show-only", "templates/admission-policy.yaml")
    assert [o["kind"] for o in objects] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    policy = objects[0]["metadata"]["name"]
    cluster.kubectl("create", "namespace", namespace)
    try:
        cluster.kubectl("create", "serviceaccount", "default", "-n", namespace, check=False)
        grant(cluster, namespace, SIDECAR, contract.sidecar_rbac_rules(GROUP))
        pod_a = create_pod_as(cluster, namespace, "a", SIDECAR)
        pod_b = create_pod_as(cluster, namespace, "b", SIDECAR)
        api_a = Api.from_cluster(cluster, bound_token(cluster, namespace, SIDECAR, pod_a))
        cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        # The API server picks a new policy up within a moment: retry a request it must deny.
        deadline = time.monotonic() + 20
        while True:
            code, body = api_a.patch_pod(namespace, "b", {"metadata": {"annotations": {"singleton.dev/probe": "x"}}})
            if code == 403 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        denied_by_policy(code, body, policy)
        yield PolicyBed(namespace, pod_a, pod_b, api_a, policy)
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy,
                        "--ignore-not-found", check=False)
        force_delete_pods(cluster, namespace)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def own_metadata(role: str) -> Obj:
    return {"metadata": {"annotations": {contract.ANNOTATION_ROLE: role, contract.ANNOTATION_TOKEN: "7",
                                         "controller.kubernetes.io/pod-deletion-cost": "100"},
                         "labels": {contract.LABEL_ROLE: role, contract.LABEL_GROUP: GROUP}}}


def test_policy_lets_a_sidecar_label_its_own_pod(policy_bed: PolicyBed) -> None:
    bed = policy_bed
    code, pod = bed.api_a.patch_pod(bed.namespace, "a", own_metadata("leader"))
    assert code == 200, pod
    assert pod["metadata"]["labels"][contract.LABEL_ROLE] == "leader"
    assert pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "100"
    # removing its own keys is fine too
    code, pod = bed.api_a.patch_pod(bed.namespace, "a", {"metadata": {"annotations": {
        contract.ANNOTATION_TOKEN: None}}})
    assert code == 200 and contract.ANNOTATION_TOKEN not in pod["metadata"]["annotations"], pod


@pytest.mark.parametrize(("patch", "says"), [
    pytest.param({"metadata": {"labels": {"app": "other"}}}, "only labels under singleton.dev/ on its pod, not: app",
                 id="other-label"),
    pytest.param({"metadata": {"labels": {"app": None}}}, "not: app", id="remove-label"),
    pytest.param({"metadata": {"labels": {"singleton.dev/role": "leader", "team": "x"}}}, "not: team",
                 id="add-label-beside-own"),
    pytest.param({"metadata": {"annotations": {"note": "changed"}}}, "annotations under singleton.dev/",
                 id="annotation"),
    pytest.param({"metadata": {"annotations": {"singleton.dev.evil/x": "1"}}}, "not: singleton.dev.evil/x",
                 id="lookalike-prefix"),
    pytest.param({"spec": {"activeDeadlineSeconds": 30}}, "may not change its pod's spec", id="spec"),
    pytest.param({"metadata": {"finalizers": ["example.com/block"]}}, "finalizers", id="finalizer"),
])
def test_policy_denies_other_changes_to_its_own_pod(policy_bed: PolicyBed, patch: Obj, says: str) -> None:
    bed = policy_bed
    code, body = bed.api_a.patch_pod(bed.namespace, "a", patch)
    assert says in denied_by_policy(code, body, bed.policy)


def test_policy_denies_another_pod(policy_bed: PolicyBed) -> None:
    bed = policy_bed
    code, body = bed.api_a.patch_pod(bed.namespace, "b", own_metadata("leader"))
    message = denied_by_policy(code, body, bed.policy)
    assert f"may change only its own pod: its token is bound to pod a, not to {bed.namespace}/b" in message
    code, body = bed.api_a.patch_pod(bed.namespace, "b", {"status": {"conditions": [
        {"type": LEADER_CONDITION, "status": "True"}]}}, status=True,
        content_type="application/strategic-merge-patch+json")
    denied_by_policy(code, body, bed.policy)


def test_policy_status_only_the_leader_condition(policy_bed: PolicyBed) -> None:
    bed = policy_bed
    smp = "application/strategic-merge-patch+json"
    for status in ("True", "False"):
        code, pod = bed.api_a.patch_pod(bed.namespace, "a", {"status": {"conditions": [
            {"type": LEADER_CONDITION, "status": status, "reason": "Test"}]}}, status=True, content_type=smp)
        assert code == 200, pod
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}[LEADER_CONDITION] == status
    code, body = bed.api_a.patch_pod(bed.namespace, "a", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}}, status=True, content_type=smp)
    assert "only the pod condition singleton.dev/leader, not: Ready" in denied_by_policy(code, body, bed.policy)
    code, body = bed.api_a.patch_pod(bed.namespace, "a", {"status": {"phase": "Failed"}}, status=True)
    assert "status other than the condition" in denied_by_policy(code, body, bed.policy)
    code, body = bed.api_a.patch_pod(bed.namespace, "a", {"metadata": {"labels": {"app": "x"}}}, status=True)
    assert "not: app" in denied_by_policy(code, body, bed.policy)


def test_policy_needs_a_token_bound_to_a_pod(cluster: Cluster, policy_bed: PolicyBed) -> None:
    bed = policy_bed
    unbound = Api.from_cluster(cluster, bound_token(cluster, bed.namespace, SIDECAR))
    code, body = unbound.patch_pod(bed.namespace, "a", own_metadata("leader"))
    assert "token bound to its own pod" in denied_by_policy(code, body, bed.policy)


def test_policy_leaves_everyone_else_alone(cluster: Cluster, policy_bed: PolicyBed) -> None:
    bed = policy_bed
    change = {"metadata": {"labels": {"app": "changed"}, "annotations": {"note": "changed"}}}
    cluster.kubectl("patch", "pod", "b", "-n", bed.namespace, "--type=merge", "-p", json.dumps(change))
    assert get_json(cluster, "pod", "b", "-n", bed.namespace)["metadata"]["labels"]["app"] == "changed"
    # another service account (not singleton-sidecar-*) with the very same Role
    grant(cluster, bed.namespace, "other-app", contract.sidecar_rbac_rules(GROUP))
    other = Api.from_cluster(cluster, bound_token(cluster, bed.namespace, "other-app"))
    code, pod = other.patch_pod(bed.namespace, "b", {"metadata": {"labels": {"app": "again"}}})
    assert code == 200 and pod["metadata"]["labels"]["app"] == "again", pod
