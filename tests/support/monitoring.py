"""What the monitoring tests share: the metric names our code exports, and promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from singleton_operator.metrics import OperatorMetrics
from singleton_sidecar.metrics import SidecarMetrics

METRIC_NAME = re.compile(r"\b(singleton_[a-z_]+)\b")
COLD_BUILD = pytest.mark.timeout(1800)
"""For the tests that use promtool: the first one may build it (minutes)."""


def exported_families() -> dict[str, str]:
    """Metric family name to type, from the sidecar's and the operator's registries."""
    registries: list[CollectorRegistry] = [SidecarMetrics("g", "lease").registry, OperatorMetrics().registry]
    return {family.name: family.type for registry in registries for family in registry.collect()}


def exported_metric_names() -> set[str]:
    """The series names our code exposes (counters with _total, histograms' _bucket, _sum, _count)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name + suffix for name, kind in exported_families().items() for suffix in suffixes[kind]}


def check_rules(promtool: Path, rules: dict[str, Any], path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on ``rules`` written to ``path``."""
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
