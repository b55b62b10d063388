"""The objects table of charts/singleton/README.md, from what ``helm template`` renders.

The kind, name, scope and "installed" columns come from renders of the chart (the defaults,
then each optional part switched on); only the notes column is written by hand, and is kept by
(kind, name) when the table is written again. ``tests/integration/kube/test_chart.py`` fails when the README's
table differs from the render, so it cannot drift from the templates. To rewrite it (helm of
the test bed, or the one on PATH):

    .venv/bin/python -m tests.support.chart_objects --write
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import yaml

from tests.support.paths import REPO_ROOT

CHART = REPO_ROOT / "charts" / "singleton"
README = CHART / "README.md"
KUBE_VERSION = "1.34.0"
RELEASE = "x"
"""A release name without "singleton": the objects' names start with ``x-singleton``, which the
table writes as ``<fullname>``."""
BEGIN = "<!-- objects: written by `python -m tests.support.chart_objects --write` from helm template; notes by hand -->"
END = "<!-- end of objects -->"
TODO = "TODO: say what it is for"
MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor",
                   "monitoring.coreos.com/v1/PrometheusRule")

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("`serviceMonitor.enabled`", {"serviceMonitor": {"enabled": True}}),
    ("`monitoring.podMonitor.enabled`", {"monitoring": {"podMonitor": {"enabled": True}}}),
    ("`monitoring.prometheusRule.enabled`", {"monitoring": {"prometheusRule": {"enabled": True}}}),
    ("`monitoring.dashboard.enabled`", {"monitoring": {"dashboard": {"enabled": True}}}),
    ("`webhook.certManager.enabled`", {"webhook": {"certManager": {"enabled": True}}}),
]
"""The optional parts that add objects, each rendered alone (the monitoring APIs served)."""


@dataclass(frozen=True)
class Row:
    kind: str
    name: str
    scope: str
    installed: str
    notes: str = TODO

    def line(self) -> str:
        return f"| {self.kind} | `{self.name}` | {self.scope} | {self.installed} | {self.notes} |"


def helm_binary() -> str:
    found = shutil.which("helm")
    if found:
        return found
    from singleton_testbed.binaries import find

    return str(find("helm"))


def render(values: dict[str, Any], helm: str) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(values, file)
        file.flush()
        api_versions = [arg for api in MONITORING_APIS for arg in ("--api-versions", api)]
        result = subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", "singleton-system",
                                 "--kube-version", KUBE_VERSION, "--include-crds", "--values", file.name,
                                 *api_versions], capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"helm template failed: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    name = str(obj["metadata"]["name"]).replace(f"{RELEASE}-singleton", "<fullname>")
    # Every namespaced object of the chart names its namespace (tests/integration/kube/test_chart.py checks it).
    scope = "namespace" if obj["metadata"].get("namespace") else "cluster"
    return obj["kind"], name, scope


def rendered_rows(helm: str) -> list[Row]:
    """One row per object: those of the defaults, then those each variant adds."""
    installed: dict[tuple[str, str, str], str] = {key: "default" for key in map(_key, render({}, helm))}
    for label, values in VARIANTS:
        for key in map(_key, render(values, helm)):
            installed.setdefault(key, f"with {label}")
    return [Row(kind, name, scope, how) for (kind, name, scope), how in installed.items()]


def read_table(text: str) -> list[Row]:
    """The rows between the markers of the README."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{README.name} has no objects table between {BEGIN!r} and {END!r}")
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # after the header and its rule
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        kind, name, scope, installed, notes = cells
        rows.append(Row(kind, name.strip("`"), scope, installed, notes))
    return rows


def table(rows: list[Row]) -> str:
    header = ["| kind | name | scope | installed | notes |", "|---|---|---|---|---|"]
    return "\n".join([*header, *(row.line() for row in rows)])


def expected_rows(text: str, helm: str) -> list[Row]:
    """The rendered rows, each with the README's notes for its (kind, name), else ``TODO``."""
    notes = {(row.kind, row.name): row.notes for row in read_table(text)}
    return [Row(row.kind, row.name, row.scope, row.installed, notes.get((row.kind, row.name), TODO))
            for row in rendered_rows(helm)]


def rewritten(text: str, helm: str) -> str:
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n{table(expected_rows(text, helm))}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table of {README.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    text = README.read_text()
    if not args.write:
        print(table(expected_rows(text, helm_binary())))
        return 0
    new = rewritten(text, helm_binary())
    README.write_text(new)
    if TODO in new:
        print(f"rows without notes: write them in {README.relative_to(REPO_ROOT)} (marked {TODO!r})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
