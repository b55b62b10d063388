"""The chart's alerts as the chart ships them: the PrometheusRule that ``helm template`` renders
from charts/singleton/files/alerts.yaml, checked by ``promtool check rules`` and unit-tested by
``promtool test rules`` (tests/data/alerts_test.yaml: each alert fires when it should and stays
silent when it should not). promtool is built from Go modules (testbed/build-prometheus.sh).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_testbed.binaries import find_prometheus
from singleton_testbed.harness.sidecars import wait_for
from tests.conftest import Cluster
from tests.integration.kube.test_chart import needs_helm, one, render, template
from tests.support.monitoring import COLD_BUILD, METRIC_NAME, check_rules, exported_metric_names
from tests.support.paths import REPO_ROOT

ALERTS_FILE = REPO_ROOT / "charts" / "singleton" / "files" / "alerts.yaml"
UNIT_TESTS = REPO_ROOT / "tests" / "data" / "alerts_test.yaml"
RUNBOOK = REPO_ROOT / "docs" / "runbook.md"
RULE_VALUES = {"monitoring": {"prometheusRule": {"enabled": True, "force": True}}}
DOCS_URL = "https://github.com/singleton-dev/singleton/blob/main/docs"
"""The chart's default monitoring.prometheusRule.docsUrl: the repository (Chart.yaml's home) on main."""
OPERATOR_JOB = "singleton-operator"
"""The job the chart's ServiceMonitor gives the operator's scrape."""
WEBHOOK_NAME = "pods.singleton.dev"
EXTERNAL_METRICS = {
    "up": "Prometheus, per scrape target",
    "apiserver_admission_webhook_rejection_count": "the API server (kube-apiserver's /metrics)",
    "apiserver_admission_webhook_fail_open_count": "the API server",
}
"""Series that our code does not export, that the alerts read: Prometheus' own and the API server's."""

Obj = dict[str, Any]


@pytest.fixture(scope="session")
def promtool() -> Path:
    return find_prometheus("promtool")


def shipped_rules(tmp_path: Path, values: Obj | None = None) -> Obj:
    """The ``spec`` of the PrometheusRule the chart renders (with ``values`` merged in)."""
    merged: Obj = {"monitoring": {"prometheusRule": {**RULE_VALUES["monitoring"]["prometheusRule"],
                                                      **((values or {}).get("prometheusRule") or {})}}}
    spec: Obj = one(render(tmp_path, merged), "PrometheusRule")["spec"]
    return spec


def alerts(rules: Obj) -> list[Obj]:
    return [rule for group in rules["groups"] for rule in group["rules"]]


def run_unit_tests(promtool: Path, rules: Obj, folder: Path) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "alerts.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(UNIT_TESTS, folder / UNIT_TESTS.name)
    return subprocess.run([str(promtool), "test", "rules", UNIT_TESTS.name], cwd=folder, capture_output=True,
                          text=True, timeout=120, check=False)


@needs_helm
def test_the_chart_ships_the_alerts_file_as_is_but_for_durations_and_the_docs_url(tmp_path: Path) -> None:
    assert yaml.safe_load(ALERTS_FILE.read_text()) == shipped_rules(tmp_path)
    # Another docs URL changes only where each runbook_url points, keeping its anchor.
    moved = shipped_rules(tmp_path, {"prometheusRule": {"docsUrl": "https://docs.example/singleton/v0.1/"}})
    expected = yaml.safe_load(ALERTS_FILE.read_text())
    for rule in alerts(expected):
        anchor = rule["annotations"]["runbook_url"].split("#")[1]
        rule["annotations"]["runbook_url"] = f"https://docs.example/singleton/v0.1/runbook.md#{anchor}"
    assert moved == expected


def runbook_anchors() -> set[str]:
    """The anchors GitHub gives docs/runbook.md's headings: lower case, punctuation but hyphens
    dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_alert_links_a_section_of_the_runbook() -> None:
    anchors = runbook_anchors()
    # The slug rule, on headings with punctuation and code: what GitHub makes of them.
    assert {"no-leader", "two-leader-alert", "the-operator-cannot-reach-the-database-postgresunreachable"} <= anchors
    linked = {}
    for rule in alerts(yaml.safe_load(ALERTS_FILE.read_text())):
        url = rule["annotations"].get("runbook_url")
        assert url, f"{rule['alert']} has no runbook_url"
        base, anchor = url.split("#")
        assert base == f"{DOCS_URL}/runbook.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: docs/runbook.md has no heading with the anchor #{anchor}"
        linked[rule["alert"]] = anchor
        # The runbook names the alert it is about, in the section its URL opens.
        section = RUNBOOK.read_text().split("\n## ")
        text = next(part for part in section if re.sub(r"[^\w\- ]", "", part.split("\n")[0].strip().lower())
                    .replace(" ", "-") == anchor)
        assert rule["alert"] in text, f"the runbook's #{anchor} does not mention {rule['alert']}"
    assert len(set(linked.values())) == len(linked), f"alerts sharing a runbook section: {linked}"


@needs_helm
def test_the_docs_url_is_checked_by_the_schema(tmp_path: Path) -> None:
    for bad in ("docs.example/singleton", "ftp://docs.example", "https://docs.example/runbook.md#x"):
        result = template(tmp_path, {"monitoring": {"prometheusRule": {**RULE_VALUES["monitoring"]["prometheusRule"],
                                                                       "docsUrl": bad}}}, check=False)
        assert result.returncode != 0, bad
        assert f"at '/monitoring/prometheusRule/docsUrl': '{bad}' does not match pattern" in result.stderr, \
            result.stderr


def test_every_alert_uses_only_metrics_our_code_exports_or_named_outside_ones() -> None:
    exported = exported_metric_names()
    for rule in alerts(yaml.safe_load(ALERTS_FILE.read_text())):
        used = set(METRIC_NAME.findall(rule["expr"]))
        outside = {name for name in EXTERNAL_METRICS if re.search(rf"\b{name}\s*[{{(]", rule["expr"])}
        assert used or outside, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)
        unknown = set(re.findall(r"\b(apiserver_[a-z_]+)\b", rule["expr"])) - set(EXTERNAL_METRICS)
        assert not unknown, (rule["alert"], unknown)


@needs_helm
def test_the_outside_series_are_selected_as_the_chart_names_them(tmp_path: Path) -> None:
    """OperatorDown reads the job the chart's ServiceMonitor sets; WebhookFailing the webhook's name."""
    rules = {rule["alert"]: rule["expr"] for rule in alerts(yaml.safe_load(ALERTS_FILE.read_text()))}
    assert f'up{{job="{OPERATOR_JOB}"}}' in rules["SingletonOperatorDown"]
    assert rules["SingletonWebhookFailing"].count(f'name="{WEBHOOK_NAME}"') == 3
    objects = render(tmp_path, {"serviceMonitor": {"enabled": True, "force": True}})
    endpoint = one(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": OPERATOR_JOB}]
    assert endpoint["honorLabels"] is True
    assert [hook["name"] for hook in one(objects, "MutatingWebhookConfiguration")["webhooks"]] == [WEBHOOK_NAME]


def test_every_alert_has_a_case_that_fires_and_one_that_stays_silent() -> None:
    names = {rule["alert"] for rule in alerts(yaml.safe_load(ALERTS_FILE.read_text()))}
    cases = [case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    fires = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fires == names
    assert silent == names


@COLD_BUILD
@needs_helm
def test_promtool_check_rules_accepts_the_shipped_rules(promtool: Path, tmp_path: Path) -> None:
    result = check_rules(promtool, shipped_rules(tmp_path), tmp_path / "alerts.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    count = len(alerts(yaml.safe_load(ALERTS_FILE.read_text())))
    assert f"SUCCESS: {count} rules found" in result.stdout + result.stderr


@COLD_BUILD
@needs_helm
def test_promtool_unit_tests_pass_on_the_shipped_rules(promtool: Path, tmp_path: Path) -> None:
    result = run_unit_tests(promtool, shipped_rules(tmp_path), tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


@COLD_BUILD
@needs_helm
def test_a_longer_for_from_values_reaches_the_rule_and_the_unit_tests_see_it(promtool: Path,
                                                                             tmp_path: Path) -> None:
    """The unit tests are not blind: NoLeader waiting 5m instead of 1m no longer fires at 4m."""
    rules = shipped_rules(tmp_path, {"prometheusRule": {"for": {"SingletonNoLeader": "5m"}}})
    assert {rule["alert"]: rule["for"] for rule in alerts(rules)}["SingletonNoLeader"] == "5m"
    result = run_unit_tests(promtool, rules, tmp_path / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    failed = result.stdout + result.stderr
    assert "alertname: SingletonNoLeader" in failed and "FAILED" in failed, failed


@needs_helm
def test_an_unknown_alert_name_in_values_is_refused(tmp_path: Path) -> None:
    result = template(tmp_path, {"monitoring": {"prometheusRule": {"enabled": True, "force": True,
                                                                   "for": {"SingletonNoLeaders": "2m"}}}},
                      check=False)
    assert result.returncode != 0
    assert "monitoring.prometheusRule.for: no alert named SingletonNoLeaders (the alerts: SingletonNoLeader," \
        in result.stderr, result.stderr


def apiserver_series(cluster: Cluster, metric: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``metric`` on the API server's /metrics, read line by line (prometheus_client's
    parser files a counter named ``..._count`` under another name)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    found = []
    for line in text.splitlines():
        match = re.fullmatch(rf"{metric}\{{(.*)\}} (\S+)", line)
        if match:
            found.append((dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))), float(match.group(2))))
    return found


@pytest.mark.k8s
@pytest.mark.parametrize(("policy", "metric", "selector"), [
    ("Fail", "apiserver_admission_webhook_rejection_count", {"error_type": "calling_webhook_error"}),
    ("Ignore", "apiserver_admission_webhook_fail_open_count", {}),
])
def test_the_api_server_counts_a_failing_webhook_as_webhook_failing_selects_it(
    cluster: Cluster, namespace: str, policy: str, metric: str, selector: dict[str, str]
) -> None:
    """The series and labels SingletonWebhookFailing reads are the real API server's: a webhook
    named like ours, pointed at a Service that does not exist, scoped to one label of this test
    (no other pod reaches it), counted under that name."""
    token = uuid.uuid4().hex[:8]
    configuration = f"sgl-unreachable-{token}"
    hook = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": configuration},
            "webhooks": [{"name": WEBHOOK_NAME, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": policy, "timeoutSeconds": 2,
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                     "resources": ["pods"], "scope": "Namespaced"}],
                          "objectSelector": {"matchLabels": {"singleton-test/unreachable-webhook": token}},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                          "clientConfig": {"service": {"name": "no-such-service", "namespace": namespace,
                                                       "path": "/mutate-pods", "port": 443}}}]}
    wanted = {"name": WEBHOOK_NAME, **selector}

    def counted() -> float:
        return sum(value for labels, value in apiserver_series(cluster, metric)
                   if all(labels.get(k) == v for k, v in wanted.items()))

    before = counted()
    cluster.apply(json.dumps(hook))
    try:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "labels": {"singleton-test/unreachable-webhook": token}},
               "spec": {"containers": [{"name": "c", "image": "example.invalid/app:1"}]}}

        def created() -> bool | None:
            # The configuration reaches the API server's webhook cache within a second or so.
            result = cluster.kubectl("create", "-n", namespace, "-f", "-", input_text=json.dumps(pod), check=False)
            if policy == "Fail":
                return (result.returncode != 0 and f'failed calling webhook "{WEBHOOK_NAME}"' in result.stderr) or None
            if result.returncode == 0 and counted() > before:
                return True
            cluster.kubectl("delete", "pod", "p", "-n", namespace, "--ignore-not-found", "--wait=false")
            return None

        wait_for(created, 30, f"a pod {'refused' if policy == 'Fail' else 'let through'} by the webhook", 0.5)
        assert counted() >= before + 1, apiserver_series(cluster, metric)
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", configuration, "--ignore-not-found")
