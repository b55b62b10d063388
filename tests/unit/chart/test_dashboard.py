"""The Grafana dashboard the chart ships (charts/singleton/dashboards/singleton.json): a
dashboard Grafana can load, every query parses as PromQL (promtool, as recording rules) and
reads only metrics our code exports, and every exported metric is on it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from singleton_testbed.binaries import find_prometheus
from tests.support.monitoring import COLD_BUILD, METRIC_NAME, check_rules, exported_families, exported_metric_names
from tests.support.paths import REPO_ROOT

DASHBOARD = REPO_ROOT / "charts" / "singleton" / "dashboards" / "singleton.json"
PANEL_TYPES = {"row", "timeseries", "stat", "table"}
GRID_WIDTH = 24
# What Grafana substitutes before a query reaches Prometheus: its interval variables take a
# duration, the dashboard's multi-value variables a regex.
SUBSTITUTIONS = {"$__rate_interval": "5m", "$namespace": ".*", "$group": ".*"}
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+), )?(?P<label>[a-z_]+)\)$")

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def dashboard() -> Obj:
    loaded: Obj = json.loads(DASHBOARD.read_text())
    return loaded


def panels(dashboard: Obj) -> list[Obj]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def queries(dashboard: Obj) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every variable's label_values selector."""
    found = [(f"panel {panel['id']} {target['refId']}", target["expr"])
             for panel in panels(dashboard) for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match and match["selector"], f"variable {variable['name']}: not label_values(selector, label)"
            found.append((f"variable {variable['name']}", match["selector"]))
    return found


def promql(expr: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def test_the_dashboard_has_what_grafana_needs(dashboard: Obj) -> None:
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"], panel["id"]
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


def test_every_query_reads_only_exported_metrics_and_every_metric_is_shown(dashboard: Obj) -> None:
    exported = exported_metric_names()
    used: set[str] = set()
    for where, expr in queries(dashboard):
        names = set(METRIC_NAME.findall(expr))
        assert names, f"{where}: no singleton metric in {expr}"
        assert names <= exported, f"{where}: not exported: {sorted(names - exported)}"
        used |= names
    shown = {name for name in exported_families() if any(metric.startswith(name) for metric in used)}
    assert shown == set(exported_families()), f"not on the dashboard: {sorted(set(exported_families()) - shown)}"


@COLD_BUILD
def test_every_query_parses(dashboard: Obj, tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{index}", "expr": promql(expr)}
        for index, (_, expr) in enumerate(queries(dashboard))]}]}
    result = check_rules(find_prometheus("promtool"), rules, tmp_path / "dashboard-rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules['groups'][0]['rules'])} rules found" in result.stdout + result.stderr
