"""The metrics' own bookkeeping: terms won and the lock seen held (sidecar), per-group series
dropped with their group (operator); the sidecar's exposition format per ``Accept``, and its
loading of prometheus_client's core only. What they export over HTTP is tested across the real
boundary in test_sidecar_postgres.py and test_operator.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from singleton_election.core.lock import Identity, Term, Token
from singleton_election.core.status import ElectionStatus, Role
from singleton_operator.metrics import OperatorMetrics
from singleton_sidecar.metrics import SidecarMetrics

ME, OTHER = Identity("me"), Identity("other")


def status(role: Role, leader: Identity | None, token: int | None = None) -> ElectionStatus:
    term = Term(identity=ME, token=Token(token), version=str(token)) if token is not None else None
    return ElectionStatus(group="g", identity=ME, role=role, term=term, leader=leader, leader_token=None,
                          leader_since=None, transitions=0, reason="test")


def value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"group": "g", "backend": "lease"})


def test_a_term_counts_once_from_leader_through_draining_and_the_lock_follows_the_observed_holder() -> None:
    metrics = SidecarMetrics("g", "lease")
    seen = []
    for step in (status(Role.STANDBY, None), status(Role.STANDBY, OTHER), status(Role.LEADER, ME, 1),
                 status(Role.DRAINING, ME, 1), status(Role.STANDBY, None), status(Role.LEADER, ME, 2)):
        metrics.on_status(step)
        seen.append((value(metrics.registry, "singleton_terms_total"), value(metrics.registry, "singleton_lock_held")))
    assert seen == [(0, 0), (0, 1), (1, 1), (1, 1), (1, 0), (2, 1)]


def test_a_forgotten_group_loses_its_series() -> None:
    metrics = OperatorMetrics()
    for group in ("a", "b"):
        metrics.reconcile_failed("feeds", group, "SecretNotFound")
        metrics.leader_changes.labels("feeds", group).inc()
        metrics.group_leaders.labels("feeds", group).set(1)
    metrics.reconcile_failed("feeds", "a", "InvalidSpec")
    metrics.forget("feeds", "a")
    errors = {tuple(sample.labels.values()) for family in metrics.registry.collect() for sample in family.samples
              if sample.name == "singleton_operator_reconcile_errors_total"}
    assert errors == {("feeds", "b", "SecretNotFound")}
    assert metrics.registry.get_sample_value("singleton_operator_leader_changes_total",
                                             {"namespace": "feeds", "group": "a"}) is None
    assert metrics.registry.get_sample_value("singleton_operator_leader_changes_total",
                                             {"namespace": "feeds", "group": "b"}) == 1
    assert metrics.registry.get_sample_value("singleton_group_leaders", {"namespace": "feeds", "group": "a"}) is None
    assert metrics.registry.get_sample_value("singleton_group_leaders", {"namespace": "feeds", "group": "b"}) == 1
    metrics.forget("feeds", "never-seen")  # a group without series is fine


@pytest.mark.parametrize(("accept", "openmetrics"), [
    ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),  # Prometheus 2
    ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.3,"
     "*/*;q=0.2", True),  # Prometheus 3
    ("Application/OpenMetrics-Text; version=1.0.0", True),
    ("application/openmetrics-text; q=0.5, text/plain", True),
    ("application/openmetrics-text;q=0.000,text/plain;version=0.0.4", False),  # q=0: not acceptable
    ("*/*", False),  # curl
    ("text/plain;version=0.0.4", False),
    ("", False),
])
def test_openmetrics_is_served_to_whoever_lists_it(accept: str, openmetrics: bool) -> None:
    body, content_type = SidecarMetrics("g", "lease").render(accept)
    if openmetrics:
        assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert body.endswith(b"# EOF\n")
    else:
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert b"# EOF" not in body
    assert b'singleton_is_leader{backend="lease",group="g"} 0.0\n' in body


PACKAGE_ON_DEMAND = """
import sys, threading
from singleton_sidecar.package_parts import without_init
without_init("prometheus_client")
from singleton_sidecar.metrics import SidecarMetrics
metrics = SidecarMetrics("g", "lease")
metrics.render("application/openmetrics-text")
heavy = ("prometheus_client.exposition", "urllib.request", "http.server", "wsgiref")
print(sorted(m for m in heavy if m in sys.modules))
import prometheus_client
print(prometheus_client.parser.__name__, "prometheus_client.exposition" in sys.modules)  # a submodule alone
found = []
def use() -> None:
    from prometheus_client import REGISTRY, generate_latest
    found.append(generate_latest(REGISTRY)[:6].decode())
threads = [threading.Thread(target=use) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(found)
from prometheus_client import Counter
print(Counter is sys.modules["prometheus_client.metrics"].Counter, prometheus_client.exposition.__name__)
"""


def test_the_sidecar_loads_prometheus_clients_core_and_the_package_still_loads_whole_on_demand() -> None:
    """``singleton-sidecar run``'s way of loading prometheus_client (package_parts): the core
    alone for the sidecar; the package whole on the first use of a name of it, once, from any
    number of threads at once; a submodule alone when only that is asked for."""
    result = subprocess.run([sys.executable, "-c", PACKAGE_ON_DEMAND], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[]", "prometheus_client.parser False", "['# HELP', '# HELP', '# HELP', '# HELP']",
        "True prometheus_client.exposition"]
