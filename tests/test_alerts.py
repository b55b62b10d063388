"""The chart's alerts as the chart ships them: the PrometheusRule that ``helm template`` renders
from charts/singleton/files/alerts.yaml, checked by ``promtool check rules`` and unit-tested by
``promtool test rules`` (tests/data/alerts_test.yaml: each alert fires when it should and stays
silent when it should not). promtool is built from Go modules (testbed/build-prometheus.sh).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from singleton_testbed.binaries import find_prometheus
from tests.monitoring import COLD_BUILD, METRIC_NAME, check_rules, exported_metric_names
from tests.test_chart import needs_helm, one, render, template

ROOT = Path(__file__).resolve().parent.parent
ALERTS_FILE = ROOT / "charts" / "singleton" / "files" / "alerts.yaml"
UNIT_TESTS = ROOT / "tests" / "data" / "alerts_test.yaml"
RULE_VALUES = {"monitoring": {"prometheusRule": {"enabled": True, "force": True}}}

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
def test_the_chart_ships_the_alerts_file_as_is_but_for_durations(tmp_path: Path) -> None:
    assert yaml.safe_load(ALERTS_FILE.read_text()) == shipped_rules(tmp_path)


def test_every_alert_uses_only_metrics_our_code_exports() -> None:
    exported = exported_metric_names()
    for rule in alerts(yaml.safe_load(ALERTS_FILE.read_text())):
        used = set(METRIC_NAME.findall(rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)


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
