"""What GitOps tools see (docs/gitops.md): the Argo CD health check shipped in the docs, run
in Lua 5.1 (Argo CD's gopher-lua speaks 5.1) against the statuses the operator computes, and
Helm 3's ``--wait``, which does not wait for custom resources."""

from __future__ import annotations

import datetime as dt
import json
import re
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

from singleton_election import contract
from singleton_operator.model.spec import read_spec
from singleton_operator.model.status import Observed, compute_status, spec_error_status
from singleton_testbed.harness.kubehelpers import get_json
from tests.conftest import Cluster
from tests.support.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "gitops.md"
HEALTH_KEY = "resource.customizations.health.singleton.dev_SingletonService"
NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def health_check() -> str:
    """The Lua of the argocd-cm block of docs/gitops.md, exactly as shipped."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    configs = [doc for block in blocks for doc in yaml.safe_load_all(block)
               if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "argocd-cm"]
    assert len(configs) == 1, "docs/gitops.md must ship one argocd-cm block"
    script: str = configs[0]["data"][HEALTH_KEY]
    return script


def argo_health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD's health check would return them: the script is the body of
    a function of ``obj`` (Argo CD wraps it the same way)."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    check = lua.eval(f"function(obj)\n{health_check()}\nend")
    result = check(lua.table_from(json.loads(json.dumps(obj)), recursive=True))
    return str(result["status"]), str(result["message"])


def pod(name: str, role: str, token: int | None = None, *, ready: bool = True) -> dict[str, Any]:
    annotations = {contract.ANNOTATION_ROLE: role}
    if token is not None:
        annotations |= {contract.ANNOTATION_TOKEN: str(token), contract.ANNOTATION_LEADER_SINCE: "2026-11-26T11:00:00Z"}
    return {"metadata": {"name": name, "annotations": annotations},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}}


def deployment(updated: int = 2) -> dict[str, Any]:
    return {"metadata": {"generation": 4}, "status": {"observedGeneration": 4, "updatedReplicas": updated,
                                                       "replicas": 2, "availableReplicas": 2}}


def group(generation: int, observed: Observed, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """A SingletonService of ``generation`` with the status the operator computes for it."""
    metadata = {"name": "feed", "namespace": "ns", "uid": "u-1", "generation": generation}
    body = {"metadata": metadata, "spec": {"replicas": 2, "template": {"spec": {"containers": [
        {"name": "app", "image": "app:1"}]}}}}
    status = compute_status(read_spec(body, default_sidecar_image="img"), observed, previous or {}, NOW)
    return {**body, "status": {k: v for k, v in status.items() if v is not None}}


LEADING = [pod("a", "leader", 7), pod("b", "standby")]


@pytest.mark.parametrize(("obj", "health", "message"), [
    pytest.param(group(3, Observed(LEADING, deployment(), applied_generation=3)), "Healthy",
                 "Ready: generation 3 applied and rolled out; pod a leads", id="ready"),
    pytest.param({"metadata": {"generation": 1}}, "Progressing", "waiting for the operator's first status",
                 id="no-status-yet"),
    pytest.param(group(3, Observed(LEADING, deployment(updated=1), applied_generation=3)), "Progressing",
                 "RollingOut: rolling out: 1/2 updated, 2 available, 2 in total", id="rolling-out"),
    pytest.param(group(3, Observed([pod("a", "standby"), pod("b", "standby")], deployment(), applied_generation=3)),
                 "Progressing", "NoLeader: no replica leads", id="leaderless"),
    pytest.param(group(3, Observed([pod("a", "leader", 7, ready=False), pod("b", "standby")], deployment(),
                                   applied_generation=3)),
                 "Progressing", "LeaderNotReady: pod a leads but is not Ready", id="leader-not-ready"),
    pytest.param(group(4, Observed(LEADING, deployment(), applied_generation=3)), "Progressing",
                 "generation 4 is not applied yet", id="newer-generation-not-applied"),
    pytest.param(group(4, Observed(LEADING, deployment(), problem="the API server refused Deployment feed: x",
                                   problem_reason="InvalidTemplate", applied_generation=3)),
                 "Degraded", "InvalidTemplate: the API server refused Deployment feed: x", id="apply-failed"),
    pytest.param(group(1, Observed([], None, problem="Secret ns/db does not exist", problem_reason="SecretNotFound")),
                 "Degraded", "SecretNotFound: Secret ns/db does not exist", id="new-group-missing-secret"),
])
def test_the_argo_cd_health_check_of_the_docs_reads_the_operators_status(obj: dict[str, Any], health: str,
                                                                         message: str) -> None:
    assert argo_health(obj) == (health, message)


def test_the_argo_cd_health_check_sees_a_spec_the_operator_cannot_read_as_degraded() -> None:
    running = group(3, Observed(LEADING, deployment(), applied_generation=3))
    stalled = {**running, "metadata": {**running["metadata"], "generation": 4},
               "status": spec_error_status(4, "InvalidSpec", "spec.sidecar.port: must be from 1 to 65534",
                                           running["status"], NOW)}
    assert argo_health(stalled) == ("Degraded", "InvalidSpec: spec.sidecar.port: must be from 1 to 65534")


def test_helm_3_wait_does_not_wait_for_a_singleton_service(cluster: Cluster, singleton_crd: Path, namespace: str,
                                                           tmp_path: Path) -> None:
    """What docs/gitops.md says of Helm 3: a chart holding a group that can never become Ready
    (no operator runs here) installs with --wait at once."""
    chart = tmp_path / "poller"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: poller\nversion: 0.1.0\n")
    sgl = {"apiVersion": "singleton.dev/v1alpha1", "kind": "SingletonService", "metadata": {"name": "poller"},
           "spec": {"template": {"spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]}}}}
    (chart / "templates" / "sgl.yaml").write_text(yaml.safe_dump(sgl))
    release = "wait-" + secrets.token_hex(3)
    started = time.monotonic()
    result = subprocess.run(["helm", "install", release, str(chart), "-n", namespace, "--wait", "--timeout", "60s"],
                            capture_output=True, text=True, env=cluster.env, check=False, timeout=120)
    elapsed = time.monotonic() - started
    try:
        assert result.returncode == 0, result.stderr
        assert elapsed < 30, elapsed
        obj = get_json(cluster, "sgl", "poller", "-n", namespace)
        assert not (obj.get("status") or {}).get("conditions"), "nothing made it Ready"
    finally:
        subprocess.run(["helm", "uninstall", release, "-n", namespace], capture_output=True, env=cluster.env,
                       check=False, timeout=120)
